"""Phone calls end to end: SIPp and baresip call through Kamailio and Janus's SIP plugin into the server.

Nothing on the SIP side is ours: the local telephony stack (lychee_rtc/gateway/stack.py) runs the
Debian packages of Kamailio and Janus with the configs under configs/telephony/; SIPp places calls
and plays G.711 RTP from a pcap made from a speech fixture; tshark captures, on loopback, the RTP
the caller receives, which is decoded and compared with what was said.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import numpy as np
import pytest
from conftest import free_port, running_server, synthesize, wait_until
from sip_tools import (RATE, LoopbackCapture, Rtp, ensure_tools, free_media_port, pcmu_audio, run_sipp,
                       sipp_uac_scenario, speech_pcap, to_8k)
from strict import unavailable
from test_rtc_echo import best_match

from lychee_rtc.gateway.janus_sip import dtmf_from_info
from lychee_rtc.gateway.stack import StackPorts, TelephonyStack
from lychee_rtc.server.app import GATEWAY_KEY, REGISTRY_KEY
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.native import NativeDialect
from lychee_rtc.session.protocol import validate_server_event

# Kamailio and Janus start once per module (inside the first test's limit) and calls last tens of seconds.
pytestmark = pytest.mark.timeout(600)

# --- pure parts ------------------------------------------------------------------------------------

def test_sip_info_bodies_give_keys():
    assert dtmf_from_info("application/dtmf-relay", "Signal=5\r\nDuration=160") == "5"
    assert dtmf_from_info("application/dtmf-relay", "Signal= #\nDuration=100") == "#"
    assert dtmf_from_info("application/dtmf-relay", "Signal=11\r\n") == "#"
    assert dtmf_from_info("application/dtmf", "*") == "*"
    assert dtmf_from_info("application/dtmf-relay", "Signal=X") is None
    assert dtmf_from_info("text/plain", "5") is None


# --- fixtures --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> TelephonyStack:
    """Every test that places a call uses the stack; only those need root."""
    if os.geteuid() != 0:
        unavailable("SIPp plays RTP from a raw socket and tshark captures on loopback: both need root")
    ensure_tools()
    logs = tmp_path_factory.mktemp("telephony")
    with TelephonyStack(StackPorts(sip=free_port(), janus_ws=free_port()), log_to=logs) as running:
        yield running


@pytest.fixture(scope="module")
def speech_8k() -> np.ndarray:
    return to_8k(synthesize("Hello there. This is a test of the echo engine, one two three."), 48000) * 0.8


# The operator's server key: an inbound SIP call holds no client secret, so it opens over HTTP (its
# session, hold, transfer, events) with the server key only, whatever the mode.
OPERATOR_KEY = "sip-operator-key"
OPERATOR = {"Authorization": f"Bearer {OPERATOR_KEY}"}
KEYED = {"auth_token": OPERATOR_KEY}


def gateway_overrides(stack: TelephonyStack, **janus) -> dict:
    return {"janus": {"enabled": True, "url": stack.janus_url, "registrar": stack.registrar,
                      "request_timeout_s": 30, **janus}}


async def registered(app) -> None:
    gateway = app[GATEWAY_KEY]
    await wait_until(lambda: gateway.registered, 60, "the gateway to register through Janus")


async def registrar_knows_bot(stack: TelephonyStack) -> None:
    # The probe blocks for up to its timeout: off the loop that runs the server.
    await wait_until(lambda: asyncio.to_thread(stack.registrar_knows_bot), 60,
                     "Kamailio to hold the bot's registration")


class EventTap:
    """The session's event stream, as a data-channel client would get it (validated)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def __call__(self, text: str) -> None:
        event = json.loads(text)
        validate_server_event(event)
        event["_at"] = time.time()
        self.events.append(event)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


async def answered_session(app, count: int = 1):
    registry = app[REGISTRY_KEY]
    await wait_until(lambda: len(registry.calls) >= count, 60, f"{count} answered call(s)")
    return list(registry.calls.values())


async def sessions_listing(url: str) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/sessions", headers=OPERATOR) as resp:
            assert resp.status == 200
            return await resp.json()


def received_audio(rtp: list[Rtp]) -> np.ndarray:
    """What the phone heard, as audio (``pcmu_audio``: a stall's skipped slots closed up)."""
    return pcmu_audio(rtp)


# --- calls -----------------------------------------------------------------------------------------

async def test_sipp_call_is_answered_echoed_and_ended_by_the_caller(stack, tmp_path, speech_8k):
    pcap = tmp_path / "speech.pcap"
    duration = speech_pcap(pcap, [np.zeros(RATE, np.float32), speech_8k, np.zeros(4 * RATE, np.float32)])
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack),
                              session={"window_grace_ms": 400}) as (url, app):
        await registered(app)
        media = free_media_port()
        async with LoopbackCapture(tmp_path / "rx.pcap", media) as capture:
            sipp = asyncio.create_task(run_sipp(sipp_uac_scenario(pcap, hold_ms=int(duration * 1000) + 6000),
                                                tmp_path, stack.ports.sip, media))
            (call,) = await answered_session(app)
            tap = EventTap()
            NativeDialect(call.session, EventChannel(tap)).attach()
            listing = await sessions_listing(url)
            origin = listing["sessions"][0]["origin"]
            assert origin["kind"] == "sip" and origin["gateway"] == "janus"
            assert origin["caller"].startswith("sip:caller1@127.0.0.1") and origin["sip_call_id"].endswith("@127.0.0.1")
            assert tap.of("session.created")[0]["session"]["origin"] == origin
            result = await sipp
            assert result.returncode == 0, result.explain()
            await wait_until(lambda: call.session.closed, 60, "the session to end after the caller's BYE")
            assert call.session.close_reason == "caller_hangup"
            rtp = await capture.stop()
        assert app[GATEWAY_KEY].counters.caller_hangups == 1
    assert call.codec == "PCMU"
    answer = received_audio(rtp)
    # What the caller hears holds what the caller said: compared by energy envelope correlation.
    score = best_match(answer, speech_8k, RATE)
    print(f"echo correlation {score:.3f}")
    assert score > 0.9, f"echo correlation {score:.2f}"
    assert tap.of("response.created") and tap.of("output_audio_buffer.started")


async def test_server_hangs_up_and_the_caller_gets_a_bye(stack, tmp_path, speech_8k):
    pcap = tmp_path / "speech.pcap"
    speech_pcap(pcap, [np.zeros(RATE, np.float32), speech_8k[: 2 * RATE]])
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack),
                              server=KEYED) as (url, app):
        await registered(app)
        sipp = asyncio.create_task(run_sipp(sipp_uac_scenario(pcap, hold_ms=60000, hangup="callee"), tmp_path,
                                            stack.ports.sip, free_media_port()))
        (call,) = await answered_session(app)
        await wait_until(lambda: call.connected_at is not None, 60, "the WebRTC leg to Janus")
        async with aiohttp.ClientSession() as http:
            # The caller's call: its id is a name, and nobody but the operator holds a secret for it.
            async with http.delete(f"{url}/v1/sessions/{call.session.id}") as resp:
                assert resp.status == 401
            async with http.delete(f"{url}/v1/sessions/{call.session.id}", headers=OPERATOR) as resp:
                assert resp.status == 200
        result = await sipp  # the scenario ends only when SIPp has received the BYE and answered it
        assert result.returncode == 0, result.explain()
        assert app[GATEWAY_KEY].counters.server_hangups == 1


async def test_calls_up_to_capacity_then_busy(stack, tmp_path, speech_8k):
    pcap = tmp_path / "speech.pcap"
    speech_pcap(pcap, [speech_8k[: RATE]])
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack),
                              session={"max_sessions": 2, "media_timeout_s": 120}) as (url, app):
        await registered(app)
        held = [asyncio.create_task(run_sipp(sipp_uac_scenario(pcap, hold_ms=120000, hangup="callee"),
                                             tmp_path, stack.ports.sip, free_media_port(), tag=f"held{i}"))
                for i in range(2)]
        calls = await answered_session(app, 2)
        await wait_until(lambda: all(c.connected_at is not None for c in calls), 60, "both WebRTC legs")
        busy = await run_sipp(sipp_uac_scenario(None, 0, expect_busy=True), tmp_path, stack.ports.sip,
                              free_media_port(), tag="busy")
        assert busy.returncode == 0, busy.explain()
        listing = await sessions_listing(url)
        assert len(listing["sessions"]) == 2 and listing["free"] == 0
        assert len({s["origin"]["sip_call_id"] for s in listing["sessions"]}) == 2
        assert app[GATEWAY_KEY].counters.busy == 1
        for call in calls:  # both held calls are still up, then the server ends them
            assert not call.session.closed
            await app[REGISTRY_KEY].close(call.session.id, "deleted")
        for result in await asyncio.gather(*held):
            assert result.returncode == 0, result.explain()


async def test_keys_arrive_as_events_and_hash_ends_the_turn(stack, tmp_path, speech_8k):
    pcap = tmp_path / "speech.pcap"
    # Speech, then "4" and "#" as RFC 4733 telephone-events right after it; then a SIP INFO "7".
    duration = speech_pcap(pcap, [np.zeros(RATE, np.float32), speech_8k, "4#", np.zeros(4 * RATE, np.float32)])
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack),
                              # Only "#" may end the turn: the VAD would wait 10 s of silence.
                              engine={"echo": {"min_silence_ms": 10000}}) as (url, app):
        await registered(app)
        scenario = sipp_uac_scenario(pcap, hold_ms=3000, info_digits="7", info_after_ms=int(duration * 1000))
        sipp = asyncio.create_task(run_sipp(scenario, tmp_path, stack.ports.sip, free_media_port()))
        (call,) = await answered_session(app)
        tap = EventTap()
        NativeDialect(call.session, EventChannel(tap)).attach()
        result = await sipp
        assert result.returncode == 0, result.explain()
        await wait_until(lambda: len(tap.of("input_audio_buffer.dtmf_event_received")) >= 3, 60, "three keys")
        keys = [(e["event"], e["source"]) for e in tap.of("input_audio_buffer.dtmf_event_received")]
        assert keys == [("4", "rfc4733"), ("#", "rfc4733"), ("7", "sip_info")]
        # "#" ended the turn: the echo engine answered without waiting for silence.
        stopped = tap.of("input_audio_buffer.speech_stopped")
        hash_at = tap.of("input_audio_buffer.dtmf_event_received")[1]["_at"]
        assert stopped and tap.of("response.created")
        assert abs(stopped[0]["_at"] - hash_at) < 5.0  # the VAD alone would have needed 10 s


async def test_barge_in_on_the_phone_cuts_the_answer(stack, tmp_path):
    story = to_8k(synthesize("The quick brown fox jumps over the lazy dog, and then it runs far away "
                             "across the green hills towards the river, where it rests until the evening comes."),
                  48000) * 0.8
    interjection = to_8k(synthesize("Wait, stop, stop please, I have a question for you.", voice="en+f3"), 48000) * 0.8
    # The story, 3 s of silence (the echo answer starts), then the caller talks over the answer.
    pcap = tmp_path / "barge.pcap"
    # SIPp plays from the ACK on, while Janus's WebRTC leg to the server may still be coming up (over a
    # second on a busy machine): what it sends before then is never heard, so the story starts after
    # a lead long enough that its first words, which anchor the timing check below, are not lost.
    lead = np.zeros(3 * RATE, np.float32)
    gap = np.zeros(3 * RATE, np.float32)
    duration = speech_pcap(pcap, [lead, story, gap, interjection, np.zeros(6 * RATE, np.float32)])
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack),
                              session={"window_grace_ms": 400}) as (url, app):
        await registered(app)
        media = free_media_port()
        async with LoopbackCapture(tmp_path / "rx.pcap", media) as capture:
            sipp = asyncio.create_task(run_sipp(sipp_uac_scenario(pcap, hold_ms=int(duration * 1000) + 8000),
                                                tmp_path, stack.ports.sip, media))
            (call,) = await answered_session(app)
            tap = EventTap()
            NativeDialect(call.session, EventChannel(tap)).attach()
            cleared = await wait_until(lambda: tap.of("output_audio_buffer.cleared"), 90, "the answer to be cut")
            result = await sipp
            assert result.returncode == 0, result.explain()
            rtp = await capture.stop()
    cut_at = cleared[0]["_at"]
    done = [e for e in tap.of("response.done") if e["response_id"] == cleared[0]["response_id"]]
    assert done and done[0]["response"]["status_details"]["reason"] == "barge_in"
    # Stale audio: the cut response's sound still reaching the caller after the cut. It is measured
    # as the voiced 20 ms packets that arrive after the cut and before the next answer starts.
    later = [e for e in tap.of("output_audio_buffer.started") if e["_at"] > cut_at]
    next_start = later[0]["_at"] if later else float("inf")
    stale = [p for p in rtp if cut_at < p.arrival < next_start and p.payload_type == 0
             and np.sqrt(np.mean(received_audio([p]) ** 2)) > 0.01]
    stale_ms = 20 * len(stale)
    # With the phone legs' default processing (echo canceller and high-pass; the aec extra
    # installed, as make test does) and no echo on the line, as on most phone calls: the VAD puts
    # the interjection where it is on the caller's stream, measured from the story's own start
    # (both the VAD's estimates, so a lost first packet or two moves neither against the other),
    # and what the agent answers is the interjection itself.
    processing = tap.of("session.created")[0]["session"]["audio_processing"]
    if "unavailable" in processing:
        unavailable(f"the phone legs' default processing needs the aec extra: {processing['unavailable']}")
    assert processing["echo_cancellation"] and processing["high_pass_filter"]
    starts = [e["audio_start_ms"] for e in tap.of("input_audio_buffer.speech_started")]
    expected = 1000.0 * (len(story) - onset(story) + len(gap) + onset(interjection)) / RATE
    found = starts[1] - starts[0]
    answer = received_audio([p for p in rtp if p.arrival > cut_at])
    score = best_match(answer, interjection, RATE)
    print(f"stale audio after the cut: {stale_ms} ms; barge-in start {found - expected:+.0f} ms from where it "
          f"is on the stream; answer correlation {score:.3f}")
    assert stale_ms <= 200, f"{stale_ms} ms of the cut answer reached the caller"
    assert -150 <= found - expected <= 150, f"speech started at {starts} ms; {found} ms apart, {expected:.0f} expected"
    assert score > 0.8, f"the answer matches the interjection at {score:.2f}"


def onset(x: np.ndarray) -> int:
    """Where speech in ``x`` begins: its first sample at a twentieth of its peak."""
    return int(np.flatnonzero(np.abs(x) >= 0.05 * np.max(np.abs(x)))[0])


async def test_baresip_calls_and_hears_the_echo(stack, tmp_path, speech_8k):
    import wave

    wav = tmp_path / "say.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        padded = np.concatenate([np.zeros(RATE, np.float32), speech_8k, np.zeros(8 * RATE, np.float32)])
        w.writeframes((np.clip(padded, -1, 1) * 32767).astype("<i2").tobytes())
    conf = tmp_path / "baresip"
    conf.mkdir()
    sip_port = free_port()
    (conf / "config").write_text(
        "module_path /usr/lib/baresip/modules\n"
        f"sip_listen 127.0.0.1:{sip_port}\n"
        f"audio_source aufile,{wav}\n"
        "audio_player aubridge,nowhere\n"
        "audio_alert aubridge,nowhere\n"
        "rtp_ports 24000-24999\n"
        "net_interface 127.0.0.1\n"  # its SDP must name 127.0.0.1, where its RTP comes from
        "module stdio.so\nmodule g711.so\nmodule aufile.so\nmodule aubridge.so\n"
        "module_app account.so\nmodule_app menu.so\n")
    (conf / "accounts").write_text("<sip:baresip@127.0.0.1>;regint=0;audio_codecs=PCMU\n")
    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack),
                              session={"window_grace_ms": 400}) as (url, app):
        await registered(app)
        async with LoopbackCapture(tmp_path / "rx.pcap", "udp dst portrange 24000-24999") as capture:
            proc = await asyncio.create_subprocess_exec(
                "baresip", "-f", str(conf), "-e", f"/dial {stack.bot_uri}", "-t", "40",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            try:
                await wait_until(lambda: app[REGISTRY_KEY].calls or proc.returncode is not None, 60, "the call")
                if proc.returncode is not None:
                    pytest.fail("baresip ended before the call: " + (await proc.stdout.read()).decode(errors="replace"))
                (call,) = await answered_session(app)
                tap = EventTap()
                NativeDialect(call.session, EventChannel(tap)).attach()
                assert call.session.origin["caller"].startswith("sip:baresip@127.0.0.1")
                try:
                    await wait_until(lambda: tap.of("output_audio_buffer.stopped") or call.session.closed, 90,
                                     "the echo to be played")
                    assert tap.of("output_audio_buffer.stopped"), f"session closed: {call.session.close_reason}"
                except BaseException:
                    proc.kill()
                    print((await proc.communicate())[0].decode(errors="replace")[-4000:])
                    raise
                await app[REGISTRY_KEY].close(call.session.id, "deleted")
                out = (await asyncio.wait_for(proc.communicate(), 60))[0]
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            rtp = await capture.stop()
    assert b"closed" in out.lower() or b"terminated" in out.lower(), out.decode(errors="replace")[-2000:]
    score = best_match(received_audio(rtp), speech_8k, RATE)
    print(f"echo correlation {score:.3f}")
    assert score > 0.9, f"echo correlation {score:.2f}"


async def test_gateway_registers_again_after_kamailio_and_janus_restart(stack, tmp_path, speech_8k):
    pcap = tmp_path / "speech.pcap"
    speech_pcap(pcap, [speech_8k[: RATE]])

    async def one_call(tag: str) -> None:
        result = await run_sipp(sipp_uac_scenario(pcap, hold_ms=1000), tmp_path, stack.ports.sip, free_media_port(),
                                tag=tag)
        assert result.returncode == 0, result.explain()

    async with running_server("configs/telephony.yaml", gateway=gateway_overrides(stack, register_ttl_s=6)) as (url, app):
        gateway = app[GATEWAY_KEY]
        await registered(app)
        # Kamailio keeps registrations in memory: after a restart only a re-registration brings
        # the bot back, and the connector refreshes it at half its lifetime. The registrar itself
        # is asked (a counter on our side cannot tell which Kamailio a refresh reached).
        await asyncio.to_thread(stack.restart, "kamailio")
        before = gateway.counters.registrations
        await wait_until(lambda: gateway.counters.registrations > before, 60, "a re-registration")
        await registrar_knows_bot(stack)
        await one_call("after_kamailio")
        # Janus restarting takes every handle with it: the connector reconnects and starts over.
        await asyncio.to_thread(stack.restart, "janus")
        await wait_until(lambda: gateway.counters.connects >= 2 and gateway.registered, 90,
                         "the connector to reconnect to Janus and register")
        await registrar_knows_bot(stack)
        await one_call("after_janus")
        assert gateway.counters.answered == 2
