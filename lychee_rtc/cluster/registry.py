"""The entry's view of its workers: state from polls, free slots, least-loaded choice.

Every ``poll_interval_s`` the entry asks each worker for its status through Ray. A worker that does
not answer within ``status_timeout_s`` several polls in a row (its process died and Ray is
restarting it, or its node is gone) is ``down`` and takes no calls; a refused health check or a
forward that cannot connect marks it down at once. When it answers again with a new boot id, the
sessions of its previous process are known to be gone and it takes calls again. The entry also
counts the offers it placed that a worker's reports may not include yet (accounting.py), so a burst
of offers does not all go to the worker that looked emptiest at the last poll; only a worker's own
answer refuses a call for want of room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from lychee_rtc.cluster.accounting import Placements, now
from lychee_rtc.cluster.metrics import EntryMetrics

log = logging.getLogger(__name__)

# starting: placed, not yet answered; ready: takes calls; draining: ends after its calls;
# down: no answer (restarting or lost); dead: Ray gave up on it; stopped: drained and not restarted.
STATES = ("starting", "ready", "draining", "down", "dead", "stopped")
DEAD_AFTER_ERRORS = 3
# /healthz, or the status poll through Ray, answers this late this many times in a row before a
# worker counts as down: on a busy host one slow answer is not a dead process (a refused
# connection is conclusive at once).
DOWN_AFTER_SLOW_CHECKS = 3


@dataclass(frozen=True)
class HttpFailure:
    reason: str
    timed_out: bool = False  # no answer in time, as opposed to refused or a wrong status
NOT_PLACED = "not placed: "  # the reason of a starting worker that Ray has found no node for


@dataclass
class WorkerView:
    worker_id: str
    handle: Any
    state: str = "starting"
    status: dict[str, Any] | None = None
    placements: Placements = field(default_factory=Placements)  # what its reports may not count yet
    restarts: int = 0  # new boots seen after the first
    lost_sessions: int = 0  # sessions that ended with a process that died
    reason: str = ""
    since: float = field(default_factory=time.monotonic)
    restart_after_drain: bool = True
    probe: Any = None  # the status request in flight (one at a time, never piled up)
    probe_requested_at: int = 0  # when it was requested (accounting.now)
    errors: int = 0  # status requests in a row that failed at once
    slow_checks: int = 0  # /healthz checks in a row that timed out
    late_polls: int = 0  # status polls in a row that got no answer within the timeout
    retired_boot: str | None = None  # the process a drain ended (its late answers are ignored)

    @property
    def url(self) -> str | None:
        return self.status["url"] if self.status else None

    @property
    def capacity(self) -> int:
        return self.status["capacity"] if self.status else 0

    @property
    def free(self) -> int:
        """Free slots by the entry's count: the last report's, less what was placed since."""
        return max(self.reported_free - self.placements.count, 0)

    @property
    def reported_free(self) -> int:
        """Free slots as the worker's last report said, without what the entry placed since."""
        if self.state != "ready" or self.status is None or self.placements.full:
            return 0
        return self.status["free"]

    @property
    def active(self) -> int:
        return self.status["active"] if self.status and self.state in ("ready", "draining") else 0

    def describe(self) -> dict[str, Any]:
        status = self.status or {}
        return {
            "worker_id": self.worker_id, "state": self.state, "reason": self.reason or None,
            "url": status.get("url"), "node_ip": status.get("node_ip"), "pid": status.get("pid"),
            "boot": status.get("boot"), "engine": status.get("engine"),
            "capacity": self.capacity if self.state in ("ready", "draining") else 0,
            "free": self.free, "active": self.active, "restarts": self.restarts,
            "lost_sessions": self.lost_sessions,
        }


class Registry:
    def __init__(self, metrics: EntryMetrics, poll_interval_s: float, status_timeout_s: float) -> None:
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self.status_timeout_s = status_timeout_s
        self.workers: dict[str, WorkerView] = {}
        # Called with a worker whose drain finished: the entry kills (and maybe restarts) its actor.
        self.on_drained: Callable[[WorkerView], Awaitable[None]] | None = None
        # Given a worker's URL, None when its HTTP port answers, else why not.
        self.http_alive: Callable[[str], Awaitable[HttpFailure | None]] | None = None
        # Whether a failed status request says the actor is being restarted (Ray fails calls to a
        # restarting actor at once); such a worker is down, however long the restart takes.
        self.restarting: Callable[[BaseException], bool] = lambda exc: False
        # Given a worker that has not answered since it was placed, why Ray has found it no node
        # (None: it has one, and is loading).
        self.unplaced: Callable[[WorkerView], Awaitable[str | None]] | None = None

    def add(self, worker_id: str, handle: Any) -> WorkerView:
        view = self.workers[worker_id] = WorkerView(worker_id, handle)
        return view

    # --- choosing ----------------------------------------------------------------------------------

    def choose(self, exclude: set[str]) -> WorkerView | None:
        """The least-loaded ready worker with a free slot (ties: most free slots, then id).

        The entry's count decides where an offer goes, never that it is refused: it may count a call
        twice for a while (a report requested before the worker answered an offer, but written after,
        shows the call, and cannot be told from one that does not). So when the count leaves no
        worker with room, a worker whose last report showed room is asked anyway; if it is full it
        answers so, and is taken as full.
        """
        candidates = [w for w in self.workers.values() if w.worker_id not in exclude and w.free > 0]
        if candidates:
            return min(candidates, key=lambda w: (1 - w.free / w.capacity, -w.free, w.worker_id))
        unsure = [w for w in self.workers.values() if w.worker_id not in exclude and w.reported_free > 0]
        if unsure:
            return min(unsure, key=lambda w: (w.placements.count - w.reported_free, w.worker_id))
        return None

    def choose_any(self, exclude: set[str]) -> WorkerView | None:
        """A ready worker for a request that takes no slot (minting a key): the least loaded, full or not."""
        candidates = [w for w in self.workers.values()
                      if w.worker_id not in exclude and w.state == "ready" and w.url is not None]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.active / max(w.capacity, 1), w.worker_id))

    @property
    def capacity(self) -> int:
        return sum(w.capacity for w in self.workers.values() if w.state == "ready")

    @property
    def free(self) -> int:
        return sum(w.free for w in self.workers.values())

    @property
    def active(self) -> int:
        return sum(w.active for w in self.workers.values())

    def count(self, state: str) -> int:
        return sum(1 for w in self.workers.values() if w.state == state)

    # --- what forwards learn -----------------------------------------------------------------------

    def mark_down(self, view: WorkerView, reason: str) -> None:
        if view.state in ("ready", "starting", "draining"):
            log.warning("worker %s is down: %s", view.worker_id, reason)
            view.state, view.reason, view.since = "down", reason, time.monotonic()
            self.metrics.worker_failures.labels(view.worker_id).inc()
            self._publish()

    def mark_full(self, view: WorkerView) -> None:
        """The worker answered "full": no offers to it until a report requested after this says otherwise."""
        view.placements.mark_full()
        self._publish()

    # --- polling -----------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(view) for view in list(self.workers.values())))
            self._publish()
            await asyncio.sleep(self.poll_interval_s)

    async def _poll(self, view: WorkerView) -> None:
        if view.state in ("dead", "stopped"):
            return
        http_failure = None
        if self.http_alive is not None and view.url is not None and view.state != "starting":
            # The data path, checked apart from Ray: a killed process refuses the connection at once,
            # while Ray only queues the status request until the process it restarts answers it.
            failure = await self.http_alive(view.url)
            view.slow_checks = view.slow_checks + 1 if failure is not None and failure.timed_out else 0
            if failure is not None and (not failure.timed_out or view.slow_checks >= DOWN_AFTER_SLOW_CHECKS):
                http_failure = failure.reason
                self.mark_down(view, http_failure)
        if view.probe is None:
            # Noted before the request leaves: every call answered until now is in its report.
            view.probe_requested_at = now()
            view.probe = asyncio.ensure_future(view.handle.status.remote())
        done, _ = await asyncio.wait({view.probe}, timeout=self.status_timeout_s)
        if not done:
            # One that has not answered since it was (re)started is still starting: loading a
            # model, or waiting for Ray to find it a node (which may never come: say why).
            if view.state == "starting":
                await self._explain_start(view)
            else:
                view.late_polls += 1
                if view.late_polls >= DOWN_AFTER_SLOW_CHECKS:
                    self.mark_down(view, f"no status within {self.status_timeout_s:g} s, "
                                         f"{view.late_polls} polls in a row")
            return
        view.late_polls = 0
        probe, view.probe = view.probe, None
        try:
            status = probe.result()
        except Exception as exc:  # Ray's errors say why: the actor died, or could not start
            self._failed(view, exc)
            return
        view.errors = 0
        if status["boot"] == view.retired_boot:
            return  # the drained process, answering before its kill took effect
        self._update(view, status, serving=http_failure is None)
        if status["drained"] and view.state == "draining" and self.on_drained is not None:
            await self.on_drained(view)

    async def _explain_start(self, view: WorkerView) -> None:
        if self.unplaced is None:
            return
        try:
            why = await self.unplaced(view)
        except Exception:  # Ray's actor table briefly unreachable: the next poll asks again
            log.debug("worker %s: cannot read its placement", view.worker_id, exc_info=True)
            return
        if why is not None:
            reason = NOT_PLACED + why
            if reason != view.reason:
                log.warning("worker %s is not placed: %s", view.worker_id, why)
                view.reason = reason
        elif view.reason.startswith(NOT_PLACED):
            log.info("worker %s is placed on a node; starting", view.worker_id)
            view.reason = ""

    def _failed(self, view: WorkerView, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if self.restarting(exc):
            # Restarting can take as long as a lost node takes to be declared dead and the worker
            # to find room elsewhere, or the node to come back: down, never given up on.
            view.errors = 0
            self.mark_down(view, reason)
            return
        # Any other immediate error again and again means Ray gave up on this one (restarts used
        # up, or its constructor fails).
        view.errors += 1
        if view.errors >= DEAD_AFTER_ERRORS:
            if view.state != "dead":
                log.error("worker %s is dead: %s", view.worker_id, reason)
                if view.status is not None:
                    view.lost_sessions += view.status["active"]
                view.state, view.reason, view.since = "dead", reason, time.monotonic()
                self._publish()
        else:
            self.mark_down(view, reason)

    def _update(self, view: WorkerView, status: dict[str, Any], serving: bool) -> None:
        previous = view.status
        if previous is not None and previous["boot"] != status["boot"]:
            view.restarts += 1
            view.lost_sessions += previous["active"]
            self.metrics.worker_restarts.labels(view.worker_id).inc()
            log.warning("worker %s restarted (pid %s -> %s): %d sessions of its previous process ended",
                        view.worker_id, previous["pid"], status["pid"], previous["active"])
        view.status = status
        view.placements.reported(view.probe_requested_at)
        if not serving and previous is not None and previous["boot"] == status["boot"]:
            return  # the same process, alive for Ray, but its HTTP port fails: it stays down
        if status["draining"]:
            state = "draining"
        elif status["ready"]:
            state = "ready"
        else:
            state = "starting"
        if state != view.state:
            log.info("worker %s: %s -> %s (%s, %d/%d free)", view.worker_id, view.state, state, status["url"],
                     status["free"], status["capacity"])
            view.state, view.reason, view.since = state, "", time.monotonic()

    def _publish(self) -> None:
        m = self.metrics
        for state in STATES:
            m.workers.labels(state).set(self.count(state))
        m.capacity.set(self.capacity)
        m.free.set(self.free)
        m.active.set(self.active)
        for view in self.workers.values():
            m.worker_up.labels(view.worker_id).set(1 if view.state == "ready" else 0)
            m.worker_free.labels(view.worker_id).set(view.free)
            m.worker_active.labels(view.worker_id).set(view.active)
