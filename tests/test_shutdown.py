"""Shutdown: it always finishes within a bounded grace, and every call gets a final event."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import running_server
from lychee_rtc.bench.client import RtcClient
from lychee_rtc.server.app import ENGINE_KEY, REGISTRY_KEY

REPO = Path(__file__).resolve().parents[1]

# The server runs in a child process: a livelocked event loop can only be observed from outside.
# The callers hang up and the server is stopped while their sessions are still closing (their
# engine slots are being released on the worker thread): the race seen with SIGTERM right after
# a hang-up.
HANGUP_THEN_STOP = textwrap.dedent("""
    import asyncio, json, socket, sys
    from aiohttp import web
    from lychee_rtc.bench.client import RtcClient
    from lychee_rtc.config import load_settings
    from lychee_rtc.server.app import REGISTRY_KEY, create_app

    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        settings = load_settings("configs/echo.yaml", environ={},
                                 overrides={"server": {"port": port, "shutdown_grace_s": 5.0}})
        app = create_app(settings)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        clients = [RtcClient(f"http://127.0.0.1:{port}") for _ in range(3)]
        for c in clients:
            await c.connect()
            await c.wait_event("session.created", timeout=30)
        registry = app[REGISTRY_KEY]
        hanging_up = list(registry.calls)
        for session_id in hanging_up:
            asyncio.ensure_future(registry.close(session_id, "client_closed"))
        await asyncio.sleep(0)  # their close has begun: each waits for its slot to be released
        await runner.cleanup()  # SIGTERM's path: on_shutdown closes every call
        reasons = {}
        for c in clients:
            closed = await c.wait_event("session.closed", timeout=20)
            reasons[c.session_id] = closed["reason"]
            await c.close()
        print(json.dumps({"left": len(registry.calls), "hung_up": hanging_up, "reasons": reasons}), flush=True)

    asyncio.run(main())
""")


async def test_shutdown_while_calls_are_closing_finishes_and_every_call_gets_a_final_event():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HANGUP_THEN_STOP, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail("the server did not finish shutting down (event loop livelocked)")
    assert proc.returncode == 0, err.decode()[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["left"] == 0
    assert sorted(result["reasons"]) == sorted(result["hung_up"])
    assert set(result["reasons"].values()) == {"client_closed"}


async def test_a_call_whose_teardown_hangs_is_forced_after_the_grace():
    async with running_server(server={"shutdown_grace_s": 1.0}) as (url, app):
        clients = [RtcClient(url) for _ in range(2)]
        try:
            for c in clients:
                await c.connect()
                await c.wait_event("session.created", timeout=30)
            registry = app[REGISTRY_KEY]
            stuck = registry.calls[clients[0].session_id]
            hang = asyncio.Event()

            async def never_closes() -> None:  # fault injection: a transport that never finishes closing
                await hang.wait()

            real_close = stuck.pc.close
            stuck.pc.close = never_closes
            try:
                await asyncio.wait_for(registry.close_all("server_shutdown"), 30)
            finally:
                hang.set()
                await real_close()
            assert registry.calls == {}
            assert app[ENGINE_KEY].free_slots == app[ENGINE_KEY].capabilities.max_sessions
            for c in clients:
                closed = await c.wait_event("session.closed", timeout=20)
                assert closed["reason"] == "server_shutdown"
        finally:
            for c in clients:
                await c.close()
