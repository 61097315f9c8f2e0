"""Calls the server places: POST /v1/telephony/calls through Janus's SIP plugin and Kamailio to SIPp callees.

The callee is a SIPp UAS registered at the local Kamailio as ``sip:alice@127.0.0.1``; the server
dials that address-of-record, so the INVITE takes the real path (Janus, then the registrar's
location lookup, then the phone). Each outcome a phone can give is exercised: answered (and the
audio checked both ways by correlation), busy (486), declined (603) and never answered.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest
from conftest import free_port, running_server, wait_until
from contract import check_response
from sip_tools import RATE, LoopbackCapture, Uas, listening, sip_register, sipp_uas_scenario, speech_pcap
from test_rtc_echo import best_match
from test_sip_gateway import EventTap, gateway_overrides, received_audio, registered, speech_8k, stack  # noqa: F401

from lychee_rtc.calls.tokens import new_session_token
from lychee_rtc.gateway.dial_out import OutboundCall, sip_target, status_for_sip_code, valid_target
from lychee_rtc.gateway.transfer import sipfrag_status
from lychee_rtc.server.app import GATEWAY_KEY, REGISTRY_KEY
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.native import NativeDialect

pytestmark = pytest.mark.timeout(600)


def test_an_attempt_reports_its_final_status_and_how_an_answered_call_ended():
    unanswered = OutboundCall(to="sip:a@b", caller_id=None, ring_timeout_s=5)
    unanswered.set_status("ringing", 180)
    unanswered.set_status("busy", 486)
    assert (unanswered.status, unanswered.sip_status) == ("busy", 486)
    given_up = OutboundCall(to="sip:a@b", caller_id=None, ring_timeout_s=5)
    given_up.set_status("ringing", 183)
    given_up.set_status("no_answer", None, "no final answer within 5 s: cancelled")
    assert given_up.sip_status is None and given_up.reason.startswith("no final answer")
    answered = OutboundCall(to="sip:a@b", caller_id=None, ring_timeout_s=5)
    answered.set_status("answered", 200)
    assert answered.duration_s is not None and answered.resource()["duration_s"] is None  # not over yet
    answered.end("caller_hangup")
    body = answered.resource()
    assert (body["status"], body["sip_status"], body["hung_up_by"], body["reason"]) == (
        "completed", 200, "far_end", "caller_hangup")
    assert body["duration_s"] == answered.duration_s >= 0
    answered.end("deleted")  # a second end changes nothing
    assert answered.hung_up_by == "far_end"


def test_targets_and_outcomes():
    assert valid_target("sip:alice@example.com") and valid_target("sips:a@b;transport=tls")
    assert valid_target("tel:+14155550123")
    for bad in ("alice", "sip:example.com", "tel:abc", "http://x", "sip:a@b c", 7, None, "sip:" + "a" * 300 + "@b"):
        assert not valid_target(bad), bad
    assert sip_target("tel:+14155550123;phone-context=x", "sip:pbx.example.com:5060") == \
        "sip:+14155550123@pbx.example.com:5060;user=phone"
    assert sip_target("sip:a@b", "sip:r") == "sip:a@b"
    assert [status_for_sip_code(c, None) for c in (486, 600, 603, 480, 408, 404, 500)] == \
        ["busy", "busy", "declined", "no_answer", "no_answer", "failed", "failed"]
    assert status_for_sip_code(487, "cancelled") == "cancelled" and status_for_sip_code(486, "cancelled") == "busy"
    assert sipfrag_status("SIP/2.0 180 Ringing\r\n") == (180, "Ringing")
    assert sipfrag_status("SIP/2.0 200 OK") == (200, "OK") and sipfrag_status("garbage") is None


async def callee(stack, user: str = "alice") -> Uas:
    uas = Uas.on_free_ports()
    # Only this callee: bindings left by earlier tests would fork the INVITE to phones long gone.
    assert await asyncio.to_thread(sip_register, stack.ports.sip, user, None) == 200
    status = await asyncio.to_thread(sip_register, stack.ports.sip, user, uas.sip_port)
    assert status == 200, f"REGISTER of {user} answered {status}"
    return uas


async def place(url: str, to: str, **fields) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/telephony/calls", json={"to": to, **fields}) as resp:
            raw = await resp.read()
            check_response("/v1/telephony/calls", "POST", resp.status, resp.headers, raw)
            return resp.status, json.loads(raw)


async def resource(url: str, placed: dict, method: str = "GET", token: str | None = "own") -> dict:
    """The placed call's resource, with the token of the 201 that placed it (``token``: another one)."""
    bearer = placed["session_token"] if token == "own" else token
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"{url}/v1/telephony/calls/{placed['id']}", headers=headers) as resp:
            raw = await resp.read()
            check_response("/v1/telephony/calls/{call}", method, resp.status, resp.headers, raw)
            if token != "own":
                return {"status": resp.status}
            assert resp.status == 200
            return json.loads(raw)


def tap_attempt(app, call_id: str) -> EventTap:
    attempt = app[GATEWAY_KEY].dialer.find(call_id)
    tap = EventTap()
    NativeDialect(attempt.session, EventChannel(tap)).attach()
    return tap


async def test_placed_call_is_answered_heard_both_ways_and_hung_up(stack, tmp_path, speech_8k):
    pcap = tmp_path / "speech.pcap"
    speech_pcap(pcap, [np.zeros(RATE, np.float32), speech_8k, np.zeros(4 * RATE, np.float32)])
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack),
                              session={"window_grace_ms": 400}) as (url, app):
        await registered(app)
        uas = await callee(stack)
        async with LoopbackCapture(tmp_path / "rx.pcap", uas.media_port) as capture:
            far_end = asyncio.create_task(uas.run(sipp_uas_scenario("answer", pcap), tmp_path))
            await listening(uas, far_end)
            dialled_at = time.time()
            status, body = await place(url, f"sip:alice@127.0.0.1:{stack.ports.sip}", **{"from": "sip:+15550100@example.com"},
                                       session={"instructions": "Remind them of the appointment."})
            assert status == 201, body
            assert body["status"] in ("dialing", "ringing") and body["direction"] == "outbound" and body["session_id"] is None
            tap = tap_attempt(app, body["id"])
            # The call's id is a name: only the token of its 201 opens it (no server key is set here).
            assert body["session_token"].startswith("stok_")
            for other in (None, new_session_token()):
                for method in ("GET", "DELETE"):
                    assert (await resource(url, body, method, token=other))["status"] == 401
            await wait_until(lambda: tap.of("session.created"), 60, "the call to be answered")
            answered = await resource(url, body)
            assert answered["status"] == "answered" and answered["sip_status"] == 200
            session_id = answered["session_id"]
            call = app[REGISTRY_KEY].calls[session_id]
            assert call.session.origin["direction"] == "outbound"
            assert call.session.origin["callee"] == f"sip:alice@127.0.0.1:{stack.ports.sip}"
            # The callee's speech comes back (echo engine): the media path works both ways.
            await wait_until(lambda: tap.of("output_audio_buffer.stopped"), 90, "the echo to be played")
            await resource(url, body, "DELETE")
            result = await far_end  # ends only once SIPp got our BYE and answered it
            assert result.returncode == 0, result.explain()
            rtp = await capture.stop()
        statuses = [(e["status"], e.get("sip_status")) for e in tap.of("call.status")]
        assert statuses[0] == ("dialing", None) and ("ringing", 180) in statuses and statuses[-2:] == [
            ("answered", 200), ("completed", 200)]
        # Its event stream hears how it ended, before the session's last event.
        completed = tap.of("call.status")[-1]
        assert completed["hung_up_by"] == "server" and completed["reason"] == "deleted"
        assert tap.events.index(completed) < tap.events.index(tap.of("session.closed")[0])
        ended = await resource(url, body)
        assert ended["status"] == "completed" and ended["reason"] == "deleted" and ended["hung_up_by"] == "server"
        assert ended["duration_s"] == completed["duration_s"] == pytest.approx(ended["ended_at"] - ended["answered_at"],
                                                                               abs=0.01)
        assert ended["duration_s"] > 0
        # A phone call like an answered one: the phone legs' processing, not a browser's.
        processing = tap.of("session.created")[0]["session"]["audio_processing"]
        assert processing["echo_cancellation"] and processing["high_pass_filter"]
        assert app[GATEWAY_KEY].counters.dial_answered == 1 and app[REGISTRY_KEY].free == app[REGISTRY_KEY].capacity
        ringing = answered["ringing_at"] - dialled_at
        audio = [p.arrival for p in rtp if p.payload_type == 0]
        first_audio = min(audio) - answered["answered_at"] if audio else float("nan")
        leg_up = call.connected_at - call.negotiated_at
        print(f"dial to ringing {ringing * 1000:.0f} ms; answer to the WebRTC leg up {leg_up * 1000:.0f} ms; "
              f"answer to the first audio packet at the callee {first_audio * 1000:.0f} ms")
    score = best_match(received_audio(rtp), speech_8k, RATE)
    print(f"echo correlation {score:.3f}")
    assert score > 0.9, f"echo correlation {score:.2f}"


@pytest.mark.parametrize("user, answer, status, sip_status", [("bob", "486 Busy Here", "busy", 486),
                                                              ("+15550199", "603 Decline", "declined", 603)])
async def test_placed_call_refused(stack, tmp_path, user, answer, status, sip_status):
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack)) as (url, app):
        await registered(app)
        uas = await callee(stack, user)
        far_end = asyncio.create_task(uas.run(sipp_uas_scenario(answer), tmp_path))
        await listening(uas, far_end)
        # A tel: number is dialled as sip:<number>@<registrar>;user=phone (Janus takes SIP URIs only).
        target = f"tel:{user}" if user.startswith("+") else f"sip:{user}@127.0.0.1:{stack.ports.sip}"
        code, body = await place(url, target)
        assert code == 201, body
        tap = tap_attempt(app, body["id"])
        await wait_until(lambda: tap.of("session.closed"), 60, f"the {sip_status}")
        result = await far_end
        assert result.returncode == 0, result.explain()
        final = await resource(url, body)
        assert (final["status"], final["sip_status"]) == (status, sip_status)
        assert final["session_id"] is None and final["ended_at"] is not None
        assert [e["status"] for e in tap.of("call.status")][-1] == status
        assert tap.of("session.closed")[0]["reason"] == status and not tap.of("session.created")
        # Nothing is held: every session is free, and the line takes the next call. The attempt's slot goes
        # back as its task leaves the admission, a step after the session's last event (on a busy machine,
        # after the requests above): waited for, with a deadline.
        assert not app[REGISTRY_KEY].calls
        await wait_until(lambda: app[REGISTRY_KEY].free == app[REGISTRY_KEY].capacity, 30, "the slot to come back")
        # The line is freed once Janus has dropped the call's WebRTC leg (a request after the session closed,
        # so that the next call on the line is not refused): a round trip later.
        await wait_until(lambda: app[GATEWAY_KEY].status()["busy_lines"] == 0, 30, "the line freed")


async def test_unanswered_call_times_out_and_frees_everything(stack, tmp_path):
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack)) as (url, app):
        await registered(app)
        uas = await callee(stack, "carol")
        far_end = asyncio.create_task(uas.run(sipp_uas_scenario("never"), tmp_path))
        await listening(uas, far_end)
        code, body = await place(url, f"sip:carol@127.0.0.1:{stack.ports.sip}", ring_timeout_s=3)
        assert code == 201, body
        tap = tap_attempt(app, body["id"])
        await wait_until(lambda: tap.of("session.closed"), 60, "the attempt to give up")
        result = await far_end  # SIPp saw our CANCEL, answered it and ended its INVITE with 487
        assert result.returncode == 0, result.explain()
        final = await resource(url, body)
        assert final["status"] == "no_answer" and final["ringing_at"] is not None
        assert final["ended_at"] - final["created_at"] >= 3
        # It rang (180) but that is no outcome: our CANCEL ended it, and Janus reports no final
        # status for that, so none, with the reason.
        assert final["sip_status"] is None and "3 s" in final["reason"]
        last = tap.of("call.status")[-1]
        assert last["status"] == "no_answer" and "sip_status" not in last and last["reason"] == final["reason"]
        await wait_until(lambda: app[REGISTRY_KEY].free == app[REGISTRY_KEY].capacity, 30, "the slot to come back")
        # The line is freed once Janus has dropped the call's WebRTC leg (a request after the session closed,
        # so that the next call on the line is not refused): a round trip later.
        await wait_until(lambda: app[GATEWAY_KEY].status()["busy_lines"] == 0, 30, "the line freed")


async def test_bad_requests_and_a_full_server_dial_nothing(stack, tmp_path):
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack),
                              session={"max_sessions": 1}) as (url, app):
        await registered(app)
        for bad in ({"to": "alice"}, {"to": "sip:127.0.0.1"}, {"to": "sip:a@b", "extra": 1},
                    {"to": "sip:a@b", "ring_timeout_s": 0}, {"to": "sip:a@b", "session": {"voice": 3}},
                    {"to": "sip:a@b", "from": "not a uri"}):
            code, body = await place(url, **bad)
            assert code == 400, (bad, body)
            assert body["error"]["code"] in ("invalid_target", "invalid_request", "invalid_session", "invalid_caller_id")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/telephony/calls/call_nope",
                                headers={"Authorization": f"Bearer {new_session_token()}"}) as resp:
                assert resp.status == 404
        # Nobody of that name: the registrar's 404 is the outcome, and the slot comes back.
        code, unknown = await place(url, f"sip:nobody@127.0.0.1:{stack.ports.sip}")
        assert code == 201
        await wait_until(lambda: app[GATEWAY_KEY].dialer.find(unknown["id"]).final, 60, "the registrar's answer")
        final = await resource(url, unknown)
        assert (final["status"], final["sip_status"]) == ("failed", 404)
        await wait_until(lambda: app[REGISTRY_KEY].free == 1, 30, "the slot to come back")
        # Capacity is taken before dialling: with the one session in use, nothing is dialled.
        uas = await callee(stack, "dave")
        far_end = asyncio.create_task(uas.run(sipp_uas_scenario("never"), tmp_path))
        await listening(uas, far_end)
        code, first = await place(url, f"sip:dave@127.0.0.1:{stack.ports.sip}", ring_timeout_s=60)
        assert code == 201
        code, second = await place(url, f"sip:dave@127.0.0.1:{stack.ports.sip}")
        assert code == 503 and second["error"]["code"] == "server_full"
        assert app[GATEWAY_KEY].counters.dialled == 2
        # Cancelling while it rings frees everything.
        await resource(url, first, "DELETE")
        await wait_until(lambda: app[REGISTRY_KEY].free == 1, 30, "the slot to come back")
        result = await far_end
        assert result.returncode == 0, result.explain()
        assert (await resource(url, first))["status"] == "cancelled"
