"""Blind transfer: baresip calls the bot, the bot REFERs it to a SIPp callee, and both legs carry audio.

baresip is a real user agent that follows a REFER: it calls the target itself and reports the
target's answer in NOTIFYs, which Janus hands to the gateway. Audio is checked on both legs by
correlation: before the transfer the caller hears its own speech echoed by the bot; after it,
the caller and the target hear each other (the target's RTP is told apart by its source port).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.parse
import wave

import aiohttp
import numpy as np
import pytest
from conftest import free_port, running_server, synthesize, wait_until
from contract import check_response
from sip_tools import (RATE, LoopbackCapture, listening, parse_rtp, read_pcap_udp, sipp_uas_scenario, speech_pcap, to_8k)
from test_rtc_echo import best_match
from test_sip_dial_out import callee
from test_sip_gateway import (KEYED, OPERATOR, EventTap, gateway_overrides, received_audio, registered,  # noqa: F401
                              speech_8k, stack)

from lychee_rtc.server.app import GATEWAY_KEY, REGISTRY_KEY
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.native import NativeDialect

pytestmark = pytest.mark.timeout(600)

BARESIP_PORTS = (24000, 24999)


def baresip_config(tmp_path, speech: np.ndarray, sip_port: int | None = None):
    """A baresip that says ``speech`` every 10 s (so it still talks after the transfer)."""
    wav = tmp_path / "say.wav"
    gap = np.zeros(6 * RATE, np.float32)
    padded = np.concatenate([np.zeros(RATE, np.float32)] + [speech, gap] * 6)
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((np.clip(padded, -1, 1) * 32767).astype("<i2").tobytes())
    conf = tmp_path / "baresip"
    conf.mkdir()
    (conf / "config").write_text(
        "module_path /usr/lib/baresip/modules\n"
        f"sip_listen 127.0.0.1:{sip_port or free_port()}\n"
        f"audio_source aufile,{wav}\n"
        "audio_player aubridge,nowhere\n"
        "audio_alert aubridge,nowhere\n"
        f"rtp_ports {BARESIP_PORTS[0]}-{BARESIP_PORTS[1]}\n"
        "net_interface 127.0.0.1\n"
        "module stdio.so\nmodule g711.so\nmodule aufile.so\nmodule aubridge.so\n"
        "module_app account.so\nmodule_app menu.so\n")
    (conf / "accounts").write_text("<sip:baresip@127.0.0.1>;regint=0;audio_codecs=PCMU\n")
    return conf


async def read_events(ws, tap: EventTap) -> None:
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.TEXT:
            tap(msg.data)


async def stopped(reader: asyncio.Task | None) -> None:
    """A test's event reader, ended on every path: one that failed (an event that breaks the protocol) is
    not left for the next test to find."""
    if reader is not None:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def stream_ended(reader: asyncio.Task, what: str, timeout: float = 30) -> None:
    """The server writes a call's last events, then closes its stream: judge them only once it has.

    The session is closed a step before its stream's writer gets to the socket, so events the
    session emitted last (a transfer's ``completed``) can still be in flight when ``closed`` is seen.
    """
    try:
        await asyncio.wait_for(reader, timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"the event stream did not end within {timeout:.0f} s of {what}") from None


def rtp_seconds(path) -> float:
    return 0.02 * len(parse_rtp(read_pcap_udp(path))) if path.exists() else 0.0


async def answered_calls(app):
    await wait_until(lambda: app[REGISTRY_KEY].calls, 60, "the call")
    return list(app[REGISTRY_KEY].calls.values())


async def post_json(http, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body, headers=OPERATOR) as resp:
        raw = await resp.read()
        check_response("/v1/telephony/calls/{call}/" + url.rsplit("/", 1)[1], "POST", resp.status, resp.headers, raw)
        return resp.status, json.loads(raw)


async def post_transfer(url: str, call: str, target: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/telephony/calls/{call}/transfer", json={"target_uri": target},
                             headers=OPERATOR) as resp:
            raw = await resp.read()
            check_response("/v1/telephony/calls/{call}/transfer", "POST", resp.status, resp.headers, raw)
            return resp.status, json.loads(raw)


async def test_caller_is_transferred_to_a_person_and_both_legs_carry_audio(stack, tmp_path, speech_8k):
    target_speech = to_8k(synthesize("Wait, stop, stop please, I have a question for you.",
                                     voice="en+f3"), 48000) * 0.8
    target_pcap = tmp_path / "bob.pcap"
    speech_pcap(target_pcap, [np.zeros(RATE, np.float32), target_speech, np.zeros(3 * RATE, np.float32)])
    conf = baresip_config(tmp_path, speech_8k)
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack), server=KEYED,
                              session={"window_grace_ms": 400}) as (url, app):
        await registered(app)
        bob = await callee(stack, "bob")
        far_end = asyncio.create_task(bob.run(sipp_uas_scenario("answer", target_pcap, hold_ms=120000), tmp_path))
        await listening(bob, far_end)
        to_caller = LoopbackCapture(tmp_path / "caller.pcap", "udp dst portrange %d-%d" % BARESIP_PORTS)
        to_target = LoopbackCapture(tmp_path / "target.pcap", bob.media_port)
        async with to_caller, to_target:
            proc = await asyncio.create_subprocess_exec(
                "baresip", "-f", str(conf), "-e", f"/dial {stack.bot_uri}", "-t", "120",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            http = aiohttp.ClientSession()
            reader = None
            try:
                await wait_until(lambda: app[REGISTRY_KEY].calls or proc.returncode is not None, 60, "the call")
                (call,) = list(app[REGISTRY_KEY].calls.values())
                ws = await http.ws_connect(f"{url}/v1/telephony/calls/{call.session.id}/events", headers=OPERATOR)
                tap = EventTap()
                reader = asyncio.create_task(read_events(ws, tap))
                # Leg one: the bot hears the caller and answers (the echo engine says it back).
                await wait_until(lambda: tap.of("output_audio_buffer.stopped"),
                                 90, "the bot's answer")
                # Not a phone call, a malformed target: refused, and the call goes on.
                assert (await post_transfer(url, "sess_nope", "sip:bob@127.0.0.1"))[0] == 404
                assert (await post_transfer(url, call.session.id, "bob"))[0] == 400
                # From the event stream: a target nobody answers for (Kamailio's 404) fails, and the
                # call stays with the bot.
                await ws.send_json({"type": "call.transfer", "target_uri": f"sip:nobody@127.0.0.1:{stack.ports.sip}"})
                await wait_until(lambda: [e for e in tap.of("call.transfer") if e["status"] == "failed"], 60,
                                 "the transfer to nobody to fail")
                failed = tap.of("call.transfer")[-1]
                assert failed["sip_status"] == 404 and not call.session.closed
                asked_at = time.time()
                status, body = await post_transfer(url, call.session.id, f"sip:bob@127.0.0.1:{stack.ports.sip}")
                assert status == 202 and body["status"] in ("requested", "trying"), body
                await wait_until(lambda: call.session.closed, 60, "the caller to reach the target")
                assert call.session.close_reason == "transferred"
                await stream_ended(reader, "the transfer")
                transfer = [(e["status"], e.get("sip_status")) for e in tap.of("call.transfer")]
                assert transfer[-1] == ("completed", 200) and ("requested", None) in transfer[1:], transfer
                completed_at = [e["_at"] for e in tap.of("call.transfer") if e["status"] == "completed"][0]
                print(f"transfer request to the caller reaching the target: {(completed_at - asked_at) * 1000:.0f} ms")
                # Leg two: the caller and the target talk; then the caller hangs up.
                await wait_until(lambda: rtp_seconds(tmp_path / "target.pcap") >= 12, 90,
                                 "12 s of the caller's audio at the target (a full turn of its speech)")
                assert not app[REGISTRY_KEY].calls and app[GATEWAY_KEY].status()["busy_lines"] == 0
                proc.stdin.write(b"/hangup\n")
                await proc.stdin.drain()
                result = await far_end
                assert result.returncode == 0, result.explain()
            finally:
                await stopped(reader)
                await http.close()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            await to_caller.stop()
            target_rtp = await to_target.stop()
    packets = read_pcap_udp(tmp_path / "caller.pcap", with_ports=True)
    from_target = parse_rtp([(t, p) for t, src, _, p in packets if src == bob.media_port])
    from_bot = parse_rtp([(t, p) for t, src, _, p in packets if src != bob.media_port])
    echo = best_match(received_audio(from_bot), speech_8k, RATE)
    heard_target = best_match(received_audio(from_target), target_speech, RATE)
    heard_caller = best_match(received_audio(target_rtp), speech_8k, RATE)
    print(f"correlation: echo {echo:.2f}, caller hears target {heard_target:.2f}, target hears caller {heard_caller:.2f}")
    print(f"echo {echo:.3f}, the target heard by the caller {heard_target:.3f}, the caller by the target {heard_caller:.3f}")
    assert echo > 0.9 and heard_target > 0.9 and heard_caller > 0.9, (echo, heard_target, heard_caller)


async def test_openai_refer_hands_an_accepted_caller_over(stack, tmp_path, speech_8k):
    """OpenAI's flow end to end: webhook, accept, then ``client.realtime.calls.refer`` to a person."""
    from openai import AsyncOpenAI, ConflictError
    from test_sip_call_control import KEY, SECRET, WebhookReceiver, controlled

    conf = baresip_config(tmp_path, speech_8k)
    async with WebhookReceiver() as receiver, \
            running_server("configs/telephony.yaml", gateway=controlled(stack, receiver),
                           server={"auth_token": KEY}) as (url, app):
        client = AsyncOpenAI(api_key=KEY, base_url=f"{url}/v1", max_retries=0, webhook_secret=SECRET)
        await registered(app)
        bob = await callee(stack, "bob")
        far_end = asyncio.create_task(bob.run(sipp_uas_scenario("answer", hold_ms=120000), tmp_path))
        await listening(bob, far_end)
        proc = await asyncio.create_subprocess_exec(
            "baresip", "-f", str(conf), "-e", f"/dial {stack.bot_uri}", "-t", "120",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            event = await receiver.next_call(client)
            call_id = event.data.call_id
            with pytest.raises(ConflictError):  # ringing, not answered: nothing to transfer yet
                await client.realtime.calls.refer(call_id, target_uri=f"sip:bob@127.0.0.1:{stack.ports.sip}")
            await client.realtime.calls.accept(call_id, type="realtime", instructions="Transfer them to Bob.")
            call = app[REGISTRY_KEY].calls[call_id]
            await wait_until(lambda: call.connected_at is not None, 60, "the WebRTC leg to Janus")
            await client.realtime.calls.refer(call_id, target_uri=f"sip:bob@127.0.0.1:{stack.ports.sip}")
            await wait_until(lambda: call.session.closed, 60, "the caller to reach Bob")
            assert call.session.close_reason == "transferred"
            proc.stdin.write(b"/hangup\n")
            await proc.stdin.drain()
            result = await far_end  # Bob got the caller's BYE: the caller talked to Bob, not to us
            assert result.returncode == 0, result.explain()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_attended_transfer_returns_to_the_caller_or_hands_over_with_replaces(stack, tmp_path, speech_8k):
    """The caller waits on hold while the server calls the person; busy: back to the caller; answered:
    a REFER whose Refer-To replaces our call to the person, and the server leaves both calls."""
    caller_sip = free_port()
    conf = baresip_config(tmp_path, speech_8k, caller_sip)
    target_pcap = tmp_path / "bob.pcap"
    speech_pcap(target_pcap, [np.zeros(RATE, np.float32), speech_8k, np.zeros(30 * RATE, np.float32)])
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack), server=KEYED,
                              session={"window_grace_ms": 400, "max_sessions": 3}) as (url, app):
        await registered(app)
        proc = await asyncio.create_subprocess_exec(
            "baresip", "-f", str(conf), "-e", f"/dial {stack.bot_uri}", "-t", "120",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        http = aiohttp.ClientSession()
        # The SIP the caller and Kamailio receive, to read the REFERs (started first: tshark needs a moment).
        sip_capture = LoopbackCapture(tmp_path / "sip.pcap", f"udp and (dst port {stack.ports.sip} or dst port {caller_sip})")
        reader = None
        try:
            await sip_capture.__aenter__()
            (call,) = await answered_calls(app)
            ws = await http.ws_connect(f"{url}/v1/telephony/calls/{call.session.id}/events", headers=OPERATOR)
            tap = EventTap()
            reader = asyncio.create_task(read_events(ws, tap))
            target = f"sip:bob@127.0.0.1:{stack.ports.sip}"
            # The person is busy: the caller is held, then taken back.
            busy = await callee(stack, "bob")
            busy_end = asyncio.create_task(busy.run(sipp_uas_scenario("486 Busy Here"), tmp_path, tag="busy"))
            await listening(busy, busy_end)
            status, first = await post_json(http, f"{url}/v1/telephony/calls/{call.session.id}/consult",
                                            {"target_uri": target})
            assert status == 201 and first["status"] in ("dialing", "ringing"), first
            await wait_until(lambda: [e for e in tap.of("call.transfer") if e["status"] == "failed"], 60,
                             "the busy person to send the call back")
            assert tap.of("call.transfer")[-1]["sip_status"] == 486
            await wait_until(lambda: len(tap.of("call.hold")) >= 2, 30, "the caller to be taken off hold")
            assert [e["held"] for e in tap.of("call.hold")] == [True, False]
            assert (await busy_end).returncode == 0
            # The person answers (and later also takes the caller's own INVITE: two calls for SIPp).
            person = await callee(stack, "bob")
            person_end = asyncio.create_task(person.run(sipp_uas_scenario("answer", target_pcap, hold_ms=120000),
                                                        tmp_path, tag="person", calls=2))
            await listening(person, person_end)
            status, consult = await post_json(http, f"{url}/v1/telephony/calls/{call.session.id}/consult",
                                              {"target_uri": target, "session": {"instructions": "Brief Bob."}})
            assert status == 201
            await wait_until(lambda: app[GATEWAY_KEY].dialer.find(consult["id"]).status == "answered", 60,
                             "the person to answer")
            assert call.session.on_hold
            consult_call = app[REGISTRY_KEY].calls[app[GATEWAY_KEY].dialer.find(consult["id"]).session.id]
            status, body = await post_json(http, f"{url}/v1/telephony/calls/{call.session.id}/transfer",
                                           {"consult": consult["id"]})
            assert status == 202, body
            await wait_until(lambda: call.session.closed and consult_call.session.closed, 60,
                             "the server to leave both calls")
            await sip_capture.stop()
            captured = read_pcap_udp(tmp_path / "sip.pcap")
            assert call.session.close_reason == "transferred"
            assert consult_call.session.close_reason in ("transferred", "caller_hangup")
            refer = [p.decode(errors="replace") for _, p in captured if p.startswith(b"REFER ")]
            refer_to = [line for text in refer for line in text.splitlines() if line.lower().startswith("refer-to")]
            # The first REFER names our call to the person for the caller's INVITE to replace, in a
            # URI header escaped as RFC 3891's examples are (RFC 3261 19.1.1: nothing but unreserved
            # characters, the few hnv-unreserved ones and %-escapes in a header's value).
            assert refer_to and "?replaces=" in refer_to[0].lower(), refer_to
            replaces = re.search(r"\?replaces=([^>]*)>", refer_to[0], re.IGNORECASE)[1]
            assert re.fullmatch(r"(?:[A-Za-z0-9\-_.!~*'()\[\]/?:+$]|%[0-9A-Fa-f]{2})+", replaces), replaces
            call_id, *params = urllib.parse.unquote(replaces).split(";")
            assert call_id == consult["sip_call_id"]
            assert {p.split("=")[0] for p in params} == {"to-tag", "from-tag"}
            # baresip 1.0 cannot call such a URI (NOTIFY 400): the server refers it plainly instead.
            await stream_ended(reader, "the transfer")
            statuses = [e["status"] for e in tap.of("call.transfer")]
            assert statuses[-1] == "completed", statuses
            proc.stdin.write(b"/hangup\n")
            await proc.stdin.drain()
            result = await person_end
            assert result.returncode == 0, result.explain()
        finally:
            await stopped(reader)
            await sip_capture.stop()
            await http.close()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_configured_key_sends_the_caller_to_a_person(stack, tmp_path, speech_8k):
    """``gateway.janus.transfer_keys``: the caller presses 0 (RFC 4733 from baresip) and is referred."""
    conf = baresip_config(tmp_path, speech_8k)
    async with running_server("configs/telephony.yaml", session={"window_grace_ms": 400},
                              gateway=gateway_overrides(stack, transfer_keys={
                                  "0": f"sip:operator@127.0.0.1:{stack.ports.sip}"})) as (url, app):
        await registered(app)
        operator = await callee(stack, "operator")
        far_end = asyncio.create_task(operator.run(sipp_uas_scenario("answer", hold_ms=120000), tmp_path))
        await listening(operator, far_end)
        proc = await asyncio.create_subprocess_exec(
            "baresip", "-f", str(conf), "-e", f"/dial {stack.bot_uri}", "-t", "120",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            (call,) = await answered_calls(app)
            tap = EventTap()
            NativeDialect(call.session, EventChannel(tap)).attach()
            await wait_until(lambda: call.connected_at is not None, 60, "the WebRTC leg to Janus")
            proc.stdin.write(b"0")  # baresip's menu sends a key pressed during a call as DTMF
            await proc.stdin.drain()
            await wait_until(lambda: call.session.closed, 60, "the caller to reach the operator")
            assert call.session.close_reason == "transferred"
            keys = [e["event"] for e in tap.of("input_audio_buffer.dtmf_event_received")]
            assert keys[:1] == ["0"], keys
            assert [e["status"] for e in tap.of("call.transfer")][-1] == "completed"
            proc.stdin.write(b"/hangup\n")
            await proc.stdin.drain()
            result = await far_end
            assert result.returncode == 0, result.explain()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
