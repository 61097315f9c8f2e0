"""Real WebRTC calls (aiortc client <-> server over loopback) against the echo engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import aiohttp
import numpy as np
from conftest import PATIENT_WINDOWS, running_server, wait_until

from lychee_rtc.bench.client import RATE, ReceivedAudio, RtcClient
from lychee_rtc.pcm import PcmResampler
from lychee_rtc.session.protocol import validate_server_event

SILENCE = np.zeros(RATE // 2, np.float32)
# Opus's algorithmic delay (6.5 ms) means the decoded stream carries the last few milliseconds of
# what was encoded before a cut; audio after that, by RTP timestamp, must be the new epoch's.
CODEC_DELAY = RATE // 100


def through_16k(x: np.ndarray) -> np.ndarray:
    """What survives the engine's 16 kHz input path, for content comparisons."""
    down, up = PcmResampler(RATE, 16000), PcmResampler(16000, RATE)
    y = np.concatenate([down.process(x), down.flush()])
    return np.concatenate([up.process(y), up.flush()])


def envelope(x: np.ndarray, hop: int = 480) -> np.ndarray:
    n = len(x) // hop
    return np.sqrt(np.mean(x[: n * hop].reshape(n, hop) ** 2, axis=1)) if n else np.zeros(0)


def best_match(haystack: np.ndarray, needle: np.ndarray, rate: int = RATE) -> float:
    """Peak normalised correlation of 10 ms energy envelopes (robust to codec phase changes).

    The needle is trimmed to its voiced part and slid over the zero-padded haystack, whose
    envelope is taken at four offsets a quarter of a frame apart: on a grid of whole frames alone
    a lag between two of them would cost the match up to a third of its value (an 8 kHz phone leg
    once read 0.65 this way where its echo was 0.97). ``rate``: of both signals.
    """
    hop = rate // 100
    b = envelope(needle, hop)
    voiced = np.flatnonzero(b > 0.1 * b.max())
    b = b[voiced[0]:voiced[-1] + 1]
    b = (b - b.mean()) / (b.std() + 1e-9)
    best = -1.0
    for offset in range(0, hop, max(1, hop // 4)):
        a = np.concatenate([np.zeros(len(b)), envelope(haystack[offset:], hop), np.zeros(len(b))])
        for lag in range(len(a) - len(b) + 1):
            w = a[lag:lag + len(b)]
            if w.std() < 1e-6:
                continue
            best = max(best, float(np.mean((w - w.mean()) / w.std() * b)))
    return best


def assert_subsequence(types: list[str], expected: list[str]) -> None:
    it = iter(types)
    missing = [e for e in expected if not any(t == e for t in it)]
    assert not missing, f"events out of order or missing {missing}; got {types}"


def assert_server_events_valid(client: RtcClient) -> None:
    seqs = [e["seq"] for e in client.events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for event in client.events:
        validate_server_event(event)


def test_received_audio_keeps_the_timing_and_joins_the_content():
    """After a sender skipped slots (a stall), ``signal`` shows the hole where it was, ``arrived``
    does not count it, and ``joined`` gives the audio without it."""
    received = ReceivedAudio()
    for offset, value in ((0, 0.1), (960, 0.2), (960 * 12, 0.3)):  # slots 2..11 skipped
        received.chunks.append((offset, np.full(960, value, np.float32), 0.0))
    assert len(received.signal()) == 960 * 13 and not received.signal(1920, 960 * 12).any()
    assert received.arrived() == 3 * 960 and received.arrived(480, 960 * 12 + 480) == 960 + 480 + 480
    assert np.array_equal(received.joined(480, 960 * 12 + 480),
                          np.concatenate([np.full(480, 0.1), np.full(960, 0.2), np.full(480, 0.3)]).astype(np.float32))


async def test_echo_answers_a_spoken_utterance(echo_server, utterance):
    url, _ = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        client.mic.feed(SILENCE)
        client.mic.feed(utterance)
        done = await client.wait_event("response.done", timeout=60)
        assert done["response"]["status"] == "completed"
        # The turn goes back to listening in the same step, as a message of its own after this one.
        await client.wait_event("turn.state", timeout=10, after=client.events.index(done), state="listening")
        types = [e["type"] for e in client.events]
        assert_subsequence(types, [
            "session.created", "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
            "response.created", "turn.state", "output_audio_buffer.started", "output_audio_buffer.stopped",
            "response.done", "turn.state",
        ])
        # The agent is "speaking" for as long as its audio plays, and "listening" only afterwards.
        states = [(client.events.index(e), e["state"]) for e in client.events_of("turn.state")]
        assert [s for _, s in states] == ["speaking", "listening"]
        assert states[1][0] > client.events.index(done)
        assert_server_events_valid(client)
        started = client.events_of("output_audio_buffer.started")[0]
        stopped = client.events_of("output_audio_buffer.stopped")[0]
        assert started["response_id"] == stopped["response_id"] == done["response_id"]
        await client.wait_audio(stopped["sample_offset"])  # the last frames were still in flight
        # The echo is the utterance itself: same length (within VAD padding) and the same content.
        echo = client.received.joined(started["sample_offset"], stopped["sample_offset"])
        assert abs(len(echo) - len(utterance)) < 0.5 * RATE
        assert best_match(echo, through_16k(utterance)) > 0.8
        # And nothing was played before the answer started.
        assert np.max(np.abs(client.received.signal(0, started["sample_offset"] - 960))) < 0.01
    finally:
        await client.close()


async def test_client_cancel_cuts_the_answer_and_no_stale_audio_follows(echo_server, long_utterance):
    url, _ = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        client.mic.feed(SILENCE)
        client.mic.feed(long_utterance)
        started = await client.wait_event("output_audio_buffer.started", timeout=60)
        await client.wait_arrived(started["sample_offset"], RATE)  # a second of the answer has played
        client.send({"type": "response.cancel", "event_id": "c1"})
        cleared = await client.wait_event("output_audio_buffer.cleared", timeout=60)
        done = await client.wait_event("response.done", timeout=60)
        assert done["response"]["status"] == "cancelled"
        assert cleared["epoch"] == 0 and cleared["new_epoch"] == 1
        assert cleared["response_id"] == started["response_id"] == done["response_id"]
        assert client.events.index(cleared) < client.events.index(done)
        cut = cleared["sample_offset"]
        # played_ms is what the stream carried before the cut, at least the second heard above, and
        # the rest of the utterance was discarded.
        assert cleared["played_ms"] >= 900 and cleared["discarded_ms"] > 0
        assert cleared["played_ms"] + cleared["discarded_ms"] < 1000 * len(long_utterance) / RATE + 500
        await client.wait_audio(cut + CODEC_DELAY + 2 * RATE)  # collect what follows the cut
        assert abs(cleared["played_ms"] - 1000 * client.received.arrived(started["sample_offset"], cut) / RATE) < 25

        played = client.received.joined(started["sample_offset"], cut)
        after = client.received.signal(cut + CODEC_DELAY)
        reference = through_16k(long_utterance)
        # Before the cut: the start of the utterance. After it: silence, by content, not only by events.
        assert best_match(played, reference[: len(played)]) > 0.8
        assert len(after) > RATE  # the stream went on (silence frames), so there was time to leak
        assert np.max(np.abs(after)) < 0.01, "audio of the cancelled epoch left the server after the cut"
        assert [e["type"] for e in client.events].count("response.created") == 1
        assert_server_events_valid(client)
    finally:
        await client.close()


async def test_user_barge_in_interrupts_then_the_new_utterance_is_answered(echo_server, long_utterance, interjection):
    url, _ = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        client.mic.feed(SILENCE)
        client.mic.feed(long_utterance)
        first = await client.wait_event("output_audio_buffer.started", timeout=60)
        await client.wait_audio(first["sample_offset"] + RATE * 8 // 10)
        client.mic.feed(interjection)
        cleared = await client.wait_event("output_audio_buffer.cleared", timeout=60)
        cancelled = await client.wait_event("response.done", timeout=60, response_id=first["response_id"])
        assert cancelled["response"]["status"] == "cancelled"
        assert cancelled["response"]["status_details"]["reason"] == "barge_in"
        second = await client.wait_event("output_audio_buffer.started", timeout=60,
                                         after=client.events.index(cleared))
        assert second["epoch"] == 1 and second["response_id"] != first["response_id"]
        await client.wait_event("response.done", timeout=60, response_id=second["response_id"])
        second_stop = await client.wait_event("output_audio_buffer.stopped", timeout=60,
                                              response_id=second["response_id"])
        await client.wait_audio(second_stop["sample_offset"])

        gap = client.received.signal(cleared["sample_offset"] + CODEC_DELAY, second["sample_offset"])
        assert np.max(np.abs(gap)) < 0.01, "old-epoch audio after the cut"
        answer = client.received.joined(second["sample_offset"])
        assert best_match(answer, through_16k(interjection)) > 0.7
        assert_server_events_valid(client)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
        # One barge-in, timed from the user's speech onset to the cut (VAD confirmation included).
        assert "lychee_rtc_barge_in_seconds_count 1.0" in metrics
        total = float(next(l.split()[1] for l in metrics.splitlines() if l.startswith("lychee_rtc_barge_in_seconds_sum")))
        assert total > 0.0  # how long it takes is a benchmark's business (docs/benchmarks.md)
    finally:
        await client.close()


async def test_turn_listen_holds_and_commit_answers_at_once(utterance):
    # A long end-of-speech silence so only commit (or release) can make it answer in time.
    async with running_server(engine={"echo": {"min_silence_ms": 8000}}, session=PATIENT_WINDOWS) as (url, _):
        client = RtcClient(url)
        await client.connect(session={"metrics": True})  # one metrics event per engine window
        try:
            client.send({"type": "turn.listen"})
            await client.wait_event("turn.state", state="held")
            end = client.mic.feed(SILENCE) * RATE + len(SILENCE) + len(utterance)
            client.mic.feed(utterance)
            await client.wait_event("input_audio_buffer.speech_started", timeout=60)
            await client.wait_sent(int(end + RATE // 2))
            client.send({"type": "input_audio_buffer.commit"})
            committed = await client.wait_event("input_audio_buffer.committed")
            # Three engine windows after the commit, and still no answer while held.
            await wait_until(lambda: len(client.events_of("metrics")) >= 3 + sum(
                1 for e in client.events_of("metrics") if e["seq"] < committed["seq"]), what="three windows")
            assert not client.events_of("response.created"), "held session answered"
            client.send({"type": "turn.release"})
            created = await client.wait_event("response.created", timeout=60)
            done = await client.wait_event("response.done", timeout=60, response_id=created["response_id"])
            assert done["response"]["status"] == "completed"

            # Not held: commit answers at once, long before the 8 s end-of-speech silence.
            n = len(client.events)
            end = client.mic.feed(utterance) * RATE + len(utterance)
            await client.wait_event("input_audio_buffer.speech_started", timeout=60, after=n)
            await client.wait_sent(int(end))
            client.send({"type": "input_audio_buffer.commit"})
            committed = await client.wait_event("input_audio_buffer.committed", after=n)
            created = await client.wait_event("response.created", timeout=60, after=n)
            # Counted on the audio clock: within a window or two of the commit, not 20 windows
            # (8 s of silence) later.
            windows = [e for e in client.events_of("metrics") if committed["seq"] < e["seq"] < created["seq"]]
            assert len(windows) <= 2, f"answered {len(windows)} windows after the commit"
            await client.wait_event("response.done", timeout=60, response_id=created["response_id"])
            # Commit with nothing buffered is an error, and the session lives on.
            client.send({"type": "input_audio_buffer.commit", "event_id": "empty"})
            err = await client.wait_event("error", timeout=60)
            assert err["error"]["code"] == "input_audio_buffer_commit_empty"
            assert_server_events_valid(client)
        finally:
            await client.close()


BAD_MESSAGES = [
    ("{oops", "invalid_json"),
    ("[1, 2, 3]", "invalid_event"),
    (json.dumps({"type": 5}), "invalid_event"),
    (json.dumps({"type": "response.explode", "event_id": "e1"}), "unknown_event"),
    (json.dumps({"type": "session.update", "session": {"temperature": "hot"}}), "invalid_event"),
    (json.dumps({"type": "session.update", "session": {"voice": "alloy"}}), "invalid_voice"),
    (json.dumps({"type": "playback.ack", "response_id": "resp_x", "played_ms": -1}), "invalid_event"),
    (json.dumps({"type": "playback.ack", "response_id": "resp_x", "played_ms": 5}), "response_not_found"),
    (json.dumps({"type": "response.cancel"}), "response_cancel_not_active"),
    ("x" * 70000, "message_too_large"),
    ("[" * 30000, "invalid_json"),  # nesting deep enough to blow the parser's recursion limit
]


async def test_malformed_events_get_errors_and_the_session_lives_on(echo_server):
    url, _ = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        await client.wait_event("session.created")
        client.pc.sctp._remote_max_message_size = 0  # send past the advertised a=max-message-size, as a hostile peer would
        for raw, _ in BAD_MESSAGES:
            client.send(raw)
        await wait_until(lambda: len(client.events_of("error")) >= len(BAD_MESSAGES), what="every error")
        codes = [e["error"]["code"] for e in client.events_of("error")]
        assert codes == [code for _, code in BAD_MESSAGES]
        assert client.events_of("error")[3]["error"]["event_id"] == "e1"
        client.send({"type": "session.update", "session": {"metrics": True, "temperature": 0.7}})
        updated = await client.wait_event("session.updated")
        assert updated["session"]["metrics"] is True and updated["session"]["temperature"] == 0.7
        # Instructions are accepted at any time; the echo engine has no system prompt to put them in.
        client.send({"type": "session.update", "session": {"instructions": "be brief"}})
        updated = await client.wait_event("session.updated", after=client.events.index(updated) + 1)
        assert updated["session"]["instructions"] == "be brief" and updated["instructions_effect"] == "unused"
        client.send({"type": "ping", "client_time": 123.5})
        pong = await client.wait_event("pong")
        assert pong["client_time"] == 123.5 and pong["epoch"] == 0
        client.mic.feed(SILENCE)
        metrics = await client.wait_event("metrics", timeout=60)
        assert metrics["deadline_ms"] == 400 and metrics["step_ms"] >= 0
        assert_server_events_valid(client)
    finally:
        await client.close()


async def test_g711_call_echoes(utterance):
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        client = RtcClient(url, codec="PCMU")
        await client.connect()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/v1/sessions/{client.session_id}", headers=client.auth_headers) as resp:
                    assert (await resp.json())["codec"] == "PCMU"
            client.mic.feed(SILENCE)
            client.mic.feed(utterance)
            started = await client.wait_event("output_audio_buffer.started", timeout=60)
            assert started["sample_rate"] == 8000
            await client.wait_event("response.done", timeout=60)
            stopped = await client.wait_event("output_audio_buffer.stopped", timeout=60)
            await client.wait_audio(stopped["sample_offset"] * 6)  # 8 kHz stream positions, 48 kHz received
            echo = client.received.joined(started["sample_offset"] * 6)
            assert best_match(echo, through_16k(utterance)) > 0.7
        finally:
            await client.close()


VANISHING_CLIENT = textwrap.dedent("""
    import asyncio, sys, numpy as np
    from lychee_rtc.bench.client import RtcClient
    async def main():
        c = RtcClient(sys.argv[1])
        await c.connect()
        c.mic.feed(np.zeros(48000 * 60, np.float32))
        print(c.session_id, flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


async def test_a_client_that_vanishes_frees_its_slot():
    async with running_server(session={"max_sessions": 1, "media_timeout_s": 1.5, "resume_window_s": 1.0}) as (url, _):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", VANISHING_CLIENT, url, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            session_id = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
            assert session_id.startswith("sess_")
            async with aiohttp.ClientSession() as http:
                async def listed() -> list[dict]:
                    async with http.get(f"{url}/v1/sessions") as resp:
                        return (await resp.json())["sessions"]

                for _ in range(3000):  # until its first window went to the engine (a minute at most)
                    sessions = await listed()
                    if sessions and sessions[0]["counters"]["window_windows"] >= 1:
                        break
                    await asyncio.sleep(0.02)
                assert [s["session_id"] for s in sessions] == [session_id]
                assert sessions[0]["counters"]["window_windows"] >= 1
                proc.send_signal(signal.SIGKILL)  # no close, no BYE: the peer just disappears
                await proc.wait()
                for _ in range(600):  # media_timeout_s is 1.5 s; a minute on a busy machine at most
                    if not await listed():
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the vanished client's slot was never freed")
                async with http.get(f"{url}/readyz") as resp:
                    assert resp.status == 200
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_flooding_client_is_rate_limited_and_kept(echo_server):
    url, _ = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        await client.wait_event("session.created")
        loop = asyncio.get_running_loop()
        # Flood until the limiter speaks: a busy server reads slowly and refills the bucket as it goes,
        # so the number of messages needed is not fixed; the first 200 (the burst) always pass.
        sent, began = 0, loop.time()
        for _ in range(20):
            for _ in range(600):
                client.send({"type": "ping", "client_time": float(sent)})
                sent += 1
            try:
                await client.wait_event("error", timeout=60)
                break
            except asyncio.TimeoutError:
                pass
        err = await client.wait_event("error", timeout=60)
        assert err["error"]["code"] == "rate_limited"
        # The session lives on: once the bucket refills, a ping is answered again.
        for k in range(1, 121):
            client.send({"type": "ping", "client_time": -float(k)})
            await asyncio.sleep(0.5)
            if any(e["type"] == "pong" and e["client_time"] < 0 for e in client.events):
                break
        else:
            raise AssertionError("no pong after the flood")
        pong = next(e for e in client.events if e["type"] == "pong" and e["client_time"] < 0)
        assert pong["epoch"] == 0
        pongs = [e for e in client.events_of("pong") if e["client_time"] >= 0]
        assert 200 <= len(pongs) < sent, "the burst passes, the flood does not"
        # Errors are themselves limited, to one a second (however long this took on this machine).
        assert len(client.events_of("error")) <= loop.time() - began + 1
    finally:
        await client.close()
