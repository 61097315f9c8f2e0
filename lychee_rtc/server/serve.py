"""Serving an aiohttp application: one path for the single server, the cluster entry and a worker.

A listening socket is bound before anything is announced, so a busy port is one line, not a banner
and a traceback; every site logs access through the redacting access logger.
"""

from __future__ import annotations

import gc
import logging
import socket
import sys
from typing import Any

from aiohttp import web

from lychee_rtc.server.lifecycle import HANDLER_DRAIN_S
from lychee_rtc.server.logs import RedactingAccessLogger

log = logging.getLogger(__name__)


def flag_overrides(host: str | None, port: int | None) -> dict[str, Any]:
    """Settings overrides for the ``--host``/``--port`` flags actually given (flags win over the
    environment and the profile, so only the flags given count)."""
    server = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    return {"server": server} if server else {}


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket for ``host:port`` (IPv4 or IPv6 literal, or a name)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def start_site(app: web.Application, sock: socket.socket) -> web.AppRunner:
    """Serve ``app`` on ``sock`` inside a running event loop (a cluster worker); returns the runner to clean up."""
    runner = web.AppRunner(app, handle_signals=False, access_log_class=RedactingAccessLogger,
                           shutdown_timeout=HANDLER_DRAIN_S)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


async def _freeze_startup_objects(app: web.Application) -> None:
    """What start-up loaded (modules, settings, the engine) lives as long as the process: moved out
    of the cyclic collector's way, a full collection during calls scans only what the calls made.
    On the 2-core machine one full collection over the start-up objects took 35 ms, a stall of every
    call's media on this event loop."""
    gc.collect()
    gc.freeze()


def run(app: web.Application, host: str, port: int, banner: str) -> int:
    """Serve ``app`` in the foreground until a signal (a command's exit status: 0, or 2 with one line why)."""
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        print(f"lychee-rtc: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(banner, flush=True)
    app.on_startup.append(_freeze_startup_objects)  # after the engine's own start-up hook
    try:
        # The app's own shutdown ends every wait on a client; aiohttp then gives handlers still
        # running HANDLER_DRAIN_S (twice), within server.shutdown_grace_s (lifecycle.shutdown_deadline).
        web.run_app(app, sock=sock, print=None, access_log_class=RedactingAccessLogger,
                    shutdown_timeout=HANDLER_DRAIN_S)
    except Exception as exc:  # start-up hooks (engine, Ray) run inside run_app; report them like the rest
        log.debug("server failed", exc_info=True)
        print(f"lychee-rtc: server stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0
