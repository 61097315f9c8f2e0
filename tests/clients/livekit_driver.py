"""LiveKit Agents' ``AgentSession`` with its OpenAI realtime model, against a lychee-rtc server.

Runs in LiveKit's own virtual environment (tests/clients/requirements-livekit.txt), started by
tests/test_realtime_frameworks.py. No room and no LiveKit server: the session's audio input is a
microphone that says a question in real time (20 ms frames at 16 kHz) and talks over the answer;
its audio output is a loudspeaker that plays what it is given in real time and reports playback as
LiveKit's room output does (started, finished or interrupted, and where). Writes what was heard
and seen as JSON. ``--mode duplex`` uses lychee-rtc's LiveKit integration instead of the plain
``RealtimeModel`` (full duplex inside the framework).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import sys
import time
import wave

from livekit import rtc
from livekit.agents import Agent, AgentSession
from livekit.agents.voice import io
from livekit.plugins.openai import realtime
from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad

RATE = 16000
OUT_RATE = 24000
FRAME = RATE // 50  # 20 ms
PLAY_FRAME = OUT_RATE // 50


def read_wav(path: str) -> bytes:
    with wave.open(path) as w:
        assert w.getframerate() == RATE and w.getsampwidth() == 2 and w.getnchannels() == 1
        return w.readframes(w.getnframes())


class Microphone(io.AudioInput):
    """Frames said in real time; silence between what is said, as a live microphone sends."""

    def __init__(self) -> None:
        super().__init__(label="test-microphone")
        self._pending = bytearray()
        self._next = 0.0

    def say(self, pcm: bytes) -> None:
        self._pending.extend(pcm)

    async def __anext__(self) -> rtc.AudioFrame:
        now = time.monotonic()
        self._next = max(self._next + FRAME / RATE, now) if self._next else now
        await asyncio.sleep(max(0.0, self._next - now))
        chunk = bytes(self._pending[:FRAME * 2]).ljust(FRAME * 2, b"\0")
        del self._pending[:FRAME * 2]
        return rtc.AudioFrame(data=chunk, sample_rate=RATE, num_channels=1, samples_per_channel=FRAME)

    @property
    def idle(self) -> bool:
        return not self._pending


class Loudspeaker(io.AudioOutput):
    """Plays captured audio in real time, segment by segment, and reports it as a sink must."""

    def __init__(self) -> None:
        super().__init__(label="test-loudspeaker", capabilities=io.AudioOutputCapabilities(pause=False),
                         sample_rate=OUT_RATE)
        self.segments: list[dict] = []  # what each segment got, what of it played, and how it ended
        self._queue = bytearray()
        self._segment: dict | None = None
        self._flushed = False
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._play())

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._segment is None:
            self._segment = {"captured": bytearray(), "played": 0, "interrupted": None, "started": False}
            self.segments.append(self._segment)
            self._flushed = False
        self._segment["captured"].extend(bytes(frame.data))
        self._queue.extend(bytes(frame.data))
        self._wake.set()

    def flush(self) -> None:
        super().flush()
        self._flushed = True
        self._wake.set()

    def clear_buffer(self) -> None:
        self._queue.clear()
        if self._segment is not None:
            self._finish(interrupted=True)

    def _finish(self, interrupted: bool) -> None:
        segment, self._segment = self._segment, None
        segment["interrupted"] = interrupted
        self.on_playback_finished(playback_position=segment["played"] / OUT_RATE / 2, interrupted=interrupted)

    async def _play(self) -> None:
        while True:
            if self._segment is None or (not self._queue and not self._flushed):
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._queue:  # flushed and all played
                self._finish(interrupted=False)
                continue
            if not self._segment["started"]:
                self._segment["started"] = True
                self.on_playback_started(created_at=time.time())
            take = bytes(self._queue[:PLAY_FRAME * 2])
            del self._queue[:PLAY_FRAME * 2]
            self._segment["played"] += len(take)
            await asyncio.sleep(len(take) / 2 / OUT_RATE)


async def wait_for(condition, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


def model_for(args: argparse.Namespace):
    if args.mode == "duplex":
        sys.path.insert(0, args.integration)
        from lychee_livekit import LycheeDuplexModel  # lychee-rtc's integration, as a user installs it

        return LycheeDuplexModel(base_url=args.url, api_key="local")
    return realtime.RealtimeModel(base_url=args.url, api_key="local", model="lychee-fd",
                                  turn_detection=ServerVad(type="server_vad", create_response=True,
                                                           interrupt_response=True),
                                  input_audio_transcription=None)


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="http://host:port/v1")
    parser.add_argument("--question", required=True)
    parser.add_argument("--interjection", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("openai", "duplex"), default="openai")
    parser.add_argument("--integration", default="", help="folder of lychee_livekit.py (duplex mode)")
    parser.add_argument("--interject-after-s", type=float, default=4.0,
                        help="how much of the first answer plays before the user talks over it")
    args = parser.parse_args()

    problems: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            problems.append(f"{record.name}: {record.getMessage()}")

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger().addHandler(Collect(level=logging.ERROR))

    mic, speaker = Microphone(), Loudspeaker()
    model = model_for(args)
    # The loudspeaker cannot pause, so a false interruption cannot be resumed (LiveKit warns otherwise).
    options = {"resume_false_interruption": False}
    if args.mode == "duplex":  # a full-duplex model must hear the user while it speaks (no AEC warm-up)
        options["aec_warmup_duration"] = None
    session = AgentSession(llm=model, **options)
    session.input.audio = mic
    session.output.audio = speaker
    agent = Agent(instructions="Answer briefly.")
    raw: list[dict] = []
    states: list[str] = []
    session.on("agent_state_changed", lambda ev: states.append(f"agent:{ev.new_state}"))
    session.on("user_state_changed", lambda ev: states.append(f"user:{ev.new_state}"))
    session.on("error", lambda ev: problems.append(f"session error: {ev.error}"))
    outcome = "ok"
    try:
        await session.start(agent=agent)
        if args.mode == "duplex":
            agent.duplex_session.event_listeners.append(raw.append)
        else:
            agent.realtime_llm_session.on("openai_server_event_received", raw.append)
        mic.say(read_wav(args.question))
        # LiveKit hears nothing of the user for its AEC warm-up (3 s) after the agent starts
        # speaking, unless it is turned off: the interjection comes later than that.
        await wait_for(lambda: speaker.segments and speaker.segments[0]["played"] > args.interject_after_s * OUT_RATE * 2,
                       60, "the first answer to play")
        mic.say(read_wav(args.interjection))
        await wait_for(lambda: mic.idle, 30, "the interjection to be said")
        said = len(speaker.segments)
        await wait_for(lambda: len(speaker.segments) > said and speaker.segments[-1]["interrupted"] is False, 90,
                       "the answer to the interjection to play out")
    except Exception as exc:  # reported, and what was seen so far is still written
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        await session.aclose()
        await model.aclose()
    with open(args.out, "w") as out:
        json.dump({"outcome": outcome, "problems": problems, "states": states, "raw": raw,
                   "segments": [{"captured": base64.b64encode(bytes(s["captured"])).decode(),
                                 "played_bytes": s["played"], "interrupted": s["interrupted"]}
                                for s in speaker.segments]}, out)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
