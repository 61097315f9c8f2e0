"""ICE consent: a peer that stops answering consent checks is dropped, and the reason is said."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from conftest import running_server
from lychee_rtc.bench.client import RtcClient
from lychee_rtc.rtc.consent import ice_connections


async def test_expired_consent_closes_the_call_with_its_real_reason(caplog):
    caplog.set_level(logging.WARNING, logger="lychee_rtc")
    # Media keeps flowing (no media timeout); only consent checks go unanswered.
    settings = {"media_timeout_s": 120, "resume_window_s": 1.0}
    async with running_server(rtc={"ice_consent_timeout_s": 3.0}, session=settings) as (url, _):
        client = RtcClient(url)
        await client.connect()
        try:
            await client.wait_event("session.created")
            for connection in ice_connections(client.pc):
                # Fault injection at the far end: the peer ignores the server's STUN binding requests.
                connection.request_received = lambda *args, **kwargs: None
            # The path is gone, so the client hears nothing: the reason is in the log and the metrics.
            expired = 'lychee_rtc_sessions_closed_total{reason="ice_consent_expired"} 1.0'
            async with aiohttp.ClientSession() as http:
                for _ in range(600):
                    async with http.get(f"{url}/metrics") as resp:
                        metrics = await resp.text()
                    if expired in metrics:
                        break
                    await asyncio.sleep(0.1)
                assert expired in metrics
                async with http.get(f"{url}/v1/sessions") as resp:
                    assert (await resp.json())["sessions"] == []
            assert any("ICE consent expired" in r.getMessage() for r in caplog.records)
        finally:
            await client.close()


async def test_answered_consent_keeps_the_call():
    async with running_server(rtc={"ice_consent_timeout_s": 2.0}) as (url, app):
        client = RtcClient(url)
        await client.connect()
        try:
            await client.wait_event("session.created")
            client.send({"type": "ping", "client_time": 1.0})
            await client.wait_event("pong", timeout=20)
            n = len(client.events)
            await asyncio.sleep(4.0)  # several consent periods: the call is still there and answers
            client.send({"type": "ping", "client_time": 2.0})
            await client.wait_event("pong", timeout=20, after=n, client_time=2.0)
            assert not client.events_of("session.closed")
        finally:
            await client.close()
