"""Context slides on the device: a slot's audio features, the re-prefill of the positions a slide
keeps into the slot's staging row, and the switch to it.

Why a re-prefill and not re-rotated keys: the keys and values of every layer above the first carry
what their position attended to, the dropped conversation included, so rotating cached keys to new
positions gives a state that no forward over the kept tokens produces. A re-prefill of exactly the
kept tokens (system prefix, then the recent conversation at its new positions) gives that forward's
state, so the next step's logits are a fresh teacher-forced forward's (``docs/lychee_fd.md``).

Off the window's critical path: each slot has a second cache row (its *staging row*). Some windows
before the slide point, a re-prefill starts there and feeds ``chunk`` positions after each window
step (after the step's results were fetched; on a GPU its kernels queue behind them), catching up
with the live slot, which meanwhile goes on in its own row. At the slide point the staging row
holds the kept context and is copied over the slot's row in place; the host lists, the speech
history of the n-gram rule and the stored features shift by the same amount. Nothing else of the
slot changes, so a response that spans a slide simply goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .audio import FEATURES_PER_WINDOW
from .context import CHUNK, SlidePlan
from .decode import RuleRows
from .model import LycheeFD


class FeatureStore:
    """Each slot's encoder features by window (5 per 400 ms window), kept for its re-prefills.

    Fixed size: ``windows`` rows per slot, enough for a whole slot; a slide shifts them.
    """

    def __init__(self, slots: int, windows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.feats = torch.zeros((slots, windows, FEATURES_PER_WINDOW, hidden), dtype=dtype, device=device)

    def write(self, slots: list[int], windows: list[int], feats: Tensor) -> None:
        """``feats`` (n, 5, H): the features of window ``windows[i]`` of slot ``slots[i]``."""
        device = self.feats.device
        rows, at = torch.tensor(slots, device=device), torch.tensor(windows, device=device)
        self.feats[rows, at] = feats.to(self.feats.dtype)

    def channel(self, slot: int, positions: np.ndarray, pad: Tensor) -> Tensor:
        """The audio channel of post-prefix ``positions``: feature j of window k at 10k+2j, pad elsewhere."""
        device = self.feats.device
        index = torch.from_numpy(positions // CHUNK * FEATURES_PER_WINDOW + positions % CHUNK // 2).to(device)
        even = torch.from_numpy(positions % 2 == 0).to(device)
        picked = self.feats[slot].reshape(-1, self.feats.shape[-1])[index]
        return torch.where(even[:, None], picked, pad.to(picked.dtype))

    def shift(self, slot: int, windows: int, used: int) -> None:
        """Drop the first ``windows`` of the ``used`` windows of ``slot``."""
        keep = used - windows
        if keep > 0:
            self.feats[slot, :keep] = self.feats[slot, windows:used].clone()

    def clear(self, slot: int) -> None:
        self.feats[slot] = 0


@dataclass
class SlideJob:
    """A slide in progress: its plan, the prefix its context starts with, and how far it has got."""

    plan: SlidePlan
    prefix_ids: list[int]
    staged: int = 0  # positions of the new context in the staging row (prefix included)

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    def target(self, decided: int, fed: int) -> int:
        """Positions of the new context whose inputs are known: the prefix (its last position needs
        the first kept text token as the merge's "next text"), then every kept position fed live."""
        shift = self.plan.shift
        if decided <= shift:
            return self.prefix_len - 1
        return self.prefix_len + fed - shift

    def rewind(self, position: int) -> None:
        """Conversation position ``position`` was rewritten before it was fed (a response stopped at
        a window boundary): the staged position before it saw the old token as its merge's "next
        text" and is fed again."""
        before = self.prefix_len + position - 1 - self.plan.shift
        if position >= self.plan.shift:
            self.staged = min(self.staged, before)

    def ready(self, decided: int, fed: int) -> bool:
        return decided >= self.plan.swap_at and self.staged == self.target(decided, fed)


class Slider:
    """Runs slide jobs for the slots of a runner: staging rows, re-prefill chunks, the switch."""

    def __init__(self, model: LycheeFD, store: FeatureStore, audio_pad: int):
        self.model = model
        self.store = store
        self.audio_pad = audio_pad

    @torch.no_grad()
    def advance(self, job: SlideJob, slot: int, staging_row: int, text: list[int], stoken: list[int],
                control: list[int], fed: int, budget: int) -> int:
        """Feed up to ``budget`` more positions of the new context into ``staging_row``; returns how many.

        Positions ``i < P`` of the new context are the prefix (text embedding only, as at open);
        position ``P + j`` is conversation position ``shift + j`` with all four channels. Merge sees
        the next position's text, as in a teacher-forced forward.
        """
        lo = job.staged
        hi = min(job.target(len(text), fed), lo + budget)
        if hi <= lo:
            return 0
        model, p_len, shift = self.model, job.prefix_len, job.plan.shift
        device = model.lm_head.weight.device
        e = model.embed_tokens
        parts: list[Tensor] = []
        nxt: list[int] = []
        if lo < p_len:
            ids = job.prefix_ids[lo:min(hi, p_len)]
            parts.append(e(torch.tensor(ids, device=device)))
            nxt += [job.prefix_ids[i + 1] if i + 1 < p_len else text[shift] for i in range(lo, lo + len(ids))]
        if hi > p_len:
            a, b = shift + max(lo, p_len) - p_len, shift + hi - p_len
            channels = torch.tensor([text[a:b], stoken[a:b], control[a:b]], device=device)
            audio = self.store.channel(slot, np.arange(a, b), e.weight[self.audio_pad])
            parts.append(model.embed_channels(channels[0][None], channels[1][None], channels[2][None],
                                              audio[None])[0])
            nxt += text[a + 1:b + 1]
        x = torch.cat(parts)[None]
        pos = torch.arange(lo, hi, device=device)[None]
        rows = torch.tensor([staging_row], device=device)
        # Keys only up to the chunk's end: the masked rest of the row is never read.
        model.forward_positions(x, e(torch.tensor([nxt], device=device)), model.context(pos, rows, key_len=hi))
        job.staged = hi
        return hi - lo

    def switch(self, job: SlideJob, slot: int, staging_row: int, rule_rows: RuleRows, decided: int, window: int,
               stoken_pad: int) -> None:
        """The slide takes effect: the staging row's context over the slot's row, and the per-row
        device state shifted by the positions dropped. The host lists are the runner's to shift."""
        shift = job.plan.shift
        self.model.copy_positions(staging_row, slot, job.staged)
        history = rule_rows.history
        keep = decided - shift
        history[slot, :keep] = history[slot, shift:decided].clone()
        history[slot, keep:] = stoken_pad
        self.store.shift(slot, shift // CHUNK, window)
