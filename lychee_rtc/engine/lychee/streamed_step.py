"""One window step of a full-size Lychee-FD on a CPU, a layer at a time from the memory-mapped shards.

The rehearsal of the GPU run on a machine that cannot hold the model: the same modules the runner
uses (``DecoderLayer``, ``AudioEncoder``'s blocks, the adapter, ``lm_head``), built on ``meta`` and
given weights one at a time, straight from the safetensors shards; each is run and dropped before
the next is read, so memory holds one layer (a main-stack layer is 233 M parameters), never the
model. What it computes is the first step of a fresh session, as ``LycheeRunner`` does it:

* the system prefix (``prefill``) and the first listening window's 9 positions
  (``listen_window``) in one causal pass through the 28 main layers, the stoken and control
  branches from their taps and the merge stack: the same positions, tokens and audio slots;
* the audio encoder (32 blocks) and adapter over the window's 6400 samples;
* the window's decision (S-S or K-L at slot 9, with the profile's ``start_speak_factor``), and
  the full-vocabulary text head and the speech head at the last position, read in row blocks.

Every shard is opened for one module and closed after it, so its mapped pages leave the process.
"""

from __future__ import annotations

import ctypes
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor, nn

from .audio import FEATURES_PER_WINDOW, WINDOW_SAMPLES, mel_filterbank, window_mel
from .checkpoint import _shard_map
from .config import load_config
from .decode import CHUNK
from .model import KVCache, LycheeFD, StepContext, checkpoint_targets
from .runner import DEFAULT_INSTRUCTIONS, SYSTEM_TEMPLATE
from .sampling import control_decision
from .tokenizer import Tokenizer

HEAD_ROWS = 8192  # lm_head rows read at once for the full-vocabulary head (56 MiB in fp32)
DEFAULT_SYSTEM = SYSTEM_TEMPLATE.format(instructions=DEFAULT_INSTRUCTIONS)  # the runner's default prefix


@dataclass
class StepReport:
    prefix_tokens: int
    positions: int  # post-prefix positions fed
    modules_loaded: int
    bytes_read: int
    wall_s: float
    cpu_s: float
    peak_rss_mib: float
    rss_at_start_mib: float
    decision: str  # S-S | K-L
    decision_probs: tuple[float, float]
    text_token: int
    speech_token: int


@dataclass
class StepOutput:
    """The step's results, for comparing with the in-memory runner."""

    probs: Tensor  # (2,) S-S, K-L
    text_logits: Tensor  # (vocab,)
    speech_logits: Tensor  # (stoken_max - stoken_min,)


def _libc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _libc_trim()


def release_freed_memory() -> None:
    """Hand the memory of a dropped layer back to the system. glibc keeps freed blocks under its
    (adaptive, up to 32 MB) mmap threshold in the heap, where a layer's q/o projections leave holes
    that the next layer's allocations do not fill: without a trim the process grows ~30 MB a layer."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class ShardReader:
    """Tensors by checkpoint name; each call opens the shards it needs and closes them after."""

    def __init__(self, root: Path):
        self.root = root
        self.where = _shard_map(root)
        self.bytes_read = 0

    def load_into(self, targets: dict[str, Tensor]) -> None:
        by_shard: dict[str, list[str]] = {}
        for name in targets:
            by_shard.setdefault(self.where[name], []).append(name)
        with torch.no_grad():
            for shard, names in by_shard.items():
                with safe_open(str(self.root / shard), framework="pt") as f:
                    for name in names:
                        t = f.get_tensor(name)
                        targets[name].copy_(t)  # converts in place when the dtypes differ
                        self.bytes_read += t.numel() * t.element_size()

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        with safe_open(str(self.root / self.where[name]), framework="pt") as f:
            t = f.get_slice(name)[start:stop]
        self.bytes_read += t.numel() * t.element_size()
        return t.to(dtype)


class LayerLoader:
    """Materialises one module of a meta-built model with its checkpoint weights, and drops it."""

    def __init__(self, model: LycheeFD, reader: ShardReader):
        self.model = model
        self.reader = reader
        self.loaded = 0

    def run(self, fn: Callable[[], Any], *parts: tuple[nn.Module, str]) -> Any:
        """Give each (module, checkpoint prefix) its weights, call ``fn``, drop the weights again."""
        for module, _ in parts:
            module.to_empty(device="cpu")
        try:
            prefixes = tuple(prefix for _, prefix in parts)
            targets = {n: t for n, t in checkpoint_targets(self.model).items() if n.startswith(prefixes)}
            if not targets:
                raise KeyError(f"no checkpoint tensor under {prefixes}")
            self.reader.load_into(targets)
            del targets
            self.loaded += 1
            with torch.no_grad():
                return fn()
        finally:
            for module, _ in parts:
                module.to_empty(device="meta")
            release_freed_memory()


def _embed_rows(reader: ShardReader, ids: list[int], dtype: torch.dtype) -> dict[int, Tensor]:
    """Rows of ``model.embed_tokens`` for the ids used (never the whole table)."""
    return {i: reader.rows("model.embed_tokens.weight", i, i + 1, dtype)[0] for i in sorted(set(ids))}


def step_inputs(tok) -> tuple[list[int], list[int], list[int]]:
    """The first window's tokens as the runner feeds them: positions 0..8, Sleep... and Detect at 8."""
    n = CHUNK - 1
    control = [tok.detect if p % CHUNK == CHUNK - 2 else tok.sleep for p in range(n)]
    return [tok.text_pad] * n, [tok.stoken_pad] * n, control


def run_streamed(root: str | Path, *, window: np.ndarray | None = None, dtype: torch.dtype = torch.float32,
                 start_speak_factor: float = 1.2, seed: int = 0) -> tuple[StepOutput, StepReport]:
    """The first window step of a fresh session, one module at a time; see the module docstring."""
    root = Path(root)
    rss0 = _rss_mib()
    t0, c0 = time.monotonic(), time.process_time()
    cfg = load_config(root)
    tokenizer = Tokenizer.from_dir(root)
    tok = cfg.resolve_tokens(tokenizer)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LycheeFD(cfg)
    finally:
        torch.set_default_dtype(previous)
    reader = ShardReader(root)
    loader = LayerLoader(model, reader)
    if window is None:
        window = (0.05 * np.random.default_rng(seed).standard_normal(WINDOW_SAMPLES)).astype(np.float32)

    # Audio: encoder stem, its blocks one by one, pooling and norm, adapter.
    mel, lengths = window_mel(torch.from_numpy(window)[None], mel_filterbank())
    enc = model.encoder
    x, key_mask = loader.run(lambda: enc.stem(mel.to(dtype), lengths), (enc.conv1, "encoder.conv1."),
                             (enc.conv2, "encoder.conv2."), (enc.positional_embedding, "encoder.positional_embedding."))
    for i, block in enumerate(enc.blocks):
        x = loader.run(lambda b=block, x=x: b(x, key_mask), (block, f"encoder.blocks.{i}."))
    x = loader.run(lambda x=x: enc.finish(x), (enc.after_norm, "encoder.after_norm."))
    feats = loader.run(lambda: model.adapter(x), (model.adapter, "adapter."))[0, :FEATURES_PER_WINDOW]

    # The input: prefix (text only), then the window's summed channels with audio at even slots.
    prefix_ids = tokenizer.encode(DEFAULT_SYSTEM)
    text, stoken, control = step_inputs(tok)
    rows = _embed_rows(reader, prefix_ids + text + stoken + control + [tok.audio_pad], dtype)
    prefix_x = torch.stack([rows[i] for i in prefix_ids])
    post = []
    for p, (a, b, c) in enumerate(zip(text, stoken, control)):
        audio = feats[p // 2] if p % 2 == 0 else rows[tok.audio_pad]
        post.append(rows[a] + rows[b] + rows[c] + audio.to(dtype))
    h = torch.cat([prefix_x, torch.stack(post)])[None]
    nxt = torch.stack([rows[i] for i in prefix_ids[1:] + [tok.text_pad]] + [rows[tok.text_pad]] * len(text))[None]
    total = h.shape[1]
    ctx = StepContext.build(torch.arange(total)[None], None, total)

    def run_stack(stack, prefix: str, x: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        c = stack.cfg
        rope = ctx.rope(c, dtype)
        for i in range(start, stop if stop is not None else len(stack.layers)):
            layer = stack.layers[i]

            def forward(layer=layer, x=x) -> Tensor:
                layer.self_attn.kv_cache = KVCache(1, c.num_key_value_heads, total, c.head_dim, dtype, "cpu")
                try:
                    return layer(x, rope, ctx.mask, ctx.input_pos, None)
                finally:
                    layer.self_attn.kv_cache = None
            x = loader.run(forward, (layer, f"{prefix}.layers.{i}."))
        return x

    def norm(stack, prefix: str, x: Tensor) -> Tensor:
        return loader.run(lambda: stack.norm(x), (stack.norm, f"{prefix}.norm."))

    cut = sorted({cfg.stoken_branch_index, cfg.control_branch_index})
    taps: dict[int, Tensor] = {}
    x, start = h, 0
    for k in cut:
        x = run_stack(model.model, "model", x, start, k)
        taps[k], start = x, k
    x = run_stack(model.model, "model", x, start)
    text_hidden = norm(model.model, "model", x)[0, -1]
    control_hidden = norm(model.control_model, "control_model",
                          run_stack(model.control_model, "control_model", taps[cfg.control_branch_index]))[0, -1]
    stoken_out = norm(model.stoken_model, "stoken_model",
                      run_stack(model.stoken_model, "stoken_model", taps[cfg.stoken_branch_index]))
    speech_hidden = norm(model.merge_model, "merge_model",
                         run_stack(model.merge_model, "merge_model", stoken_out + nxt))[0, -1]

    # Heads: two rows for the decision, every row for text (in blocks), the speech range.
    head = "lm_head.weight"
    decide = torch.stack([reader.rows(head, i, i + 1, dtype)[0] for i in (tok.start_speaking, tok.keep_listening)])
    choice, probs = control_decision((control_hidden @ decide.T)[None], start_speak_factor)
    vocab = cfg.text.vocab_size
    text_logits = torch.cat([reader.rows(head, r, min(r + HEAD_ROWS, vocab), dtype) @ text_hidden
                             for r in range(0, vocab, HEAD_ROWS)])
    lo, hi = cfg.stoken_token_ids_min, cfg.stoken_token_ids_max
    speech_logits = torch.cat([reader.rows(head, r, min(r + HEAD_ROWS, hi), dtype) @ speech_hidden
                               for r in range(lo, hi, HEAD_ROWS)])
    p = probs[0].tolist()
    report = StepReport(
        prefix_tokens=len(prefix_ids), positions=len(text), modules_loaded=loader.loaded, bytes_read=reader.bytes_read,
        wall_s=round(time.monotonic() - t0, 1), cpu_s=round(time.process_time() - c0, 1),
        peak_rss_mib=round(_rss_mib(), 1), rss_at_start_mib=round(rss0, 1),
        decision="S-S" if int(choice[0]) == 0 else "K-L", decision_probs=(round(p[0], 4), round(p[1], 4)),
        text_token=int(text_logits.argmax()), speech_token=lo + int(speech_logits.argmax()))
    return StepOutput(probs[0], text_logits, speech_logits), report
