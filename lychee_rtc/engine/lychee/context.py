"""The rolling-context policy of a slot: when a slide starts, where it takes effect, what it keeps.

All counts are post-prefix positions (40 ms each) unless they say otherwise. A slot's context is
``system prefix (the sink) + conversation``; the conversation grows by one window (10 positions)
per step. With sliding on, when the conversation reaches ``kept + step`` decided positions, the
oldest ``step`` are dropped and the slot goes on from ``kept`` positions at new (smaller) RoPE
positions. The caches of the kept positions are rebuilt by a re-prefill that runs a chunk per
window step some windows before the slide (``slide.py``), so the switch itself is a copy.

Both the drop and the windows stay multiples of 10 positions: every kept position keeps its slot
in the 400 ms grid (Sleep x8, Detect, decision; audio feature at even positions).

Pure arithmetic, no tensors: the numbers here are what ``docs/lychee_fd.md`` states and what the
engine reports in its capabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHUNK = 10  # positions per 400 ms window
# Positions left free at the end of a slot when slides are on time: the window step that ends
# at the slide point must never find itself within two windows of the end (the last resort's
# threshold for a speaking slot).
END_MARGIN = 2 * CHUNK
POSITIONS_PER_SECOND = 25.0


class ContextSettingsError(ValueError):
    """A context setting cannot work with the slot's size; the message names the setting."""


@dataclass(frozen=True)
class SlidePlan:
    """One slide of one slot, fixed when its re-prefill starts."""

    kept: int  # conversation positions the slot holds right after the slide
    shift: int  # positions dropped (the oldest), a multiple of 10
    start_at: int  # decided positions at which the re-prefill starts
    swap_at: int  # decided positions at which the slide takes effect (kept + shift)


@dataclass(frozen=True)
class SlidePolicy:
    """``window``: conversation positions kept; ``step``: positions dropped per slide;
    ``chunk``: positions re-prefilled per window step. ``window == 0``: sliding off (reset)."""

    max_seq: int
    window: int
    step: int
    chunk: int

    @property
    def enabled(self) -> bool:
        return self.window > 0

    @classmethod
    def build(cls, max_seq: int, window: int | None, step: int | None, chunk: int, prefix_len: int,
              max_prefix: int) -> "SlidePolicy":
        """Settings -> policy, with defaults from the slot size and every check naming its key.

        Defaults: a slide drops a fifth of the slot; the window is the rest, less the default
        system prefix and the end margin.
        """
        if step is None:
            step = max(CHUNK, max_seq // 5 // CHUNK * CHUNK)
        if window is None:
            window = (max_seq - step - prefix_len - END_MARGIN) // CHUNK * CHUNK
        policy = cls(max_seq, window, step, chunk)
        if window == 0:
            return policy
        for key, value in (("context_window", window), ("context_slide_step", step)):
            if value < CHUNK or value % CHUNK:
                raise ContextSettingsError(f"{key}: must be a positive multiple of {CHUNK} positions (400 ms), "
                                           f"got {value}")
        if chunk <= CHUNK:
            raise ContextSettingsError(f"context_prefill_chunk: must be more than {CHUNK} positions (a window), "
                                       f"got {chunk}")
        if prefix_len + window + step + END_MARGIN > max_seq:
            raise ContextSettingsError(
                f"context_window: {window} + context_slide_step {step} + the system prefix ({prefix_len}) "
                f"+ {END_MARGIN} must fit max_seq {max_seq} (set both for this max_seq, or null to derive them "
                "from it)")
        if policy.kept(max_prefix, max_prefix) < CHUNK:
            raise ContextSettingsError(
                f"context_slide_step: {step} leaves no window after the longest system prefix ({max_prefix}) "
                f"in max_seq {max_seq}")
        plan = policy.plan(prefix_len, prefix_len)
        assert plan is not None
        if plan.swap_at - plan.start_at >= step:
            raise ContextSettingsError(
                f"context_prefill_chunk: {chunk} positions per window cannot re-prefill {prefix_len + window} "
                f"positions within one slide step ({step // CHUNK} windows)")
        return policy

    def kept(self, live_prefix: int, new_prefix: int) -> int:
        """Conversation positions a slide keeps: the window, less what a long prefix takes."""
        room = self.max_seq - max(live_prefix, new_prefix) - self.step - END_MARGIN
        return min(self.window, room // CHUNK * CHUNK)

    def plan(self, live_prefix: int, new_prefix: int, decided: int | None = None) -> SlidePlan | None:
        """The next slide of a slot whose live prefix is ``live_prefix`` and whose context after
        the slide starts with ``new_prefix`` positions; None: no room to slide (the last resort).

        The re-prefill needs ``ceil((new_prefix + kept) / chunk)`` window steps, plus one for the
        positions fed meanwhile; it starts that many windows before the slide point. Given
        ``decided`` (a re-prefill starting now, later than planned), the slide point moves so that
        it still keeps ``kept`` positions.
        """
        if not self.enabled:
            return None
        kept = self.kept(live_prefix, new_prefix)
        if kept < CHUNK:
            return None
        lead = math.ceil((new_prefix + kept) / self.chunk) + 1
        swap_at = kept + self.step
        start_at = max(CHUNK, swap_at - CHUNK * (lead - 1))
        if decided is not None and decided > start_at:
            swap_at += -(-(decided - start_at) // CHUNK) * CHUNK
            start_at = decided
        return SlidePlan(kept=kept, shift=swap_at - kept, start_at=start_at, swap_at=swap_at)
