"""Write a Lychee-FD checkpoint with random values in the released layout, at full size.

Speed does not depend on the weights' values, so a random checkpoint in the released layout
measures the serving path (loading, memory, the GPU step) exactly as the real one would. The
folder is the one ``lychee-rtc download --dir DIR`` leaves:

* ``DIR/lychee_full_duplex/``: ``config.json`` in the released layout (28/4/4/4 Qwen2 layers,
  hidden 3584, vocab 158363, 32-layer 1280-wide audio encoder), ``generation_config.json``, the 982
  tensors in ``model-0000i-of-00006.safetensors`` with ``model.safetensors.index.json``, and
  Qwen2-style tokenizer files with every special token at its released id;
* ``DIR/token2wav/``: ``flow.yaml``, ``flow.pt`` (605 tensors), ``hift.pt`` (328) at the released
  widths, and the two ONNX models as small valid graphs with the released inputs and outputs.

Memory stays bounded: each shard's header is written first (names, shapes and offsets are known
from the config), then every tensor is generated and written a block of rows at a time (at most
``BLOCK_ELEMENTS`` values), so the writer never holds more than one block of the 25 GB. Values are
deterministic from the seed: every tensor has its own generator, seeded from the seed and its
name, so a tensor's values do not depend on which shard it lands in. ``--size tiny`` writes the
tiny layout through the same code (for checks on a CPU).

``lychee-rtc random-checkpoint DIR`` calls :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import resource
import struct
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from .config import parse_config
from .model import LycheeFD, checkpoint_targets, ignored_tensors
from .tiny import TinySpec, decision_bias_edit, random_tensor, tiny_config, write_tiny_tokenizer

# The released dimensions (docs/lychee_fd.md), in the spec the tiny writer understands.
RELEASED_SPEC = TinySpec(hidden=3584, heads=28, kv_heads=4, intermediate=18944, main_layers=28, branch_layers=4,
                         control_branch_layer=8, audio_state=1280, audio_heads=20, audio_layers=32, audio_ctx=1500,
                         max_positions=16384, vocab_layout="released", shards=6)
MODEL_FOLDER = "lychee_full_duplex"  # the released repository's folders
VOCODER_FOLDER = "token2wav"
BLOCK_ELEMENTS = 1 << 24  # values generated at once (64 MB in fp32)

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class WriteReport:
    folder: str
    tensors: int
    shards: int
    model_bytes: int
    vocoder_bytes: int
    wall_s: float
    cpu_s: float
    model_peak_rss_mib: float  # after the Lychee-FD folder (the streamed part)
    peak_rss_mib: float  # after Token2Wav too (its two state dicts are built whole, 0.7 GB)
    seed: int
    dtype: str


def spec_for(size: str, decision_bias: float = 0.0) -> TinySpec:
    from dataclasses import replace

    base = RELEASED_SPEC if size == "full" else TinySpec()
    return replace(base, decision_bias=decision_bias)


def checkpoint_entries(raw: dict) -> list[TensorEntry]:
    """Every tensor of the checkpoint the config implies (names in the checkpoint's order)."""
    cfg = parse_config(raw)
    with torch.device("meta"):
        model = LycheeFD(cfg)
    entries = [TensorEntry(name, tuple(t.shape)) for name, t in checkpoint_targets(model).items()]
    entries += [TensorEntry(name, shape) for name, shape in ignored_tensors(cfg).items()]
    return entries


def split_shards(entries: list[TensorEntry], shards: int, itemsize: int) -> list[list[TensorEntry]]:
    """Consecutive runs of about equal bytes: a tensor goes to the shard its first byte falls in."""
    total = sum(e.numel for e in entries) * itemsize
    out: list[list[TensorEntry]] = [[] for _ in range(shards)]
    offset = 0
    for e in entries:
        out[min(shards - 1, offset * shards // total)].append(e)
        offset += e.numel * itemsize
    return [s for s in out if s]


def tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def row_blocks(shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """(first row, rows) blocks of a tensor, each at most BLOCK_ELEMENTS values."""
    if len(shape) < 2:
        yield 0, shape[0] if shape else 1
        return
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    step = max(1, BLOCK_ELEMENTS // per_row)
    for r in range(0, shape[0], step):
        yield r, min(step, shape[0] - r)


def random_blocks(entry: TensorEntry, seed: int, dtype: torch.dtype, device: torch.device,
                  edit: Callable[[str, torch.Tensor, int], None] | None) -> Iterator[torch.Tensor]:
    """The tensor's values a block of rows at a time, in ``dtype`` on the CPU."""
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, entry.name))
    for first, rows in row_blocks(entry.shape):
        shape = (rows, *entry.shape[1:]) if entry.shape else ()
        block = random_tensor(entry.name, shape, g, device, full_shape=entry.shape)
        if edit is not None:
            edit(entry.name, block, first)
        yield block.to(dtype).cpu().contiguous()


def write_safetensors(path: Path, entries: list[TensorEntry], dtype: torch.dtype,
                      blocks: Callable[[TensorEntry], Iterator[torch.Tensor]]) -> int:
    """One safetensors file, header first, then each tensor's blocks as they come; returns bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        size = e.numel * itemsize
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(e.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for e in entries:
            written = 0
            for block in blocks(e):
                # bf16 has no numpy dtype: write the raw 16-bit words.
                raw = block.view(torch.int16) if itemsize == 2 else block
                f.write(memoryview(raw.numpy()).cast("B"))
                written += block.numel()
            if written != e.numel:
                raise RuntimeError(f"writer bug: {e.name} got {written} values, expected {e.numel}")
    return 8 + len(text) + offset


def write_model(out: Path, *, spec: TinySpec, seed: int, dtype: torch.dtype, device: torch.device,
                progress: bool = True) -> tuple[int, int, int]:
    """The Lychee-FD folder: config, tokenizer, sharded random weights. Returns (tensors, shards, bytes)."""
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(spec)
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    entries = checkpoint_entries(raw)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = split_shards(entries, max(1, spec.shards), itemsize)
    edit = None
    if spec.decision_bias:
        def edit(name: str, block: torch.Tensor, first: int) -> None:
            decision_bias_edit(name, block, first, raw, spec.decision_bias)
    total = sum(e.numel for e in entries) * itemsize
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing Lychee-FD", disable=not progress)

    def blocks(e: TensorEntry) -> Iterator[torch.Tensor]:
        for block in random_blocks(e, seed, dtype, device, edit):
            bar.update(block.numel() * itemsize)
            yield block

    weight_map: dict[str, str] = {}
    written = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        written += write_safetensors(out / name, shard, dtype, blocks)
        weight_map.update({e.name: name for e in shard})
    bar.close()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True}, indent=2))
    write_tiny_tokenizer(out, spec)
    return len(entries), len(shards), written


def write_vocoder(out: Path, size: str, seed: int) -> int:
    """The token2wav folder at the released widths (or tiny). Returns its bytes."""
    from lychee_rtc.vocoder.token2wav.config import FlowConfig, HiftConfig
    from lychee_rtc.vocoder.token2wav.tiny import TINY_FLOW, TINY_HIFT, write_tiny_token2wav

    flow, hift = (FlowConfig(), HiftConfig()) if size == "full" else (TINY_FLOW, TINY_HIFT)
    folder = write_tiny_token2wav(out, seed=seed, flow_config=flow, hift_config=hift)
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kB on Linux


def write_random_checkpoint(out: str | Path, *, size: str = "full", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                            decision_bias: float = 0.0, device: str = "cpu", vocoder: bool = True,
                            shards: int | None = None, progress: bool = True) -> WriteReport:
    from dataclasses import replace

    out = Path(out)
    spec = spec_for(size, decision_bias)
    if shards is not None:
        spec = replace(spec, shards=shards)
    t0, c0 = time.monotonic(), time.process_time()
    tensors, n_shards, model_bytes = write_model(out / MODEL_FOLDER, spec=spec, seed=seed, dtype=dtype,
                                                 device=torch.device(device), progress=progress)
    model_peak = peak_rss_mib()
    vocoder_bytes = write_vocoder(out / VOCODER_FOLDER, size, seed) if vocoder else 0
    return WriteReport(str(out), tensors, n_shards, model_bytes, vocoder_bytes, round(time.monotonic() - t0, 1),
                       round(time.process_time() - c0, 1), round(model_peak, 1), round(peak_rss_mib(), 1), seed,
                       str(dtype).removeprefix("torch."))


# --------------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output folder (gets lychee_full_duplex/ and token2wav/, as a download does)")
    parser.add_argument("--size", choices=("full", "tiny"), default="full",
                        help="the released dimensions (default; about 26 GB in bf16) or the tiny test layout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--shards", type=int, help="safetensors shards (default: 6 full, as released; 3 tiny)")
    parser.add_argument("--decision-bias", type=float, default=0.0,
                        help="> 0: the random model keeps listening until a commit and then speaks until "
                             "<tts_end> (what the end-to-end benchmark needs); 0: purely random decisions")
    parser.add_argument("--device", default="cpu",
                        help="where the values are generated (cuda is much faster; values differ per device)")
    parser.add_argument("--no-vocoder", action="store_true", help="do not write token2wav/")
    parser.add_argument("--json", help="also write the report (size, time, peak memory) here")


def run(args: argparse.Namespace) -> int:
    from .checkpoint import parse_dtype

    report = write_random_checkpoint(args.out, size=args.size, seed=args.seed, dtype=parse_dtype(args.dtype),
                                     decision_bias=args.decision_bias, device=args.device,
                                     vocoder=not args.no_vocoder, shards=args.shards,
                                     progress=sys.stderr.isatty())
    gib = 2**30
    print(f"wrote {report.tensors} tensors in {report.shards} shards ({report.model_bytes / gib:.2f} GiB) to "
          f"{Path(report.folder) / MODEL_FOLDER}" + (f" and Token2Wav ({report.vocoder_bytes / gib:.2f} GiB) to "
                                                      f"{Path(report.folder) / VOCODER_FOLDER}" if report.vocoder_bytes else ""))
    print(f"in {report.wall_s:.1f} s ({report.cpu_s:.1f} s of CPU), peak RSS {report.model_peak_rss_mib:.0f} MiB "
          f"writing the model, {report.peak_rss_mib:.0f} MiB in all")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 0
