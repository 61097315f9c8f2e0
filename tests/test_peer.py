"""Closing peers: a client that hangs up while its connection is being set up is not a server error."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiortc import RTCPeerConnection
from aiortc.exceptions import InvalidStateError

from lychee_rtc.rtc.peer import quiet_connects_of_closed_peers


@pytest.mark.allowed_logs(r"coro=<sleep\(\)")  # the other error it makes on purpose
async def test_the_connect_task_of_a_closed_peer_is_a_debug_line_and_other_errors_still_show(caplog):
    caplog.set_level(logging.DEBUG)
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    quiet_connects_of_closed_peers(loop)
    quiet_connects_of_closed_peers(loop)  # idempotent: one handler, not a chain of them
    try:
        pc = RTCPeerConnection()
        # The coroutine aiortc starts (and never awaits) after a description is set.
        connect = asyncio.ensure_future(pc._RTCPeerConnection__connect())
        await connect
        await pc.close()
        loop.call_exception_handler({"message": "Task exception was never retrieved", "future": connect,
                                     "exception": InvalidStateError("RTCIceTransport is closed")})
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("closed while it was connecting" in r.getMessage() for r in caplog.records)

        other = asyncio.ensure_future(asyncio.sleep(0))
        await other
        loop.call_exception_handler({"message": "Task exception was never retrieved", "future": other,
                                     "exception": InvalidStateError("something else")})
        assert [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        loop.set_exception_handler(before)
