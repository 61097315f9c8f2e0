"""Sampling rules of the Lychee-FD reference, as pure batched functions of logits and state.

Every function takes device tensors and returns device tensors, with no ``.item()`` and no
data-dependent Python branching, so a whole 10-step window runs without a host sync and can be
captured in a CUDA graph. State that the reference keeps inside stateful logits processors
(counters, "EOS seen" flags, the forced prefix cursor) is passed in and returned explicitly.

Rules (reference ``lychee_fd/runtime/vllm_generation.py``):

* text while speaking: greedy over the full vocabulary, ``<|EOT|>`` logit multiplied by
  ``end_speak_factor``; after ``<|EOT|>`` only ``<tts_pad>``; the 128th text step is forced EOT.
* speech while speaking: the first ``delay + 1`` steps are forced to ``<|StokenDelay|>``x delay +
  ``<tts_start>``; then only codec ids and ``<tts_end>``, no-repeat 4-gram over the session's whole
  speech channel, temperature 0.7 (top-k off, top-p 1); the 1000th sampled step is forced
  ``<tts_end>``.
* control: slots 0-7 Sleep, slot 8 Detect, slot 9 greedy between two decisions with one of them
  scaled (raw logit times factor, as the reference does; its effect depends on the logit's sign).

Random draws use the Gumbel-max trick with per-session generators, so a session's speech depends
only on its seed and its own history, never on which other sessions share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


@dataclass
class TextRuleState:
    count: Tensor  # (B,) int64 steps taken while no EOT seen
    has_eos: Tensor  # (B,) bool


@dataclass
class SpeechRuleState:
    prefix_count: Tensor  # (B,) int64 calls made (the forced prefix is consumed first)
    count: Tensor  # (B,) int64 sampled steps while no <tts_end> seen
    has_eos: Tensor  # (B,) bool


def text_rule_init(b: int, device: torch.device) -> TextRuleState:
    return TextRuleState(torch.zeros(b, dtype=torch.long, device=device), torch.zeros(b, dtype=torch.bool, device=device))


def speech_rule_init(b: int, device: torch.device) -> SpeechRuleState:
    z = torch.zeros(b, dtype=torch.long, device=device)
    return SpeechRuleState(z, z.clone(), torch.zeros(b, dtype=torch.bool, device=device))


def sample_text(logits: Tensor, last: Tensor, state: TextRuleState, *, eos: int, pad: int, max_tokens: int,
                end_speak_factor: float) -> tuple[Tensor, TextRuleState]:
    """Greedy text token for each row. ``logits`` (B, V) full vocabulary, ``last`` (B,) ids."""
    counting = ~state.has_eos
    count = state.count + counting.long()
    force_eos = counting & (count >= max_tokens)
    # The reference notices EOT by looking at the last token, and not on the call that forces it.
    has_eos = torch.where(force_eos, state.has_eos, state.has_eos | (last == eos))
    scaled = logits.float().clone()
    scaled[:, eos] = scaled[:, eos] * end_speak_factor
    greedy = scaled.argmax(dim=-1)
    out = torch.where(force_eos, torch.full_like(greedy, eos), torch.where(has_eos, torch.full_like(greedy, pad), greedy))
    return out, TextRuleState(count, has_eos)


def ngram_banned(history: Tensor, length: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Tokens that would repeat an n-gram of ``history`` (B, N) given its valid ``length`` (B,).

    Returns (ids (B, N-n+1), valid (B, N-n+1)): ``ids[b, i]`` is banned where ``valid[b, i]``. This
    is HF's NoRepeatNGramLogitsProcessor over the whole sequence, vectorised over a static buffer.
    """
    b, total = history.shape
    if n <= 0 or total < n:
        empty = history.new_zeros((b, 0))
        return empty, empty.bool()
    starts = total - n + 1
    idx = torch.arange(starts, device=history.device)
    tail_idx = (length[:, None] - (n - 1) + torch.arange(n - 1, device=history.device)[None]).clamp(min=0)
    tail = history.gather(1, tail_idx)  # (B, n-1): the last n-1 tokens
    match = torch.ones((b, starts), dtype=torch.bool, device=history.device)
    for j in range(n - 1):
        match &= history[:, j:j + starts] == tail[:, j:j + 1]
    valid = match & (idx[None] + n - 1 < length[:, None]) & (length[:, None] + 1 >= n)
    return history[:, n - 1:], valid


def sample_speech(logits: Tensor, offset: int, last: Tensor, history: Tensor, length: Tensor, state: SpeechRuleState,
                  *, prefix: Tensor, eos: int, code_lo: int, code_hi: int, max_tokens: int, ngram: int,
                  temperature: Tensor, noise: Tensor) -> tuple[Tensor, SpeechRuleState]:
    """One speech token per row.

    ``logits`` (B, R) cover ids [offset, offset+R) (a slice of lm_head); ``prefix`` (K,) the forced
    delay prefix; ``history``/``length`` the speech channel so far; ``temperature`` (B,) (<= 0 means
    greedy); ``noise`` (B, R) uniform(0, 1) draws from each row's own generator.
    """
    k = prefix.numel()
    prefix_count = state.prefix_count + 1
    in_prefix = prefix_count <= k
    prefix_tok = prefix[(prefix_count - 1).clamp(max=max(k - 1, 0))] if k else torch.zeros_like(last)
    counting = ~in_prefix & ~state.has_eos
    count = state.count + counting.long()
    force_eos = counting & (count >= max_tokens)
    settled = in_prefix | force_eos
    has_eos = torch.where(settled, state.has_eos, state.has_eos | (last == eos))

    r = logits.shape[-1]
    ids = torch.arange(offset, offset + r, device=logits.device)
    allowed = ((ids >= code_lo) & (ids < code_hi)) | (ids == eos)
    scores = logits.float().masked_fill(~allowed[None], NEG_INF)
    banned, valid = ngram_banned(history, length, ngram)
    if banned.numel():
        col = banned - offset
        col = torch.where(valid & (col >= 0) & (col < r), col, torch.full_like(col, r))
        ext = torch.zeros((scores.shape[0], r + 1), dtype=torch.bool, device=scores.device)
        ext.scatter_(1, col, True)
        scores = scores.masked_fill(ext[:, :r], NEG_INF)
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
    pick = torch.where(greedy[:, None], scores, scores / t + gumbel).argmax(dim=-1) + offset
    out = torch.where(in_prefix, prefix_tok, torch.where(force_eos, torch.full_like(pick, eos), pick))
    return out, SpeechRuleState(prefix_count, count, has_eos)


def control_decision(scores: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    """Greedy choice between two decision tokens, the first one's raw logit scaled by ``factor``.

    ``scores`` (B, 2) = logits of (scaled token, other token), ordered so that on a tie the token
    with the lower id wins, as argmax over the reference's full-vocabulary row does. Returns
    (index 0/1 of the winner, (B, 2) softmax probabilities after scaling, for display).
    """
    s = scores.float().clone()
    if factor > 0:  # the reference skips the scaling for non-positive factors
        s[:, 0] = s[:, 0] * factor
    return s.argmax(dim=-1), torch.softmax(s, dim=-1)
