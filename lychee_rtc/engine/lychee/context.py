"""The rolling-context policy of a slot: its geometry, where each slide takes effect, what it keeps,
and the engine-wide re-prefill budget per window step.

All counts are post-prefix positions (40 ms each) unless they say otherwise. A slot's context is
``system prefix (the sink) + conversation``; the conversation grows by one window (10 positions)
per step. With sliding on, when the conversation reaches ``kept + step`` decided positions, the
oldest ``step`` are dropped and the slot goes on from ``kept`` positions at new (smaller) RoPE
positions. The caches of the kept positions are rebuilt by a re-prefill into the slot's staging
row that runs from one slide to the next (``slide.py``), paced and budgeted by
``slide_budget.py``, so the switch itself is a copy.

Both the drop and the windows stay multiples of 10 positions: every kept position keeps its slot
in the 400 ms grid (Sleep x8, Detect, decision; audio feature at even positions).

Sizes that are not set follow ``max_seq`` (the documented rule, ``docs/lychee_fd.md``): the slide
step is a fifth of the slot, the window the rest less the sink and the end margin, and the budget
the rate at which every session can re-prefill its kept context within one slide step, with a
margin. Only explicit values that cannot work are refused, each error naming its key.

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
# A re-prefill aims to have caught up with its live slot this many window steps before the slide
# point (a cancel that rewrites a staged position, or a step in which the budget went to a more
# urgent slide, is absorbed there).
RESERVE_STEPS = 2
# The derived budget is this much more than every session re-prefilling at its steady rate at once.
BUDGET_MARGIN = 1.25


class ContextSettingsError(ValueError):
    """A context setting cannot work with the slot's size; the message names the setting."""


@dataclass(frozen=True)
class SlidePlan:
    """One slide of one slot, fixed when its re-prefill starts."""

    kept: int  # conversation positions the slot holds right after the slide
    shift: int  # positions dropped (the oldest), a multiple of 10
    swap_at: int  # decided positions at which the slide takes effect (kept + shift)


@dataclass(frozen=True)
class SlidePolicy:
    """``window``: conversation positions kept; ``step``: positions dropped per slide; ``budget``:
    positions re-prefilled per window step by all slots together. ``window == 0``: sliding off."""

    max_seq: int
    window: int
    step: int
    budget: int = 0
    rate: int = 0  # the steady re-prefill rate one slot needs (positions per window step)
    context: int = 0  # the largest new context a slide re-prefills (sink + kept)
    # A position's fixed cost in attended keys (``slide_budget.cost``); None: budget and pace count
    # positions only. Set from the model's sizes by the runner.
    fixed: int | None = None

    @property
    def budget_cost(self) -> float:
        """The budget in cost: ``budget`` positions each attending to the largest context, so that
        a step never costs more than the position budget could at its dearest."""
        return self.budget * ((self.fixed or 0) + self.context)

    @property
    def enabled(self) -> bool:
        return self.window > 0

    @classmethod
    def build(cls, max_seq: int, window: int | None, step: int | None, budget: int | None, prefix_len: int,
              max_prefix: int, sessions: int = 1) -> "SlidePolicy":
        """Settings -> policy: what is not set follows ``max_seq``; every check names its key.

        Rule: ``step = max_seq / 5``; ``window = max_seq - step - sink - 20`` (both down to a
        multiple of 10). An explicit window with the step unset takes what is left after it, up to
        a fifth; an explicit step with the window unset leaves the rest to the window.
        """
        if window == 0:
            return cls(max_seq, 0, step or 0)
        room = max_seq - prefix_len - END_MARGIN  # conversation positions a slot holds at most
        if step is None:
            step = max_seq // 5 // CHUNK * CHUNK
            if window is not None:
                step = min(step, (room - window) // CHUNK * CHUNK)
                if step < CHUNK:
                    raise ContextSettingsError(
                        f"context_window: {window} + the system prefix ({prefix_len}) + {END_MARGIN} leaves no "
                        f"slide step in max_seq {max_seq} (at most {(room - CHUNK) // CHUNK * CHUNK}, or null to "
                        "derive it)")
        explicit_window = window is not None
        if window is None:
            window = (room - step) // CHUNK * CHUNK
            if window < CHUNK:
                raise ContextSettingsError(
                    f"context_slide_step: {step} leaves no window after the system prefix ({prefix_len}) in "
                    f"max_seq {max_seq} (at most {(room - CHUNK) // CHUNK * CHUNK}, or null to derive it)")
        for key, value in (("context_window", window), ("context_slide_step", step)):
            if value < CHUNK or value % CHUNK:
                raise ContextSettingsError(f"{key}: must be a positive multiple of {CHUNK} positions (400 ms), "
                                           f"got {value}")
        if window + step > room:
            first, other = ("context_window", "context_slide_step") if explicit_window else \
                ("context_slide_step", "context_window")
            values = {"context_window": window, "context_slide_step": step}
            raise ContextSettingsError(
                f"{first}: {values[first]} + {other} {values[other]} + the system prefix ({prefix_len}) + "
                f"{END_MARGIN} must fit max_seq {max_seq} (set them for this max_seq, or null to derive them "
                "from it)")
        policy = cls(max_seq, window, step)
        if policy.kept(max_prefix, max_prefix) < CHUNK:
            raise ContextSettingsError(
                f"context_slide_step: {step} leaves no window after the longest system prefix ({max_prefix}) "
                f"in max_seq {max_seq}")
        rate = policy.slot_rate(max_prefix)
        need = sessions * rate
        derived = math.ceil(BUDGET_MARGIN * need)
        if budget is None:
            budget = derived
        elif budget < need:
            raise ContextSettingsError(
                f"context_prefill_budget: {budget} positions per window step cannot re-prefill the kept context "
                f"of {sessions} session(s) sliding in the same steps within one slide step ({step // CHUNK} "
                f"windows): at least {need} (null derives {derived})")
        return cls(max_seq, window, step, budget, rate, min(max_prefix + window, max_seq - step - END_MARGIN))

    def kept(self, live_prefix: int, new_prefix: int) -> int:
        """Conversation positions a slide keeps: the window, less what a long prefix takes."""
        room = self.max_seq - max(live_prefix, new_prefix) - self.step - END_MARGIN
        return min(self.window, room // CHUNK * CHUNK)

    def last_switch(self, live_prefix: int) -> int:
        """The most decided positions at which a slide can still take effect before the slot's end
        (the window after it would meet the last resort, ``slot.py``)."""
        return (self.max_seq - live_prefix - CHUNK) // CHUNK * CHUNK - CHUNK

    def slot_rate(self, max_prefix: int) -> int:
        """Positions per window step that one slot's re-prefill needs at most: its largest context
        (sink + kept) within the window steps from one slide to the next, less the reserve."""
        positions = min(max_prefix + self.window, self.max_seq - self.step - END_MARGIN)  # >= sink + kept
        steps = self.step // CHUNK
        return max(CHUNK, math.ceil(positions / max(1, steps - min(RESERVE_STEPS, steps - 1))))

    def plan(self, live_prefix: int, new_prefix: int, decided: int) -> SlidePlan | None:
        """The next slide of a slot whose live prefix is ``live_prefix`` and whose context after
        the slide starts with ``new_prefix`` positions, its re-prefill starting now, ``decided``
        positions into the conversation; None: no room to slide (the last resort).

        The slide point is ``kept + step``. Only a new prefix longer than the old by more than a
        slide step can leave the slot past it already; the slide then takes the time the slot has
        left (dropping more, so that it still keeps ``kept``).
        """
        if not self.enabled:
            return None
        kept = self.kept(live_prefix, new_prefix)
        if kept < CHUNK:
            return None
        last = self.last_switch(live_prefix)
        swap_at = kept + self.step
        if swap_at <= decided:
            swap_at = min(last, decided + self.step)
        if swap_at <= decided or swap_at > last:
            return None
        return SlidePlan(kept=kept, shift=swap_at - kept, swap_at=swap_at)
