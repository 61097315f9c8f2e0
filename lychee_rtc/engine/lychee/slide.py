"""Context slides on the device: a slot's audio features, the re-prefill of the positions a slide
keeps into the slot's staging row, and the switch to it.

Why a re-prefill and not re-rotated keys: the keys and values of every layer above the first carry
what their position attended to, the dropped conversation included, so rotating cached keys to new
positions gives a state that no forward over the kept tokens produces. A re-prefill of exactly the
kept tokens (system prefix, then the recent conversation at its new positions) gives that forward's
state, so the next step's logits are a fresh teacher-forced forward's (``docs/lychee_fd.md``).

Off the window's critical path: each slot has a second cache row (its *staging row*). From one
slide to the next, a re-prefill fills it after each window step (after the step's results were
fetched; on a GPU its kernels queue behind them), a few positions at a time as the engine-wide
budget allows (``slide_budget.py``), catching up with the live slot, which meanwhile goes on in its
own row. The pieces of all slots in a step run as one batched forward where their shapes allow.
At the slide point the staging row holds the kept context and is copied over the slot's row in
place; the host lists, the speech history of the n-gram rule and the stored features shift by the
same amount. Nothing else of the slot changes, so a response that spans a slide simply goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .audio import FEATURES_PER_WINDOW
from .context import CHUNK, SlidePlan
from .decode import RuleRows
from .model import LycheeFD
from .slide_budget import batches, padded


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

    def index(self, slot: int, positions: np.ndarray) -> np.ndarray:
        """Flat feature index of post-prefix ``positions`` of ``slot``: feature j of window k at
        10k+2j, -1 (the audio pad) at odd positions."""
        per_slot = self.feats.shape[1] * FEATURES_PER_WINDOW
        at = slot * per_slot + positions // CHUNK * FEATURES_PER_WINDOW + positions % CHUNK // 2
        return np.where(positions % 2 == 0, at, -1)

    def gather(self, index: Tensor, pad: Tensor) -> Tensor:
        """The audio channel for a flat ``index`` of any shape (-1: ``pad``), shape ``index.shape + (H,)``."""
        flat = self.feats.reshape(-1, self.feats.shape[-1])
        picked = flat[index.clamp(min=0)]
        return torch.where((index >= 0)[..., None], picked, pad.to(picked.dtype))

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

    def steps_left(self, decided: int) -> int:
        """Window steps until the slide point, this one included (<= 0: past it, late)."""
        return (self.plan.swap_at - decided) // CHUNK + 1

    def rewind(self, position: int) -> None:
        """Conversation position ``position`` was rewritten before it was fed (a response stopped at
        a window boundary): the staged position before it saw the old token as its merge's "next
        text" and is fed again."""
        before = self.prefix_len + position - 1 - self.plan.shift
        if position >= self.plan.shift:
            self.staged = min(self.staged, before)

    def ready(self, decided: int, fed: int) -> bool:
        return decided >= self.plan.swap_at and self.staged == self.target(decided, fed)


@dataclass
class Piece:
    """What one slot stages in a step: positions ``job.staged .. hi - 1`` of its new context."""

    job: SlideJob
    slot: int
    row: int  # its staging row
    hi: int
    text: list[int]
    stoken: list[int]
    control: list[int]

    @property
    def lo(self) -> int:
        return self.job.staged


@dataclass
class SlideStats:
    """What the slides of a runner cost and how they went: the last step's share, running totals."""

    budget: int = 0  # positions per window step, every slot together (the policy's; in cost: budget_cost)
    positions: int = 0  # re-prefilled in the last step, every slot (padding not counted)
    computed: int = 0  # the same with the padding of batched forwards
    pieces: int = 0  # slots that re-prefilled in the last step
    forwards: int = 0  # forwards they took (fewer than pieces: batched)
    switches: int = 0  # slides that took effect at the end of the last step
    slides: int = 0  # since the runner started: slides that took effect
    late: int = 0  # ... of them after their slide point (the budget went to nearer ones first)
    fallbacks: int = 0  # slots that reached their end before their staging row was ready (reset)
    most_computed: int = 0  # the largest ``computed`` of any step
    budget_cost: float = 0.0  # the budget in cost (``SlidePolicy.budget_cost``; 0: counted in positions)
    cost: int = 0  # the last step's cost (``slide_budget.cost``, padding not counted): within budget_cost
    most_cost: int = 0  # the largest ``cost`` of any step

    def new_step(self) -> None:
        self.positions = self.computed = self.pieces = self.forwards = self.switches = self.cost = 0


class Slider:
    """The device side of the slides of a runner: staging forwards and the switch."""

    def __init__(self, model: LycheeFD, store: FeatureStore, audio_pad: int, pad_ratio: float):
        self.model = model
        self.store = store
        self.audio_pad = audio_pad
        self.pad_ratio = pad_ratio  # batches(): how much padded attention a batched forward may do

    def stage(self, pieces: Sequence[Piece], spare: int) -> tuple[int, int]:
        """Stage every piece, batched into as few forwards as ``batches`` allows with ``spare``
        positions of padding; returns (positions computed, padding included; forwards)."""
        groups = batches([(p.lo, p.hi) for p in pieces], spare, self.pad_ratio)
        computed = 0
        for group in groups:
            chosen = [pieces[i] for i in group]
            computed += padded([(p.lo, p.hi) for p in chosen])
            self._forward(chosen)
        return computed, len(groups)

    @torch.no_grad()
    def _forward(self, pieces: Sequence[Piece]) -> None:
        """One forward over the pieces of several slots, one row each, into their staging rows.

        Positions ``i < P`` of a new context are the prefix (text embedding only, as at open);
        position ``P + j`` is conversation position ``shift + j`` with all four channels. Merge sees
        the next position's text, as in a teacher-forced forward. A row shorter than the longest is
        padded at positions past its own end (garbage there is overwritten when those positions
        are staged, and the switch copies only what is staged).
        """
        model = self.model
        pieces = sorted(pieces, key=lambda p: p.row)
        n = max(p.hi - p.lo for p in pieces)
        far = max(p.hi for p in pieces)
        # channels: text, stoken, control, next text, conversation (0/1), feature index, position, cache row
        host = np.zeros((8, len(pieces), n), dtype=np.int64)
        host[5] = -1
        for r, p in enumerate(pieces):
            job, lo, hi = p.job, p.lo, p.hi
            p_len, shift = job.prefix_len, job.plan.shift
            new = np.arange(lo, hi)
            pre = new[new < p_len]
            if pre.size:
                ids = job.prefix_ids + p.text[shift:shift + 1]  # the prefix's last "next text": the first kept token
                k = pre.size
                host[0, r, :k] = ids[lo:lo + k]
                host[3, r, :k] = ids[lo + 1:lo + 1 + k]
            conv = new[new >= p_len] - p_len + shift  # conversation positions
            if conv.size:
                k0, a, b = pre.size, int(conv[0]), int(conv[-1]) + 1
                host[0, r, k0:k0 + conv.size] = p.text[a:b]
                host[1, r, k0:k0 + conv.size] = p.stoken[a:b]
                host[2, r, k0:k0 + conv.size] = p.control[a:b]
                host[3, r, k0:k0 + conv.size] = p.text[a + 1:b + 1]
                host[4, r, k0:k0 + conv.size] = 1
                host[5, r, k0:k0 + conv.size] = self.store.index(p.slot, conv)
            host[6, r, :hi - lo] = new
            # Padding past the row's end, never beyond the furthest end of the batch (or the row).
            host[6, r, hi - lo:] = np.minimum(hi + np.arange(n - (hi - lo)), max(hi, far - 1))
            host[7, r] = p.row
        host[6] = np.minimum(host[6], model.max_seq - 1)
        device = model.lm_head.weight.device
        # One upload; from pageable memory it is staged at once and never waits for the device.
        dev = torch.from_numpy(host).to(device, non_blocking=True)
        text, stoken, control, nxt, conv_mask, feat, pos, rows = dev
        e = model.embed_tokens
        audio = self.store.gather(feat, e.weight[self.audio_pad])
        both = model.embed_channels(text, stoken, control, audio)
        x = torch.where(conv_mask.bool()[..., None], both, e(text))
        key_len = int(host[6].max()) + 1  # keys up to the furthest position: the rest of the row is never read
        first = pieces[0].row
        # Consecutive staging rows (slots side by side, or one slot) are read as a view, not gathered.
        consecutive = [p.row for p in pieces] == list(range(first, first + len(pieces)))
        where = slice(first, first + len(pieces)) if consecutive else rows[:, 0]
        # Every query's position is at least the smallest: the keys before it are seen by all, and
        # attention skips their mask (``OpenPrefixMask``; only the pieces' own positions need it).
        open_keys = int(host[6].min())
        model.forward_positions(x, e(nxt), model.context(pos, where, key_len=key_len, open_keys=open_keys))
        for p in pieces:
            p.job.staged = p.hi

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
