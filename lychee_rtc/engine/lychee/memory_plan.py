"""GPU memory plan of a lychee engine, from its configs alone (nothing allocated).

Per session count C the plan adds up, from ``config.json``, ``flow.yaml`` and the profile's settings:

* LM weights: every tensor the loader keeps (the three unused side embedding tables are never
  loaded) in the profile's dtype;
* KV cache: the runner's static caches, one row per slot plus a scratch row for padding rows of a
  batch bucket: ``(C + 1) x layers(all four stacks) x 2 x kv_heads x max_seq x head_dim`` values,
  plus the per-row speech history of the no-repeat rule; with context slides on (the default), a
  staging row per slot more and each slot's stored audio features (``max_seq / 10 + 1`` windows x 5
  x hidden), what a slide re-prefills from (``slide.py``);
* vocoder weights: flow (in its dtype) + HiFT (fp32) + the CFM noise buffer;
* vocoder voices: the primed estimator and conformer caches of each cached voice
  (``P`` prompt frames x 10 Euler steps x depth x 2 CFG rows x heads x 2 head_dim);
* vocoder streams: per session the estimator cache at its bound after the reference's trim
  (``P + 100 + 2 hop`` frames) and the conformer cache at ``max_speech_tokens``;
* activations: the live tensors of the largest window program (listening forward over 10
  positions, or one speaking step with the full-vocabulary text head) for a batch of C, the graph
  pool being shared by all programs;
* a fixed reserve for the CUDA context, cuBLAS/cuDNN workspaces and the allocator's slack.

These are estimates of what the code allocates; ``lychee-rtc bench gpu`` measures the peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import LycheeConfig

GIB = 2**30
# nvidia-smi reports an H200 (141 GB HBM3e) as 143,771 MiB.
H200_GIB = 143771 / 1024
RUNTIME_RESERVE_GIB = 1.5
LISTEN_POSITIONS = 10
TRIM_KEEP = 100  # frames the estimator-cache trim keeps beyond the prompt (cfm.trim_estimator_cache)


@dataclass(frozen=True)
class VocoderGeometry:
    """What the vocoder's memory depends on (from flow.yaml / the released HiFT, and the profile)."""

    flow_params: int
    hift_params: int
    flow_bytes: int  # per value, the profile's token2wav dtype
    noise_frames: int
    mel: int
    steps: int  # Euler steps, one estimator cache slot each
    depth: int
    heads: int
    head_dim: int
    hidden: int
    enc_blocks: int
    enc_up_blocks: int
    enc_heads: int
    enc_head_dim: int
    up_rate: int
    hop: int
    prompt_tokens: tuple[int, ...]  # per configured voice
    max_cached_voices: int

    @property
    def frame_bytes(self) -> int:
        """Estimator cache per mel frame: steps x depth x 2 CFG rows x heads x (k|v) head_dim."""
        return self.steps * self.depth * 2 * self.heads * 2 * self.head_dim * self.flow_bytes

    @property
    def token_bytes(self) -> int:
        """Conformer cache per token: the token-rate stack once, the frame-rate stack up_rate times."""
        per_frame = self.enc_heads * 2 * self.enc_head_dim * self.flow_bytes
        return (self.enc_blocks + self.enc_up_blocks * self.up_rate) * per_frame


@dataclass(frozen=True)
class PlanRow:
    sessions: int
    lm_weights_gib: float
    kv_cache_gib: float
    kv_per_session_gib: float
    vocoder_weights_gib: float
    vocoder_voices_gib: float
    vocoder_streams_gib: float
    activations_gib: float
    reserve_gib: float
    total_gib: float
    gpu_gib: float
    headroom_gib: float
    fits: bool
    max_sessions_that_fit: int = field(default=0)


def lm_weight_bytes(cfg: LycheeConfig, value_bytes: int) -> int:
    """Parameters the loader materialises (the model's own; the side embedding tables are not among them)."""
    import torch

    from .model import LycheeFD

    with torch.device("meta"):
        model = LycheeFD(cfg)
    return sum(p.numel() for p in model.parameters()) * value_bytes


def cache_bytes_per_row(cfg: LycheeConfig, max_seq: int, value_bytes: int) -> int:
    layers = sum(c.num_hidden_layers for c in (cfg.text, cfg.stoken, cfg.control, cfg.merge))
    t = cfg.text
    return layers * 2 * t.num_key_value_heads * max_seq * t.head_dim * value_bytes


def kv_bytes_per_row(cfg: LycheeConfig, max_seq: int, value_bytes: int) -> int:
    # + the speech history row (int64) of the no-repeat rule
    return cache_bytes_per_row(cfg, max_seq, value_bytes) + max_seq * 8


def slide_bytes_per_session(cfg: LycheeConfig, max_seq: int, value_bytes: int) -> int:
    """With context slides: the slot's staging cache row and its stored audio features."""
    features = (max_seq // 10 + 1) * 5 * cfg.text.hidden_size * value_bytes
    return cache_bytes_per_row(cfg, max_seq, value_bytes) + features


def context_bytes(cfg: LycheeConfig, sessions: int, max_seq: int, value_bytes: int, sliding: bool) -> int:
    """Every slot's caches and the scratch row, and with slides each slot's staging row and features."""
    slides = sessions * slide_bytes_per_session(cfg, max_seq, value_bytes) if sliding else 0
    return (sessions + 1) * kv_bytes_per_row(cfg, max_seq, value_bytes) + slides


def activation_bytes(cfg: LycheeConfig, batch: int, max_seq: int, value_bytes: int) -> int:
    """Live tensors of the largest window program for ``batch`` rows (an upper estimate).

    Listening: T = 10 positions; speaking: T = 1 with the full-vocabulary text logits in fp32.
    Per layer at most: the residual stream and its normed copy, q|k|v, the cache rows gathered for
    the batch, the keys and values expanded to every query head and the fp32 scores (if the
    attention kernel falls back to the plain path), the MLP's gate|up and product; plus the step's
    mask and RoPE tables, the branch taps held while the main stack runs on, and the logits.
    """
    t = cfg.text
    h, heads, kv_heads, d = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    qkv = (heads + 2 * kv_heads) * d

    def program(positions: int, vocab_logits: int) -> int:
        bt = batch * positions
        per_layer = bt * (3 * h + qkv + 3 * t.intermediate_size) * value_bytes
        per_layer += 2 * batch * kv_heads * max_seq * d * value_bytes  # k, v rows of this batch
        per_layer += 2 * batch * heads * max_seq * d * value_bytes  # k, v expanded to the query heads
        per_layer += batch * heads * positions * max_seq * 4  # scores
        mask = batch * positions * max_seq
        rope = 2 * bt * d * value_bytes
        logits = batch * vocab_logits * 4 * 2  # logits and their softmax, fp32
        taps = 3 * bt * h * value_bytes
        return per_layer + mask + rope + logits + taps

    return max(program(LISTEN_POSITIONS, 2), program(1, t.vocab_size))


def vocoder_bytes(g: VocoderGeometry, sessions: int, max_speech_tokens: int) -> tuple[int, int, int]:
    """(weights, cached voices, streams) in bytes."""
    weights = g.flow_params * g.flow_bytes + g.hift_params * 4 + g.noise_frames * g.mel * g.flow_bytes
    cached = sorted(g.prompt_tokens, reverse=True)[: g.max_cached_voices]
    voices = sum(2 * p * g.frame_bytes + p * g.token_bytes for p in cached)
    longest = max(g.prompt_tokens, default=0)
    per_stream = (2 * longest + TRIM_KEEP + 2 * g.hop) * g.frame_bytes + (longest + max_speech_tokens) * g.token_bytes
    return weights, voices, sessions * per_stream


def plan(cfg: LycheeConfig, *, sessions: int, max_seq: int, lm_value_bytes: int, vocoder: VocoderGeometry | None,
         max_speech_tokens: int = 1000, gpu_gib: float = H200_GIB, sliding: bool = True) -> PlanRow:
    w = lm_weight_bytes(cfg, lm_value_bytes)
    row = kv_bytes_per_row(cfg, max_seq, lm_value_bytes)
    if sliding:
        row += slide_bytes_per_session(cfg, max_seq, lm_value_bytes)
    kv = context_bytes(cfg, sessions, max_seq, lm_value_bytes, sliding)
    vw, vv, vs = vocoder_bytes(vocoder, sessions, max_speech_tokens) if vocoder is not None else (0, 0, 0)
    act = activation_bytes(cfg, sessions, max_seq, lm_value_bytes)
    total = w + kv + vw + vv + vs + act + RUNTIME_RESERVE_GIB * GIB
    out = PlanRow(sessions, w / GIB, kv / GIB, row / GIB, vw / GIB, vv / GIB, vs / GIB, act / GIB, RUNTIME_RESERVE_GIB,
                  total / GIB, gpu_gib, gpu_gib - total / GIB, total / GIB <= gpu_gib)
    return _with_capacity(out, cfg, max_seq, lm_value_bytes, vocoder, max_speech_tokens, gpu_gib, sliding)


def _with_capacity(row: PlanRow, cfg: LycheeConfig, max_seq: int, lm_value_bytes: int,
                   vocoder: VocoderGeometry | None, max_speech_tokens: int, gpu_gib: float, sliding: bool) -> PlanRow:
    """How many sessions this GPU holds with these settings (the largest C whose total fits)."""
    from dataclasses import replace

    weights = row.lm_weights_gib * GIB

    def total(c: int) -> float:
        vw, vv, vs = vocoder_bytes(vocoder, c, max_speech_tokens) if vocoder is not None else (0, 0, 0)
        return (weights + context_bytes(cfg, c, max_seq, lm_value_bytes, sliding)
                + vw + vv + vs + activation_bytes(cfg, c, max_seq, lm_value_bytes)) / GIB + RUNTIME_RESERVE_GIB

    lo, hi = 0, 1
    while total(hi) <= gpu_gib and hi < 4096:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= gpu_gib else (lo, mid)
    return replace(row, max_sessions_that_fit=lo)


def format_plan(rows: list[PlanRow]) -> str:
    head = ("| C | LM weights | KV cache (per session) | vocoder weights | voices | vocoder streams | activations "
            "| reserve | total | GPU | headroom | fits |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| C{r.sessions} | {r.lm_weights_gib:.2f} | {r.kv_cache_gib:.2f} ({r.kv_per_session_gib:.3f}) | "
                     f"{r.vocoder_weights_gib:.2f} | {r.vocoder_voices_gib:.2f} | {r.vocoder_streams_gib:.2f} | "
                     f"{r.activations_gib:.3f} | {r.reserve_gib:.1f} | {r.total_gib:.2f} | {r.gpu_gib:.1f} | "
                     f"{r.headroom_gib:.1f} | {'yes' if r.fits else 'NO'} |")
    return "\n".join(lines) + "\n(GiB; " + (f"at most {rows[0].max_sessions_that_fit} sessions fit with these settings)"
                                             if rows else ")")
