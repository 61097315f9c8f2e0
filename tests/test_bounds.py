"""Per-session structures stay bounded whatever the client does or the engine suffers."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from conftest import wait_until

from lychee_rtc.config import EchoSettings
from lychee_rtc.engine.base import Control, ControlKind, SessionOptions
from lychee_rtc.engine.echo import EchoBackend
from lychee_rtc.engine.scheduler import MAX_PENDING_CONTROLS, Engine, compact_controls
from lychee_rtc.media.playout import PlayoutBuffer
from lychee_rtc.server.app import REGISTRY_KEY
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.native import NativeDialect
from lychee_rtc.bench.client import RtcClient


class FailingEcho(EchoBackend):
    """The real echo backend with a worker that fails every job (a broken GPU, say)."""

    def apply_controls(self, slot, controls):
        raise RuntimeError("device lost")

    def step(self, windows):
        raise RuntimeError("device lost")


@pytest.mark.allowed_logs('engine step failed')
async def test_controls_of_failed_steps_do_not_pile_up():
    engine = Engine(FailingEcho(EchoSettings(), max_sessions=1))
    await engine.start()
    try:
        slot = await engine.open(SessionOptions())
        for i in range(2000):  # a client at its message rate, against an engine that always fails
            kind = [ControlKind.COMMIT, ControlKind.CANCEL, ControlKind.UPDATE, ControlKind.FORCE_LISTEN,
                    ControlKind.RELEASE_LISTEN][i % 5]
            slot.control(Control(kind, i, SessionOptions(temperature=0.5)))
            if i % 50 == 0:
                await asyncio.sleep(0.01)  # let failed steps put their controls back
            assert len(slot._controls) <= MAX_PENDING_CONTROLS + 1
        # Compacted by the next failed step on the engine's thread, which puts them back.
        await wait_until(lambda: len(slot._controls) <= 4, 10, "the failed steps to compact the controls")
        # The newest epoch's CANCEL survived the compaction.
        cancels = [c for c in slot._controls if c.kind is ControlKind.CANCEL]
        assert cancels and cancels[-1].epoch == 1996
    finally:
        await engine.stop()


def test_compaction_keeps_the_last_word_of_each_kind_in_order():
    c = [Control(ControlKind.CANCEL, 1), Control(ControlKind.FORCE_LISTEN, 1), Control(ControlKind.COMMIT, 1),
         Control(ControlKind.CANCEL, 2), Control(ControlKind.RELEASE_LISTEN, 2), Control(ControlKind.COMMIT, 2)]
    assert compact_controls(c) == [c[3], c[4], c[5]]
    assert compact_controls([]) == []


def test_played_counts_are_forgotten_when_responses_end():
    buf = PlayoutBuffer(0, 16000, 16000, 16000 * 30)
    for i in range(500):
        buf.write(f"resp_{i}", np.ones(320, np.float32))
        if i % 3:  # some responses are superseded without an end mark
            buf.end_response(f"resp_{i}")
        while buf.depth_samples or (buf._segments and buf._segments[0].end):
            buf.read(320)
        assert len(buf._played) <= 2
    buf.close()


async def test_repeated_session_close_messages_make_one_teardown(echo_server):
    url, app = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        await client.wait_event("session.created")
        session = app[REGISTRY_KEY].calls[client.session_id].session
        tasks_before = len(session._tasks)
        native = NativeDialect(session, EventChannel(lambda text: None))  # a second client of the same session
        for _ in range(50):
            native.handle_message(json.dumps({"type": "session.close"}))
        assert len(session._tasks) == tasks_before
        closed = await client.wait_event("session.closed", timeout=20)
        assert closed["reason"] == "client_closed"
        assert len(client.events_of("session.closed")) == 1
    finally:
        await client.close()
