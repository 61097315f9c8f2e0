"""One cluster worker: the single-process server core (engine, media, HTTP) inside a Ray actor.

The server runs on an event loop of its own thread, exactly as ``lychee-rtc serve`` runs it, so its
peer connections, engine and timers never wait for Ray. Ray calls the actor's methods from another
thread; each method hands a coroutine to that loop and waits for it with a bound.

The worker listens on its node's address (or ``cluster.worker_host``); its answers carry that
node's ICE candidates, so media flows between the client and this process directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
from dataclasses import asdict, dataclass
from typing import Any, Coroutine, TypeVar

from aiohttp import web

from lychee_rtc.cluster.ids import session_prefix
from lychee_rtc.config import Settings
from lychee_rtc.server.app import ENGINE_KEY, REGISTRY_KEY, create_app
from lychee_rtc.server.serve import bind_socket, start_site, url_host

log = logging.getLogger(__name__)

T = TypeVar("T")

START_TIMEOUT_S = 600.0  # a GPU engine loads its checkpoint while the worker starts
CALL_TIMEOUT_S = 10.0
DRAIN_POLL_S = 0.25
DRAIN_REASON = "server_draining"


@dataclass(frozen=True)
class WorkerStatus:
    """What the entry learns from a worker on every poll (plain values: it crosses Ray)."""

    worker_id: str
    boot: str  # new on every start of the process: a changed boot means its old sessions are gone
    url: str
    node_ip: str
    pid: int
    engine: str
    capacity: int
    free: int
    active: int
    ready: bool
    draining: bool
    drained: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _listen(host: str, ports: tuple[int, int] | None):
    """A listening socket on the first free port of ``ports`` (any free port when None)."""
    if ports is None:
        return bind_socket(host, 0)
    last_error: OSError | None = None
    for port in range(ports[0], ports[1] + 1):
        try:
            return bind_socket(host, port)
        except OSError as exc:
            last_error = exc
    raise OSError(f"no free port in {ports[0]}-{ports[1]} on {host}: {last_error}")


class WorkerServer:
    """The Ray actor class (``ray.remote`` is applied by the entry, so this module needs no Ray)."""

    def __init__(self, worker_id: str, settings_json: str, node_ip: str | None = None) -> None:
        settings = Settings.model_validate_json(settings_json)
        # A folder of its own for its recordings: workers on one node would otherwise share one, and
        # each one's start-up recovery and retention would act on the other's calls.
        recording = settings.recording.model_copy(update={"directory": settings.recording.directory / worker_id})
        settings = settings.model_copy(update={"recording": recording})
        self.worker_id = worker_id
        self.boot = secrets.token_hex(4)
        self.node_ip = node_ip or _ray_node_ip()
        self.host = settings.cluster.worker_host or self.node_ip
        self.draining = False
        self.drained = False
        self._drain_task: asyncio.Task | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"lychee-rtc-{worker_id}", daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self.url = self._call(self._start(settings), START_TIMEOUT_S)
        log.info("worker %s (boot %s, pid %d) serving on %s", worker_id, self.boot, os.getpid(), self.url)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = CALL_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, settings: Settings) -> str:
        app = create_app(settings)
        app[REGISTRY_KEY].id_prefix = session_prefix(self.worker_id)
        self.app = app
        sock = _listen(self.host, settings.cluster.worker_ports)
        self._runner = await start_site(app, sock)
        return f"http://{url_host(self.host)}:{sock.getsockname()[1]}"

    # --- called by the entry through Ray -----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self._call(self._status()).to_dict()

    async def _status(self) -> WorkerStatus:
        registry = self.app[REGISTRY_KEY]
        engine = self.app[ENGINE_KEY]
        return WorkerStatus(
            worker_id=self.worker_id, boot=self.boot, url=self.url, node_ip=self.node_ip, pid=os.getpid(),
            engine=engine.capabilities.name, capacity=registry.capacity, free=max(registry.free, 0),
            active=len(registry.calls), ready=engine.running and not registry.closing, draining=self.draining,
            drained=self.drained)

    def drain(self, deadline_s: float) -> dict[str, Any]:
        """Take no new calls; end when the calls have ended or after ``deadline_s`` (then close them)."""
        return self._call(self._begin_drain(deadline_s)).to_dict()

    async def _begin_drain(self, deadline_s: float) -> WorkerStatus:
        if self._drain_task is None:
            self.draining = True
            self.app[REGISTRY_KEY].closing = True  # the registry refuses offers from now on
            self._drain_task = asyncio.create_task(self._drain(deadline_s), name=f"drain-{self.worker_id}")
        return await self._status()

    async def _drain(self, deadline_s: float) -> None:
        registry = self.app[REGISTRY_KEY]
        deadline = self.loop.time() + deadline_s
        while registry.calls and self.loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if registry.calls:
            log.info("worker %s: drain deadline passed; closing %d calls", self.worker_id, len(registry.calls))
        await registry.close_all(DRAIN_REASON)
        self.drained = True


def _ray_node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
