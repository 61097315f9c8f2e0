"""How one window step's re-prefill budget is shared by the slides in progress, and how their
pieces are batched into forwards.

Pure functions of small integers (positions, window steps), so that what the runner does in a
step can be checked exhaustively in tests.

* **Pace.** A slide's re-prefill can stage only positions whose inputs are known: the new prefix,
  then every kept position the live slot has already fed; ten more become known per window step.
  It aims to have caught up with its live slot ``RESERVE_STEPS`` window steps before the slide
  point, spreading the backlog and the growth until then evenly over the steps left, so a slide
  costs about the same small share of every step from one slide to the next instead of a burst.
  A piece is never smaller than ``least`` positions (the slide's steady rate) before that point: a
  slide that only keeps up with its slot (ten positions a step) waits until it has that many, so
  a forward's fixed cost (weights read, kernels launched) is paid once per ``least`` positions.
* **Share.** The slides take their pace in order of their slide points, earliest first (earliest
  deadline first); the budget caps the step's sum whatever the number of slides in progress. A
  slide that fell behind (the budget went to a nearer one) has a larger pace in the next step.
* **Batch.** The pieces of a step go into as few forwards as possible: a forward over several
  pieces has one row per piece, each as long as the longest (the shorter padded at positions past
  their own end, where nothing staged lives yet), its attention reading keys up to the furthest
  end. A piece joins a forward only when the padding it adds fits in what the step did not grant
  (so what a step computes, padding included, stays within the budget) and, on a CPU, when the
  forward's attention area stays within ``pad_ratio`` times the pieces' own.
* **Cost.** A position costs a fixed amount (projections and MLP, ``fixed``, counted in attended
  keys) plus one unit per key it attends to, so a piece late in a slide (thousands of keys) costs
  several times one of the same length early in it. Given ``fixed``, the pace levels a slide's
  *cost* over its steps instead of its positions (early pieces longer, late ones shorter: much of
  the backlog is known when a slide starts) and the budget caps the step's summed cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .context import CHUNK, RESERVE_STEPS


@dataclass(frozen=True)
class Claim:
    """A slide in progress, as the step's share sees it."""

    slot: int
    steps_left: int  # window steps until its slide point, this one included (<= 0: late)
    known: int  # positions whose inputs are known and are not staged yet
    staged: int = 0  # positions of the new context already staged (where the next piece starts)
    total: int = 0  # positions of the whole new context (sink + kept)


def fixed_cost(hidden: int, kv_dim: int, intermediate: int) -> int:
    """A position's fixed cost in attended keys, from a decoder layer's multiply-adds: projections
    ``hidden * (2 * hidden + 2 * kv_dim)`` and a gated MLP ``3 * hidden * intermediate``, against
    ``2 * hidden`` per attended key (scores and weighted values over every query head)."""
    return hidden + kv_dim + (3 * intermediate + 1) // 2


def cost(lo: int, hi: int, fixed: int) -> int:
    """Cost of re-prefilling positions ``lo .. hi - 1``: each pays ``fixed`` plus one per key it
    attends to (position p attends to p + 1)."""
    n = hi - lo
    return n * fixed + n * (lo + hi + 1) // 2 if n > 0 else 0


def fits(lo: int, spend: float, fixed: int) -> int:
    """The most positions from ``lo`` whose cost is at most ``spend``."""
    if spend <= 0:
        return 0
    b = fixed + lo + 0.5
    n = max(0, int(math.sqrt(b * b + 2 * spend) - b))
    while cost(lo, lo + n + 1, fixed) <= spend:
        n += 1
    while n and cost(lo, lo + n, fixed) > spend:
        n -= 1
    return n


def levelled(claim: Claim, fixed: int, reserve: int = RESERVE_STEPS, least: int = 0) -> int:
    """Positions to stage in this step, by cost. The cost of what is left of the slide is spread
    evenly over the steps until ``reserve`` steps before its slide point (all known once there, or
    late): early pieces are longer than late ones. A piece is at least ``least`` positions (a
    forward's fixed cost paid once per that many) unless those cost more than ``least`` positions
    at the slide's mean key count (the steady level): late in a slide it is what that level buys.
    While fewer positions are known than the piece wants it waits, unless waiting one more step
    would make it dearer than the level."""
    known, lo = max(0, claim.known), claim.staged
    k = max(1, claim.steps_left - reserve)
    if k == 1:
        return known
    level = cost(lo, max(claim.total, lo + known), fixed) / k
    steady = least * (fixed + claim.total / 2)
    floor = min(least, fits(lo, steady, fixed))
    want = max(fits(lo, level, fixed), floor)
    if known >= want:
        return want
    if known >= floor:
        return known
    return known if cost(lo, lo + known + CHUNK, fixed) > max(level, steady) else 0


def pace(known: int, steps_left: int, reserve: int = RESERVE_STEPS, least: int = 0) -> int:
    """Positions to stage in this step: the backlog ``known`` plus the ten positions each later
    step brings, spread over the steps until ``reserve`` steps before the slide point (all of the
    backlog once there, or late); before that, ``least`` at least, or nothing while fewer are known."""
    k = max(1, steps_left - reserve)
    if k == 1:
        return max(0, known)
    g = known if known <= CHUNK else min(known, -(-(known + CHUNK * (k - 1)) // k))
    if g < least:
        return least if known >= least else 0
    return g


def share(claims: Sequence[Claim], budget: float, least: int = 0, fixed: int | None = None) -> list[int]:
    """Each claim's grant for this step, in the claims' order: paces (pieces of ``least`` at
    least) taken earliest slide point first (then by slot, for determinism), their sum capped at
    ``budget``. With ``fixed``: levelled paces, and ``budget`` caps their summed ``cost``."""
    grants = [0] * len(claims)
    left = budget
    for i in sorted(range(len(claims)), key=lambda i: (claims[i].steps_left, claims[i].slot)):
        c = claims[i]
        if fixed is None:
            grants[i] = min(pace(c.known, c.steps_left, least=least), int(left))
            left -= grants[i]
        else:
            grants[i] = min(levelled(c, fixed, least=least), fits(c.staged, left, fixed))
            left -= cost(c.staged, c.staged + grants[i], fixed)
    return grants


def batches(pieces: Sequence[tuple[int, int]], spare: int, pad_ratio: float) -> list[list[int]]:
    """Indices of ``pieces`` (``(lo, hi)`` positions of each slot's new context) grouped into
    forwards. ``spare``: positions of the budget left ungranted, what padding may use;
    ``pad_ratio``: the most a forward's attention area (rows x length x keys) may exceed its
    pieces' own (``inf``: no limit, for a device on which a forward's fixed cost dominates)."""
    order = sorted(range(len(pieces)), key=lambda i: (pieces[i][1], pieces[i][1] - pieces[i][0]))
    groups: list[list[int]] = []
    for i in order:
        lo, hi = pieces[i]
        if groups:
            group = groups[-1]
            sizes = [pieces[j][1] - pieces[j][0] for j in group]
            longest = max(max(sizes), hi - lo)
            useful = sum(sizes) + hi - lo
            added = (len(group) + 1) * longest - useful - (len(group) * max(sizes) - sum(sizes))
            own = sum(n * pieces[j][1] for n, j in zip(sizes, group)) + (hi - lo) * hi
            if added <= spare and (len(group) + 1) * longest * hi <= pad_ratio * own:
                group.append(i)
                spare -= added
                continue
        groups.append([i])
    return groups


def padded(group: Sequence[tuple[int, int]]) -> int:
    """Positions a forward over these pieces computes, padding included."""
    return len(group) * max(hi - lo for lo, hi in group)
