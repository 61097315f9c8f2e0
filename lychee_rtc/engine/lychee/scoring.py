"""Teacher-forced scoring: per-position logits of the three channels for given id sequences.

This is the reference's training forward (``LycheeFD.forward`` with ``apply_internal_merge``)
expressed with our modules: the system prefix gets only its text embedding, every later position
the sum of four channels, and the merge branch at position p sees E[text(p+1)] (zeros at the last
position, as in the reference). Logits at position p predict the tokens of position p+1. It is
what parity tests compare against the reference, and what the streaming runner must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .audio import FEATURES_PER_WINDOW, WINDOW_SAMPLES, encode_windows, mel_filterbank
from .config import SpecialTokens
from .model import LycheeFD

POSITIONS_PER_WINDOW = 10


@dataclass(frozen=True)
class ScoringResult:
    """Float32 logits over the full vocabulary for every position (prefix included): (N, V)."""

    text_logits: Tensor
    speech_logits: Tensor
    control_logits: Tensor
    prefix_len: int


def audio_channel(model: LycheeFD, feats: Tensor, n_positions: int, audio_pad: int) -> Tensor:
    """(W, 5, H) window features -> (n_positions, H): feature at even positions, E[AudioPad] at odd."""
    h = feats.shape[-1]
    pad = model.embed_tokens.weight[audio_pad]
    slots = torch.empty((n_positions, h), dtype=model.embed_tokens.weight.dtype, device=feats.device)
    slots[:] = pad
    flat = feats.reshape(-1, h).to(slots.dtype)
    even = torch.arange(0, n_positions, 2, device=feats.device)
    slots[even] = flat[: even.numel()]
    return slots


@torch.no_grad()
def score_teacher_forced(
    model: LycheeFD,
    tokens: SpecialTokens,
    prefix_ids: Sequence[int],
    text_ids: Sequence[int],
    stoken_ids: Sequence[int],
    control_ids: Sequence[int],
    audio: np.ndarray | Tensor,
) -> ScoringResult:
    """Score one sequence. ``audio`` is 16 kHz mono float with 6400 samples per 10 positions."""
    t = len(text_ids)
    if not (len(stoken_ids) == len(control_ids) == t):
        raise ValueError("text, stoken and control sequences must have the same length")
    if t % POSITIONS_PER_WINDOW:
        raise ValueError("the number of positions must be a multiple of 10 (one 400 ms window each)")
    device = model.lm_head.weight.device
    wav = torch.as_tensor(np.asarray(audio, dtype=np.float32) if not isinstance(audio, Tensor) else audio)
    n_windows = t // POSITIONS_PER_WINDOW
    if wav.numel() != n_windows * WINDOW_SAMPLES:
        raise ValueError(f"expected {n_windows * WINDOW_SAMPLES} audio samples for {t} positions, got {wav.numel()}")
    windows = wav.to(device).float().view(n_windows, WINDOW_SAMPLES)
    feats = encode_windows(model.encoder, model.adapter, mel_filterbank(device=device), windows)
    assert feats.shape[1] == FEATURES_PER_WINDOW

    p = len(prefix_ids)
    n = p + t
    model.setup_caches(1, n)
    prefix = torch.tensor([list(prefix_ids)], device=device)
    text = torch.tensor([list(text_ids)], device=device)
    stoken = torch.tensor([list(stoken_ids)], device=device)
    control = torch.tensor([list(control_ids)], device=device)

    e = model.embed_tokens
    x = torch.cat([e(prefix), model.embed_channels(text, stoken, control, audio_channel(model, feats, t, tokens.audio_pad)[None])], dim=1)
    all_text = torch.cat([prefix, text], dim=1)
    next_embeds = torch.zeros_like(x)
    next_embeds[:, :-1] = e(all_text[:, 1:])

    pos = torch.arange(n, device=device)[None]
    ctx = model.context(pos, None)
    out = model.forward_positions(x, next_embeds, ctx)
    return ScoringResult(
        text_logits=model.head(out.text_hidden)[0].float(),
        speech_logits=model.head(out.speech_hidden)[0].float(),
        control_logits=model.head(out.control_hidden)[0].float(),
        prefix_len=p,
    )
