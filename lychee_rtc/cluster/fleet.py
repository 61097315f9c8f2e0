"""The entry's fleet: Ray, the workers it placed, which worker takes a call, drains and retirement.

Nothing here speaks HTTP to clients: the handlers in entry.py ask the fleet for a worker and turn
its answers (or ``NoPlacement``) into responses. The fleet talks to the workers through Ray
(placement, status, drain) and through its HTTP client (forwards, health checks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, TypeVar

import aiohttp

from lychee_rtc.cluster import placement
from lychee_rtc.cluster.accounting import Placement
from lychee_rtc.cluster.ids import worker_id
from lychee_rtc.cluster.metrics import EntryMetrics
from lychee_rtc.cluster.proxy import WorkerFailed, WorkerUnreachable
from lychee_rtc.cluster.registry import DOWN_AFTER_SLOW_CHECKS, HttpFailure, Registry, WorkerView
from lychee_rtc.config import Settings

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # open connections from the entry to all workers together
GROWTH_CHECK_S = 2.0  # how often workers: auto looks for nodes that joined

Answer = TypeVar("Answer")


@dataclass(frozen=True)
class NoPlacement:
    """No worker took the call: what the entry answers instead (a 502 or a 503 with Retry-After)."""

    status: int
    code: str
    message: str


@dataclass(frozen=True)
class Placed(Generic[Answer]):
    """The worker that answered, its answer, and the offer's count against it."""

    view: WorkerView
    answer: Answer
    placement: Placement  # ended already, unless the caller asked to end it (``settle_later``)


class Fleet:
    """What the entry's handlers share: settings, the worker registry, the HTTP client to workers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = EntryMetrics()
        cluster = settings.cluster
        self.registry = Registry(self.metrics, cluster.poll_interval_s, cluster.status_timeout_s)
        self.registry.restarting = placement.is_restarting
        self.registry.on_drained = self._retire
        self.registry.http_alive = self._http_alive
        self.registry.unplaced = self._unplaced
        self.http: aiohttp.ClientSession | None = None
        self.started_ray = False
        self.waiting: str | None = None  # why no worker could be placed at all (workers: auto), if so
        self._tasks: list[asyncio.Task] = []

    def timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        cluster = self.settings.cluster
        return aiohttp.ClientTimeout(total=total or cluster.forward_timeout_s, sock_connect=cluster.connect_timeout_s)

    def download_timeout(self) -> aiohttp.ClientTimeout:
        """A file of any length: no limit on the whole, only on each wait for the next bytes."""
        cluster = self.settings.cluster
        return aiohttp.ClientTimeout(total=None, sock_connect=cluster.connect_timeout_s,
                                     sock_read=cluster.forward_timeout_s)

    # --- life ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.started_ray = await loop.run_in_executor(None, placement.connect, self.settings.cluster)
        self.http = aiohttp.ClientSession(auto_decompress=False,
                                          connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS))
        await self.place_workers()
        self._tasks = [asyncio.create_task(self.registry.run(), name="cluster-monitor")]
        if self.settings.cluster.workers == "auto":
            self._tasks.append(asyncio.create_task(self._follow_cluster(), name="cluster-growth"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.http is not None:
            await self.http.close()
        if self.started_ray:  # a Ray of our own ends with us, and its workers with it
            await asyncio.get_running_loop().run_in_executor(None, placement.shutdown)

    async def place_workers(self) -> None:
        """Place the workers the cluster has room for and that are not placed yet."""
        loop = asyncio.get_running_loop()
        cluster = self.settings.cluster
        resources = await loop.run_in_executor(None, placement.cluster_resources)
        count = placement.worker_count(cluster, resources)
        waiting = placement.no_room_reason(cluster, resources) if count == 0 and not self.registry.workers else None
        if waiting is not None and waiting != self.waiting:
            log.warning("cluster entry: no room for a worker yet (%s); waiting for nodes", waiting)
        self.waiting = waiting  # checked every GROWTH_CHECK_S: said once, shown in the workers list
        new = [worker_id(i) for i in range(count) if worker_id(i) not in self.registry.workers]
        if not new:
            return
        held = [w.worker_id for w in self.registry.workers.values() if w.state in ("starting", "down")]
        if held:
            # Room that appears while a worker is being placed or restarted is that worker's: a node
            # that rejoins before Ray has declared its old self dead is counted twice for a while.
            log.debug("cluster entry: room for %d more, kept for %s", len(new), ", ".join(held))
            return
        handles = await loop.run_in_executor(None, placement.spawn, self.settings, new)
        for worker, handle in handles.items():
            self.registry.add(worker, handle)
        log.info("cluster entry: placed workers %s (%d in all)", ", ".join(new), len(self.registry.workers))

    async def _follow_cluster(self) -> None:
        """With workers: auto, nodes that join later get their workers too."""
        while True:
            await asyncio.sleep(GROWTH_CHECK_S)
            try:
                await self.place_workers()
            except Exception:  # Ray briefly unreachable: the next check tries again
                log.warning("cluster entry: cannot read the cluster's resources", exc_info=True)

    # --- what the registry asks ---------------------------------------------------------------------

    async def _http_alive(self, url: str) -> HttpFailure | None:
        try:
            async with self.http.get(url + "/healthz", timeout=self.timeout(self.settings.cluster.status_timeout_s)) as r:
                await r.read()
                return None if r.status == 200 else HttpFailure(f"/healthz answered {r.status}")
        except asyncio.TimeoutError as exc:
            return HttpFailure(f"/healthz: no answer within {self.settings.cluster.status_timeout_s:g} s "
                               f"{DOWN_AFTER_SLOW_CHECKS} times in a row ({type(exc).__name__})", timed_out=True)
        except aiohttp.ClientError as exc:
            return HttpFailure(f"/healthz: {type(exc).__name__}: {exc}")

    async def _unplaced(self, view: WorkerView) -> str | None:
        return await asyncio.get_running_loop().run_in_executor(
            None, placement.unplaced_reason, self.settings.cluster, view.handle)

    # --- placing a call -----------------------------------------------------------------------------

    async def on_a_worker(self, attempt: Callable[[WorkerView], Awaitable[Answer]],
                          full: Callable[[Answer], bool], accepted: Callable[[Answer], bool],
                          settle_later: bool = False) -> Placed[Answer] | NoPlacement:
        """Run ``attempt`` on the least-loaded worker with room, then the next, until one answers.

        The offer counts against its worker while it is forwarded and, once ``accepted``, until
        that worker's next fresh status report (accounting.py). With ``settle_later`` an accepted
        offer stays in flight for the caller to end: when the answer does not yet mean the worker
        holds the call. A worker that cannot be reached is marked down and one whose answer is
        ``full`` is marked full; either way the next is tried. Returns the worker and its answer
        (accepted or refused), or why no worker took the call.
        """
        registry, metrics = self.registry, self.metrics
        tried: set[str] = set()
        while (view := registry.choose(tried)) is not None:
            tried.add(view.worker_id)
            placed = view.placements.begin()
            try:
                answer = await attempt(view)
            except WorkerUnreachable as exc:
                placed.released()  # the request never reached the worker
                registry.mark_down(view, str(exc))
                metrics.offers.labels("unreachable").inc()
                continue
            except WorkerFailed as exc:
                placed.taken()  # it reached the worker, which may hold the call: a fresh report will say
                metrics.offers.labels("failed").inc()
                return NoPlacement(502, "worker_failed", f"worker {view.worker_id}: {exc}")
            except BaseException:
                placed.released()
                raise
            if full(answer):
                placed.released()
                registry.mark_full(view)
                metrics.offers.labels("worker_full").inc()
                continue
            if accepted(answer):
                if not settle_later:
                    placed.taken()
                metrics.offers.labels("placed").inc()
            else:
                placed.released()
                metrics.offers.labels("refused").inc()
            return Placed(view, answer, placed)
        metrics.offers.labels("cluster_full").inc()
        if registry.count("ready") == 0:
            return NoPlacement(503, "no_worker_ready", "no worker is ready to take a call; retry later")
        return NoPlacement(503, "server_full", "all sessions are in use; retry later")

    # --- drain and retirement -----------------------------------------------------------------------

    async def drain(self, view: WorkerView, deadline_s: float, restart: bool) -> None:
        view.restart_after_drain = restart
        status = await asyncio.wait_for(view.handle.drain.remote(deadline_s), self.settings.cluster.status_timeout_s * 5)
        view.status, view.state, view.reason, view.since = status, "draining", "drain requested", time.monotonic()

    async def _retire(self, view: WorkerView) -> None:
        """A drained worker: Ray replaces its process (rolling restart) or it stops for good."""
        restart = view.restart_after_drain and self.settings.cluster.max_restarts != 0
        view.retired_boot = view.status["boot"] if view.status else None
        await asyncio.get_running_loop().run_in_executor(None, placement.kill, view.handle, restart)
        view.state = "starting" if restart else "stopped"
        view.reason = "restarting after drain" if restart else "drained"
        view.since = time.monotonic()
        log.info("worker %s drained: %s", view.worker_id, view.reason)
