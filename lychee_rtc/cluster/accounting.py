"""The calls the entry sent to one worker that the worker's last status report may not count yet.

The entry learns a worker's free slots from status reports it requests through Ray (registry.py).
A report is the worker's state when the worker ran the request, so it counts a call only if the
call existed by then. The entry therefore counts what it placed itself:

* an offer counts from the moment the entry sends it until the worker answers (in flight);
* once the worker has answered with a call, it counts until a status report arrives that was
  *requested after that answer*: only such a report is sure to include the call. A report
  requested earlier and arriving later (Ray queues requests, a poll may be slow) is stale for
  this call and erases nothing, so a burst of offers spreads instead of landing on the worker
  that a stale report showed empty;
* an offer that never reached the worker, or that the worker refused, stops counting at once.

A worker that answered "full" is taken as full the same way, until a report requested after
that answer says otherwise.

The count errs towards full: a stale report that the worker ran after the call was made shows the
call, and the entry counts it once more. It therefore steers offers, and the refusal for want of
room is the worker's (``Registry.choose``).

"Before" and "after" are positions in one sequence of events of the entry's event loop (answers
received, reports requested), not clock readings, so two events never tie.
"""

from __future__ import annotations

import itertools

_events = itertools.count(1)


def now() -> int:
    """The position of an event (an answer received, a report requested) in the entry's order."""
    return next(_events)


class Placement:
    """One offer on its way to a worker. It ends exactly once: ``taken`` or ``released``."""

    def __init__(self, owner: Placements) -> None:
        self._owner = owner
        self._open = True
        owner.in_flight += 1

    def taken(self) -> None:
        """The worker answered with a call (or may hold one): it counts until a fresh report."""
        if self._close():
            self._owner.answered.append(now())

    def released(self) -> None:
        """The offer did not become a call at this worker (unreachable, refused, full)."""
        self._close()

    def _close(self) -> bool:
        if not self._open:
            return False
        self._open = False
        self._owner.in_flight -= 1
        return True


class Placements:
    """One worker's placements that its status reports may not include yet."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.answered: list[int] = []  # when each answered placement was answered
        self.full_since: int | None = None  # when the worker last answered "full"

    def begin(self) -> Placement:
        return Placement(self)

    def mark_full(self) -> None:
        self.full_since = now()

    def reported(self, requested_at: int) -> None:
        """A status report requested at ``requested_at`` arrived: what it includes stops counting here."""
        self.answered = [at for at in self.answered if at > requested_at]
        if self.full_since is not None and self.full_since < requested_at:
            self.full_since = None

    @property
    def count(self) -> int:
        """Slots taken beyond what the last report shows."""
        return self.in_flight + len(self.answered)

    @property
    def full(self) -> bool:
        return self.full_since is not None
