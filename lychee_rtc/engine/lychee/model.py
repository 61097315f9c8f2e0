"""Lychee-FD in plain PyTorch: four Qwen2 decoder stacks, their branch points, the summed
four-channel input embedding, the audio encoder + adapter, and the shared ``lm_head``.

Layout (L, S, C, M layers; B = control_branch_layer, counted from the top)::

    e(p) = E[text] + E[stoken] + E[control] + A(p)            (prefix positions: E[text] only)
    main stack  : e -> layers 0..L-1 -> model.norm -> lm_head            -> text logits
    control     : residual after L-B layers -> control_model -> norm -> lm_head -> control logits
    stoken      : residual after L-S layers -> stoken_model -> norm
    merge       : stoken_out + E[next text] -> merge_model -> norm -> lm_head -> speech logits

"Residual after k layers" is the hidden state between layer k-1 and layer k, before any final
norm. All channels share the single ``model.embed_tokens`` table; the checkpoint's three side
tables are never used and never materialised.

gpt-fast conventions: every stack owns static KV caches ``(max_batch, kv_heads, max_seq, head_dim)``
written with ``update(rows, input_pos, k, v)``; callers pass absolute positions (and the cache rows
of the sessions in the batch) explicitly, so nothing depends on hidden counters and the runner's
window step is captured as a CUDA graph (``graphs.py``). Caches hold one row per session plus one
scratch row for the padding rows of a batch bucket. q/k/v and gate/up are fused at load time (``checkpoint_targets``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .audio import Adaptor, AudioEncoder
from .config import DecoderConfig, LycheeConfig


class KVCache(nn.Module):
    def __init__(self, max_batch: int, n_kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        shape = (max_batch, n_kv_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, rows: Tensor | slice | None, input_pos: Tensor, k: Tensor, v: Tensor,
               key_len: int | None = None) -> tuple[Tensor, Tensor]:
        """Write k/v (B, H, T, D) at positions input_pos (B, T) of cache rows ``rows`` (B,); return
        the rows' keys and values at positions ``0..key_len-1`` (all of them by default).

        ``rows=None`` means the batch is rows 0..B-1 in order, a ``slice`` rows ``start..start+B-1``:
        the cache is then read as a view (no gather), which is the fast path the window programs take
        wherever a window of rows holds their slots (``graphs.batch_rows``), and a slide's
        re-prefill of consecutive staging rows.
        """
        b = k.shape[0]
        first = 0 if rows is None else rows.start if isinstance(rows, slice) else None
        idx = rows if first is None else torch.arange(first, first + b, device=k.device)
        assert isinstance(idx, Tensor)
        self.k_cache[idx[:, None], :, input_pos] = k.transpose(1, 2)
        self.v_cache[idx[:, None], :, input_pos] = v.transpose(1, 2)
        n = self.k_cache.shape[2] if key_len is None else key_len
        if first is not None:
            return self.k_cache[first:first + b, :, :n], self.v_cache[first:first + b, :, :n]
        return self.k_cache[idx, :, :n], self.v_cache[idx, :, :n]

    def reset_rows(self, rows: list[int]) -> None:
        self.k_cache[rows] = 0
        self.v_cache[rows] = 0

    def copy_positions(self, src: int, dst: int, n: int) -> None:
        """Positions 0..n-1 of row ``src`` into row ``dst``, in place (captured graphs keep the address)."""
        self.k_cache[dst, :, :n] = self.k_cache[src, :, :n]
        self.v_cache[dst, :, :n] = self.v_cache[src, :, :n]


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the bias attention adds to its scores: 0 seen, -inf not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


# Open keys pay for the second attention call and the merge only when there are many and they
# outnumber the masked tail (measured on a CPU at tiny size, 4 rows: 41 queries over 6500 keys 5 %
# cheaper than one attention with an additive mask, 160 queries 18 %; 41 over 1000 keys 20 % dearer).
OPEN_PREFIX_MIN = 8
OPEN_PREFIX_MIN_KEYS = 2048
# The CPU flash-attention kernel that also returns each query's log-sum-exp of its scores, which
# lets two attentions over disjoint key ranges merge exactly.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class OpenPrefixMask:
    """Attention over keys ``0..open-1`` that every query sees, unmasked, plus ``tail``, the
    additive mask (B, 1, T, K - open) over the keys after them. A slide's re-prefill pieces are
    like this: a piece of tens of positions attends to thousands of staged keys, all visible to
    it, and only its own positions need the causal mask."""

    open: int
    tail: Tensor


def mask_width(mask: "Tensor | OpenPrefixMask") -> int:
    """Key positions an attention with this mask reads."""
    return mask.open + mask.tail.shape[-1] if isinstance(mask, OpenPrefixMask) else mask.shape[-1]


def attend_open_prefix(q: Tensor, k: Tensor, v: Tensor, mask: OpenPrefixMask) -> Tensor:
    """Softmax attention of q over keys 0..K-1 as two attentions, the open keys without a mask and
    the tail with it, merged by their log-sum-exps: the same weights as one masked attention (to
    float rounding), without a mask over the open keys (the kernel reads no bias there)."""
    assert _FLASH_CPU is not None
    n = mask.open
    o1, lse1 = _FLASH_CPU(q, k[:, :, :n], v[:, :, :n])
    o2, lse2 = _FLASH_CPU(q, k[:, :, n:], v[:, :, n:], attn_mask=mask.tail)
    lse1, lse2 = lse1.float(), lse2.float()
    top = torch.maximum(lse1, lse2)  # every query sees at least one tail key: lse2 is finite
    w1, w2 = (lse1 - top).exp(), (lse2 - top).exp()
    return ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]).to(q.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Qwen2: normalise in fp32, cast back, then scale (order matters for bf16 parity).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(B, T) absolute positions -> cos, sin of shape (B, 1, T, head_dim), neox (half-split) layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_head = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.n_head + 2 * self.n_kv) * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: "Tensor | OpenPrefixMask", input_pos: Tensor,
                rows: Tensor | slice | None) -> Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.n_head * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q = q.view(b, t, self.n_head, d).transpose(1, 2)
        k = k.view(b, t, self.n_kv, d).transpose(1, 2)
        v = v.view(b, t, self.n_kv, d).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        assert self.kv_cache is not None, "call setup_caches() first"
        # The mask's width says how many key positions this forward can see (a prefill's fewer).
        k, v = self.kv_cache.update(rows, input_pos, k, v, key_len=mask_width(mask))
        if isinstance(mask, OpenPrefixMask):
            o = attend_open_prefix(q, k, v, mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_head)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_head * d))


class FeedForward(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: "Tensor | OpenPrefixMask", input_pos: Tensor,
                rows: Tensor | slice | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, input_pos, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """A run of Qwen2 layers plus a final norm (one of: main, stoken, control, merge)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def run(self, x: Tensor, ctx: "StepContext", start: int = 0, stop: int | None = None) -> Tensor:
        """Apply layers [start, stop) to the residual stream; no final norm."""
        rope = ctx.rope(self.cfg, x.dtype)
        mask = ctx.attention_mask(x.dtype)
        for layer in self.layers[start:stop]:
            x = layer(x, rope, mask, ctx.input_pos, ctx.rows)
        return x


@dataclass
class StepContext:
    """Positions, cache rows and the attention mask of one forward, shared by every stack."""

    input_pos: Tensor  # (B, T) absolute positions (system prefix included)
    rows: Tensor | slice | None  # (B,) KV-cache rows; None: rows 0..B-1; a slice: consecutive rows
    mask: Tensor  # (B, 1, T, K) bool: key position <= query position, over key positions 0..K-1
    _rope: dict | None = None
    open_keys: int = 0  # key positions 0..open_keys-1 are seen by every query (see attention_mask)
    _masks: dict | None = None

    @classmethod
    def build(cls, input_pos: Tensor, rows: Tensor | slice | None, key_len: int,
              open_keys: int = 0) -> "StepContext":
        """``key_len``: the cache positions attention reads, ``max_seq`` for the window programs
        (static shapes); a prefill whose positions end before that reads only what it can see.
        ``open_keys``: leading key positions every query sees, when the caller knows them (every
        query's position is at least that); ``attention_mask`` then skips their mask on a CPU."""
        keys = torch.arange(key_len, device=input_pos.device)
        mask = (keys[None, None, :] <= input_pos[:, :, None])[:, None]
        return cls(input_pos=input_pos, rows=rows, mask=mask, _rope={}, open_keys=open_keys, _masks={})

    def attention_mask(self, dtype: torch.dtype) -> "Tensor | OpenPrefixMask":
        """The mask every layer's attention takes, made once per forward: additive (0 seen, -inf
        not), which is what attention makes of a boolean mask on every call, once per layer, else.
        With ``open_keys`` worth skipping on a CPU, an ``OpenPrefixMask``: the open keys unmasked,
        the additive mask over the rest only."""
        assert self._masks is not None
        if dtype not in self._masks:
            tail = self.mask.shape[-1] - self.open_keys
            worth = 0 < self.open_keys and self.open_keys >= max(OPEN_PREFIX_MIN_KEYS, OPEN_PREFIX_MIN * tail)
            if worth and self.mask.device.type == "cpu" and _FLASH_CPU is not None:
                self._masks[dtype] = OpenPrefixMask(self.open_keys, additive(self.mask[..., self.open_keys:], dtype))
            else:
                self._masks[dtype] = additive(self.mask, dtype)
        return self._masks[dtype]

    def rope(self, cfg: DecoderConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        key = (cfg.head_dim, cfg.rope_theta, dtype)
        assert self._rope is not None
        if key not in self._rope:
            self._rope[key] = rope_cos_sin(self.input_pos, cfg.head_dim, cfg.rope_theta, dtype)
        return self._rope[key]


@dataclass
class TrunkOutput:
    text_hidden: Tensor  # main stack after model.norm
    stoken_hidden: Tensor  # stoken_model output after its norm (merge input minus text)
    control_hidden: Tensor  # control_model output after its norm


class LycheeFD(nn.Module):
    def __init__(self, cfg: LycheeConfig):
        super().__init__()
        self.cfg = cfg
        t = cfg.text
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.model = DecoderStack(cfg.text)
        self.stoken_model = DecoderStack(cfg.stoken)
        self.control_model = DecoderStack(cfg.control)
        self.merge_model = DecoderStack(cfg.merge)
        self.encoder = AudioEncoder(cfg.audio)
        self.adapter = Adaptor(cfg.audio)
        self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        self.max_batch = 0
        self.max_seq = 0

    # -- caches -----------------------------------------------------------------------------

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        """Allocate static KV caches for every layer of every stack, once."""
        dtype = self.lm_head.weight.dtype
        device = self.lm_head.weight.device
        for stack in (self.model, self.stoken_model, self.control_model, self.merge_model):
            c = stack.cfg
            for layer in stack.layers:
                layer.self_attn.kv_cache = KVCache(max_batch, c.num_key_value_heads, max_seq, c.head_dim, dtype, device)
        self.max_batch, self.max_seq = max_batch, max_seq

    def caches(self) -> list[KVCache]:
        out = []
        for stack in (self.model, self.stoken_model, self.control_model, self.merge_model):
            for layer in stack.layers:
                assert layer.self_attn.kv_cache is not None, "call setup_caches() first"
                out.append(layer.self_attn.kv_cache)
        return out

    def reset_rows(self, rows: list[int]) -> None:
        for cache in self.caches():
            cache.reset_rows(rows)

    def copy_positions(self, src: int, dst: int, n: int) -> None:
        """Every stack's cache positions 0..n-1 from row ``src`` to row ``dst`` (a context slide)."""
        for cache in self.caches():
            cache.copy_positions(src, dst, n)

    def context(self, input_pos: Tensor, rows: Tensor | slice | None, key_len: int | None = None,
                open_keys: int = 0) -> StepContext:
        """``key_len`` None: every cache position on a GPU (the window programs' static shapes, for
        their graphs); on a CPU, which runs them eagerly, only the positions up to the furthest
        query's (the later ones are masked for every query: reading them is wasted work)."""
        if key_len is None:
            cpu = input_pos.device.type == "cpu"
            key_len = min(self.max_seq, int(input_pos.max()) + 1) if cpu else self.max_seq
        return StepContext.build(input_pos, rows, key_len, open_keys)

    # -- embeddings -------------------------------------------------------------------------

    def embed_channels(self, text: Tensor, stoken: Tensor, control: Tensor, audio: Tensor) -> Tensor:
        """Sum of the four channels for post-prefix positions; ``audio`` is (B, T, H) already
        holding encoder features at feature slots and E[<|AudioPad|>] elsewhere."""
        e = self.embed_tokens
        return e(text) + e(stoken) + e(control) + audio.to(e.weight.dtype)

    # -- stacks -----------------------------------------------------------------------------

    def trunk(self, x: Tensor, ctx: StepContext) -> tuple[Tensor, Tensor, Tensor]:
        """Main stack. Returns (final hidden before norm, stoken tap, control tap)."""
        cfg = self.cfg
        cut = sorted({cfg.stoken_branch_index, cfg.control_branch_index})
        taps: dict[int, Tensor] = {}
        start = 0
        for k in cut:
            x = self.model.run(x, ctx, start, k)
            taps[k] = x
            start = k
        x = self.model.run(x, ctx, start, None)
        return x, taps[cfg.stoken_branch_index], taps[cfg.control_branch_index]

    def forward_branches(self, x: Tensor, ctx: StepContext) -> TrunkOutput:
        """Everything up to (not including) merge and the heads."""
        final, s_tap, c_tap = self.trunk(x, ctx)
        control = self.control_model.norm(self.control_model.run(c_tap, ctx))
        stoken = self.stoken_model.norm(self.stoken_model.run(s_tap, ctx))
        return TrunkOutput(self.model.norm(final), stoken, control)

    def merge(self, stoken_hidden: Tensor, next_text_embeds: Tensor, ctx: StepContext) -> Tensor:
        """Merge branch on stoken output + E[next text token] (B, T, H).

        The next text token of a position is the one sampled at that same step while speaking
        (text is always sampled before speech), the forced pad while listening.
        """
        x = stoken_hidden + next_text_embeds
        return self.merge_model.norm(self.merge_model.run(x, ctx))

    def head(self, hidden: Tensor, vocab_slice: slice | None = None) -> Tensor:
        """lm_head on full vocab, or on a contiguous id range (a view of the weight, no copy)."""
        w = self.lm_head.weight if vocab_slice is None else self.lm_head.weight[vocab_slice]
        return F.linear(hidden, w)

    def forward_positions(self, x: Tensor, next_text_embeds: Tensor, ctx: StepContext) -> "PositionsOutput":
        """Run every stack over positions whose next text token is already known.

        Used for the system prefix, listening windows (text is forced to <|TextPad|>) and
        teacher-forced scoring. Heads are left to the caller, which usually needs only a slice.
        """
        out = self.forward_branches(x, ctx)
        return PositionsOutput(out.text_hidden, self.merge(out.stoken_hidden, next_text_embeds, ctx), out.control_hidden)


@dataclass
class PositionsOutput:
    text_hidden: Tensor
    speech_hidden: Tensor  # merge output
    control_hidden: Tensor


def checkpoint_targets(model: LycheeFD) -> dict[str, Tensor]:
    """Checkpoint tensor name -> destination tensor (a view into a fused parameter where fused).

    This is where the checkpoint's layout meets ours: q/k/v land in slices of ``qkv_proj``,
    gate/up in slices of ``gate_up_proj``; everything else maps one to one.
    """
    out: dict[str, Tensor] = {}
    out["model.embed_tokens.weight"] = model.embed_tokens.weight
    out["lm_head.weight"] = model.lm_head.weight
    for prefix, stack in (("model", model.model), ("stoken_model", model.stoken_model),
                          ("control_model", model.control_model), ("merge_model", model.merge_model)):
        c = stack.cfg
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        i_sz = c.intermediate_size
        out[f"{prefix}.norm.weight"] = stack.norm.weight
        for i, layer in enumerate(stack.layers):
            p = f"{prefix}.layers.{i}"
            a = layer.self_attn
            out[f"{p}.self_attn.q_proj.weight"] = a.qkv_proj.weight[:q]
            out[f"{p}.self_attn.k_proj.weight"] = a.qkv_proj.weight[q:q + kv]
            out[f"{p}.self_attn.v_proj.weight"] = a.qkv_proj.weight[q + kv:]
            out[f"{p}.self_attn.q_proj.bias"] = a.qkv_proj.bias[:q]
            out[f"{p}.self_attn.k_proj.bias"] = a.qkv_proj.bias[q:q + kv]
            out[f"{p}.self_attn.v_proj.bias"] = a.qkv_proj.bias[q + kv:]
            out[f"{p}.self_attn.o_proj.weight"] = a.o_proj.weight
            out[f"{p}.mlp.gate_proj.weight"] = layer.mlp.gate_up_proj.weight[:i_sz]
            out[f"{p}.mlp.up_proj.weight"] = layer.mlp.gate_up_proj.weight[i_sz:]
            out[f"{p}.mlp.down_proj.weight"] = layer.mlp.down_proj.weight
            out[f"{p}.input_layernorm.weight"] = layer.input_layernorm.weight
            out[f"{p}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    # Encoder and adapter: our module names are the checkpoint's, so this is a strict name match.
    for name, param in model.encoder.named_parameters():
        out[f"encoder.{name}"] = param
    for name, param in model.adapter.named_parameters():
        out[f"adapter.{name}"] = param
    return out


def ignored_tensors(cfg: LycheeConfig) -> dict[str, tuple[int, ...]]:
    """Present in the checkpoint, checked for shape, never read: every channel uses the main table."""
    shape = (cfg.text.vocab_size, cfg.text.hidden_size)
    return {f"{m}.embed_tokens.weight": shape for m in ("stoken_model", "control_model", "merge_model")}
