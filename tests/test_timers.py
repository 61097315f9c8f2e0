"""Every timer of docs/reliability.md's table, against a live server: a slot is held exactly as long
as a timer says, and freed at once where nothing can come back.

Each test sets the timer under test short and every other one long (minutes), so that the slot
can only be freed by the timer under test within the test's deadline; and checks that it was not
freed before the timer ran out. The table itself is checked against the settings (name, default)
and the tests it names.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import aiohttp
import pytest

from conftest import running_server, wait_until
from telephony_support import CREDENTIALS, carrier

from lychee_rtc.bench.client import RtcClient
from lychee_rtc.config import Settings
from lychee_rtc.rtc.consent import ice_connections
from lychee_rtc.server.app import REGISTRY_KEY

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
TESTS = Path(__file__).resolve().parent
LONG = 600.0  # every timer not under test: far past any test's deadline


def timer_rows() -> list[dict[str, str]]:
    text = DOCS.read_text()
    block = text[text.index("<!-- timers:begin -->"):text.index("<!-- timers:end -->")]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| `")]
    return [{"setting": r[0].strip("`"), "default": r[1], "what": r[2], "test": r[3].strip("`")} for r in rows]


def default_of(setting: str) -> object:
    node: object = Settings()
    for part in setting.split("."):
        node = getattr(node, part)
    return node


def test_the_timer_table_names_real_settings_defaults_and_tests():
    rows = timer_rows()
    assert len(rows) >= 12
    for row in rows:
        if row["setting"].startswith("(fixed)"):
            continue
        default = default_of(row["setting"])
        assert re.fullmatch(r"[0-9.]+ s", row["default"]), row
        assert float(row["default"].split()[0]) == float(default), (row, default)
        path, _, name = row["test"].partition("::")
        assert re.search(rf"def {re.escape(name)}\b", (TESTS.parent / path).read_text()), row


def vanish(client: RtcClient) -> None:
    """The peer's UDP sockets close: no DTLS close, no session.close; the server hears nothing more."""
    for connection in ice_connections(client.pc):
        for protocol in connection._protocols:
            if protocol.transport is not None:
                protocol.transport.close()


async def closed_total(url: str, reason: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
    found = re.search(rf'lychee_rtc_sessions_closed_total{{reason="{reason}"}} ([0-9.]+)', text)
    return float(found.group(1)) if found else 0.0


async def test_a_client_that_never_connects_frees_its_slot_at_the_connect_timeout():
    session = {"connect_timeout_s": 1.5, "media_timeout_s": LONG, "resume_window_s": LONG, "max_sessions": 1}
    async with running_server(session=session) as (url, app):
        client = RtcClient(url)
        try:
            offer = await client.make_offer()
            asked = time.monotonic()  # the timer runs from the offer, before its answer comes back
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/rtc/offer", json={"sdp": offer, "type": "offer"}) as resp:
                    assert resp.status == 200  # answered, and the answer is never used
            registry = app[REGISTRY_KEY]
            await wait_until(lambda: not registry.calls, 60, "the unconnected call's slot to be freed")
            assert time.monotonic() - asked >= 1.5 * 0.9  # not before the timer (a coarse watchdog tick)
            assert await closed_total(url, "connect_timeout") == 1  # closed, not held for a resume
            assert registry.free == registry.capacity
        finally:
            await client.close()


async def connected(url: str, app, client: RtcClient) -> None:
    registry = app[REGISTRY_KEY]
    await wait_until(lambda: any(c.connected_at is not None for c in registry.calls.values()), 60, "the call to connect")


@pytest.mark.parametrize("kind", ["whip", "realtime"])
async def test_a_caller_that_cannot_resume_frees_its_slot_as_soon_as_its_path_is_lost(kind):
    """WHIP and realtime callers hold no token to resume with: their slot is not kept for the resume window."""
    session = {"connect_timeout_s": LONG, "media_timeout_s": 1.5, "resume_window_s": LONG}
    async with running_server(session=session) as (url, app):
        client = RtcClient(url, channel_label="oai-events" if kind == "realtime" else "events")
        try:
            offer = await client.make_offer()
            path = "/whip" if kind == "whip" else "/v1/realtime/calls"
            async with aiohttp.ClientSession() as http:
                async with http.post(url + path, data=offer, headers={"Content-Type": "application/sdp"}) as resp:
                    assert resp.status == 201
                    await client.accept_answer(await resp.text())
            await connected(url, app, client)
            vanish(client)
            lost = time.monotonic()
            registry = app[REGISTRY_KEY]
            await wait_until(lambda: not registry.calls, 60, "the vanished caller's slot to be freed")
            assert time.monotonic() - lost >= 1.5 * 0.9
            assert await closed_total(url, "media_timeout") == 1
        finally:
            await client.close()


async def test_a_resumable_session_is_held_for_the_resume_window_then_freed():
    session = {"connect_timeout_s": LONG, "media_timeout_s": 1.0, "resume_window_s": 2.0}
    async with running_server(session=session) as (url, app):
        client = RtcClient(url)
        try:
            await client.connect()
            await connected(url, app, client)
            registry = app[REGISTRY_KEY]
            vanish(client)
            await wait_until(lambda: all(c.suspended_at is not None for c in registry.calls.values()) and registry.calls,
                             60, "the session to be suspended")
            # The window runs from where the server lost the path (its own monotonic clock), not from
            # where this poll saw it.
            suspended = min(c.suspended_at for c in registry.calls.values())
            assert registry.free == registry.capacity - 1  # held: its client may come back
            await wait_until(lambda: not registry.calls, 60, "the resume window to end")
            assert time.monotonic() - suspended >= 2.0 * 0.9
            assert await closed_total(url, "media_timeout") == 1
        finally:
            await client.close()


async def test_a_call_ends_at_its_maximum_duration():
    async with running_server(session={"max_duration_s": 2.0}) as (url, _):
        client = RtcClient(url)
        try:
            started = time.monotonic()  # the call's clock runs from its offer, inside connect()
            await client.connect()
            closed = await client.wait_event("session.closed", timeout=60)
            assert closed["reason"] == "max_duration"
            assert time.monotonic() - started >= 2.0 * 0.9
        finally:
            await client.close()


async def test_a_body_that_does_not_arrive_in_time_is_a_408():
    async with running_server(server={"body_timeout_s": 1.0}) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /v1/rtc/offer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"sdp\":")
            await writer.drain()
            sent = time.monotonic()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            assert head.startswith(b"HTTP/1.1 408"), head
            assert b"application/json" in head
            assert time.monotonic() - sent >= 1.0 * 0.9
        finally:
            writer.close()


async def test_a_websocket_peer_that_stops_answering_is_dropped_at_the_heartbeat():
    """A sideband whose client went away without a word (answers no ping): its socket is dropped,
    the call goes on."""
    async with running_server(websocket={"heartbeat_s": 1.0}) as (url, app):
        client = RtcClient(url)
        await client.connect()
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write((f"GET /v1/realtime?call_id={client.session_id} HTTP/1.1\r\nHost: x\r\n"
                          "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                          f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {client.session_token}\r\n\r\n").encode())
            await writer.drain()
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).startswith(b"HTTP/1.1 101")
            opened = time.monotonic()
            # Read (pings and events) but never answer: the server hangs up at its heartbeat.
            while await asyncio.wait_for(reader.read(65536), 60):
                pass
            assert time.monotonic() - opened >= 1.0 * 0.9
            assert client.session_id in app[REGISTRY_KEY].calls  # the call itself goes on
        finally:
            writer.close()
            await client.close()


async def test_a_carrier_that_never_starts_its_stream_is_closed_at_the_start_timeout():
    telephony = {**CREDENTIALS, "start_timeout_s": 1.0}
    async with running_server(telephony=telephony) as (url, app):
        phone = carrier(url, "twilio")
        await phone.connect(handshake=False)  # authenticated, then silent: no start frame
        try:
            opened = time.monotonic()
            await asyncio.wait_for(phone.closed.wait(), 60)
            assert phone.log.close_code == 1008
            assert time.monotonic() - opened >= 1.0 * 0.9
            assert not app[REGISTRY_KEY].calls  # no slot was ever taken
        finally:
            await phone.close()
