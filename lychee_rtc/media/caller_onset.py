"""Where a caller who talked over the echo began, from what the processing stage noted of the frames it
handed on before double talk was confirmed (``media/audio_processing.py``, ``_from_onset``).

Double talk is confirmed frames after the caller began, while AEC3 was still taking them down; at
confirmation the engine is handed the line as it was from where they began. Three witnesses, best first:
the linear echo estimate's evidence of the caller (``media/echo_estimate.py``: its residual over what it
expects of the echo alone, or, before it is trusted, the line over the echo's ceiling); the same residual
at a lower bar, where the estimate was trusted once but its evidence did not hold (a caller near the echo's
level while the estimate is young); and AEC3's output rising over the least it let through. Where the young
estimate's residual over a run at full voice confirmed them, where the line rose before what that test
looked at (``rising_into``).

Pure functions over lists, oldest frame first; each returns the index of the first frame the caller is in,
or the list's length where the last frame does not show them.
"""

from __future__ import annotations

from dataclasses import dataclass

# The linear estimate's evidence: a leading frame 20 dB under the loudest of the run is not the caller (a
# caller's first syllable is seldom that far under their voice; what the filter leaves of an echo's tail
# it cannot reach can stand over the little it expects where the agent pauses).
ONSET_UNDER_PEAK = 0.01
# Beyond doubt: a caller's quiet first syllable shows up to 60 ms before their strong run; a longer run of
# evidence before it begins with the room's tail where the agent's voice dropped, under the line: the caller
# began where it was quietest (the tail fades, the caller rises).
ONSET_QUIET_FRAMES = 6
# A caller rising under the echo stands a few dB over what the estimate expects before its evidence: up to
# this many frames before it, each ``ONSET_OVER_EXPECTED`` over and quieter than the next (and as many before
# the young estimate's run, where the line rose: ``rising_into``).
ONSET_LEAD_FRAMES = 3
# The estimate's residual this far over what it expects of the echo alone, once it was trusted: a caller near
# the echo's level stands only 3-7 dB over it in their first frames while the estimate is young (under the
# 9 dB of its evidence), and AEC3's output rises 40-100 ms later.
ONSET_OVER_EXPECTED = 10 ** (3 / 10)
# A voice beginning: its first frames each this far over the frame before them (where a caller begins over
# an echo already at full voice, the echo's line before them stays level).
ONSET_RISE = 10 ** (3 / 10)
# AEC3's output this far over the least it let through in the look-back (its echo alone, the line's noise).
ONSET_OVER_FLOOR = 10 ** (3 / 10)
SILENT = 1e-9  # an output level under this (-90 dBFS) is no one


def caller_onset_in_evidence(evidence: list[bool], residual: list[float]) -> int:
    """Given per frame whether the linear estimate showed the caller and its residual's level (mean
    square): the first of the frames running up to the last that did, less leading ones
    ``ONSET_UNDER_PEAK`` under the loudest of the run."""
    first = len(evidence)
    while first > 0 and evidence[first - 1]:
        first -= 1
    if first < len(evidence):
        floor = ONSET_UNDER_PEAK * max(residual[first:])
        while residual[first] < floor:
            first += 1
    return first


def residual_onset(over_expected: list[float | None]) -> int:
    """Given the linear estimate's residual over what it expects of the echo alone (None: not trusted once
    since it was placed): the first of the frames running up to the last in which it stood
    ``ONSET_OVER_EXPECTED`` over it."""
    first = len(over_expected)
    while first > 0 and (over := over_expected[first - 1]) is not None and over > ONSET_OVER_EXPECTED:
        first -= 1
    return first


def caller_onset(levels: list[float]) -> int:
    """Given AEC3's output level (mean square): the first of the frames running up to the last in which
    the output stood ``ONSET_OVER_FLOOR`` over the least of them (the echo alone and the noise, as AEC3
    leaves them)."""
    if not levels:
        return 0
    above = min(levels) * ONSET_OVER_FLOOR
    first = len(levels)
    while first > 0 and levels[first - 1] > max(above, SILENT):
        first -= 1
    return first


def quietest_between(residual: list[float], strong: int) -> int:
    """A long run of evidence (residual levels, mean square) whose frames from ``strong`` on show the caller
    beyond doubt: the room's tail, then the caller. The last of its quietest frames before ``strong``, less
    frames from there ``ONSET_UNDER_PEAK`` under the loudest after them (the tail's last)."""
    before = residual[:strong]
    first = max(i for i, level in enumerate(before) if level == min(before))
    floor = ONSET_UNDER_PEAK * max(residual[first:])
    while residual[first] < floor:
        first += 1
    return first


def rising_lead(residual: list[float], over_expected: list[float | None], first: int) -> int:
    """Given per frame the estimate's residual level (mean square; 0 where it cannot say) and its residual over
    what it expects of the echo alone, and ``first``, the first frame of its evidence of the caller: the
    caller's first frames before it, up to ``ONSET_LEAD_FRAMES``, each ``ONSET_OVER_EXPECTED`` over what the
    echo leaves and quieter than the next (a voice rising; the echo's leftovers do not), and not
    ``ONSET_UNDER_PEAK`` under the loudest from ``first`` on."""
    floor = ONSET_UNDER_PEAK * max(residual[first:], default=0.0)
    lead = first
    while lead > 0 and first - lead < ONSET_LEAD_FRAMES:
        over = over_expected[lead - 1]
        if over is None or over <= ONSET_OVER_EXPECTED or not floor <= residual[lead - 1] < residual[lead]:
            break
        lead -= 1
    return lead


def rising_into(levels: list[float], first: int, earliest: int) -> int:
    """Given per frame the line's level (mean square), ``first``, the first frame of a run a test found the
    caller in, and ``earliest``, the first frame it may reach back to: the caller's frames before ``first``,
    up to ``ONSET_LEAD_FRAMES`` and not before ``earliest``, each ``ONSET_RISE`` over the frame before it
    (where the line rose as they began; the echo's line before them does not rise so, frame after frame,
    into them)."""
    lead = first
    while lead > max(earliest, 1) and first - lead < ONSET_LEAD_FRAMES and \
            levels[lead - 2] * ONSET_RISE < levels[lead - 1]:
        lead -= 1
    return lead


@dataclass(frozen=True)
class OnsetWitness:
    """What the stage noted of one frame it handed on, for where the caller began."""

    # Whether the linear estimate showed the caller, and its residual's level (mean square); None where it
    # cannot say (not trusted yet, and the line within what the echo alone reached).
    evidence: tuple[bool, float] | None
    aec3_level: float  # AEC3's output, mean square
    # The estimate's residual over what it expects of the echo alone; None where it was not trusted once
    # since it was placed.
    over_expected: float | None


def find_onset(frames: list[OnsetWitness], strong_frames: int) -> tuple[int, bool]:
    """Where the caller began (an index into ``frames``, oldest first; ``len(frames)`` where the last does
    not show them), and whether the linear estimate placed it rather than AEC3's output. ``strong_frames``:
    the run of frames, ending with the last, that showed the caller beyond doubt (0: none)."""
    evidence = [f.evidence for f in frames]
    if evidence and evidence[-1] is not None and evidence[-1][0]:  # the estimate sees them under the echo
        residual = [0.0 if e is None else e[1] for e in evidence]
        first = caller_onset_in_evidence([e is not None and e[0] for e in evidence], residual)
        strong = len(evidence) - strong_frames + 1  # where the caller became most of the line
        if strong_frames and strong - first > ONSET_QUIET_FRAMES:
            first += quietest_between(residual[first:], strong - first)
        else:
            first = rising_lead(residual, [f.over_expected for f in frames], first)
        return first, True
    # Not trusted (yet, or any more): where AEC3's output rose, or the estimate's residual before it.
    risen = residual_onset([f.over_expected for f in frames])
    rose = caller_onset([f.aec3_level for f in frames])
    return min(risen, rose), risen < rose
