"""Pipecat's OpenAI realtime service in a headless pipeline, against a lychee-rtc server.

Runs in Pipecat's own virtual environment (tests/clients/requirements-pipecat.txt), started by
tests/test_realtime_frameworks.py: it says a question in real time (20 ms frames at 16 kHz, which
Pipecat resamples to 24 kHz), talks over the answer, and writes what it heard and saw as JSON.
Nothing here is lychee-rtc's: only Pipecat's public classes, configured as its documentation says.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import wave

from loguru import logger
from pipecat.frames.frames import (EndFrame, ErrorFrame, Frame, InputAudioRawFrame, TTSAudioRawFrame,
                                   TTSStartedFrame, TTSStoppedFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime.events import AudioConfiguration, AudioInput, SessionProperties, TurnDetection
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

RATE = 16000
FRAME = RATE // 50  # 20 ms, what Pipecat's local transport sends


def read_wav(path: str) -> bytes:
    with wave.open(path) as w:
        assert w.getframerate() == RATE and w.getsampwidth() == 2 and w.getnchannels() == 1
        return w.readframes(w.getnframes())


class Listener(FrameProcessor):
    """Keeps every frame's type and the answers' audio (TTS started .. stopped)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []
        self.answers: list[bytearray] = []
        self.speaking = False

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self.kinds.append(type(frame).__name__)
        if isinstance(frame, TTSStartedFrame):
            self.speaking = True
            self.answers.append(bytearray())
        elif isinstance(frame, TTSStoppedFrame):
            self.speaking = False
        elif isinstance(frame, TTSAudioRawFrame):
            assert frame.sample_rate == 24000
            if not self.answers:
                self.answers.append(bytearray())
            self.answers[-1].extend(frame.audio)
        await self.push_frame(frame, direction)


async def wait_for(condition, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="ws://host:port/v1/realtime")
    parser.add_argument("--question", required=True)
    parser.add_argument("--interjection", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    errors: list[str] = []
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    logger.add(lambda message: errors.append(str(message)), level="ERROR")

    llm = OpenAIRealtimeLLMService(
        api_key="local", base_url=args.url,
        settings=OpenAIRealtimeLLMService.Settings(
            model="lychee-fd",
            session_properties=SessionProperties(
                output_modalities=["audio"], audio=AudioConfiguration(input=AudioInput(turn_detection=TurnDetection())))))
    listener = Listener()
    worker = PipelineWorker(Pipeline([llm, listener]), cancel_on_idle_timeout=False)
    started = asyncio.Event()
    upstream: list[str] = []

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker, frame):
        started.set()

    @worker.event_handler("on_frame_reached_upstream")
    async def on_upstream(worker, frame):
        upstream.append(type(frame).__name__)
        if isinstance(frame, ErrorFrame):
            errors.append(f"ErrorFrame: {frame.error}")

    async def say(pcm: bytes) -> None:
        for i in range(0, len(pcm), FRAME * 2):
            await worker.queue_frame(InputAudioRawFrame(audio=pcm[i:i + FRAME * 2], sample_rate=RATE, num_channels=1))
            await asyncio.sleep(FRAME / RATE)

    async def converse() -> None:
        try:
            await asyncio.wait_for(started.wait(), 30)
            await say(read_wav(args.question) + bytes(2 * RATE * 2))
            await wait_for(lambda: listener.answers and len(listener.answers[0]) > 24000, 60, "the first answer")
            await say(read_wav(args.interjection) + bytes(3 * RATE * 2))
            await wait_for(lambda: len(listener.answers) >= 2 and not listener.speaking, 60, "the second answer")
        finally:
            await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    outcome = await asyncio.gather(runner.run(), converse(), return_exceptions=True)
    with open(args.out, "w") as out:
        json.dump({"answers": [base64.b64encode(bytes(a)).decode() for a in listener.answers],
                   "kinds": listener.kinds, "upstream": upstream, "errors": errors,
                   "outcome": [repr(o) for o in outcome if isinstance(o, BaseException)]}, out)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
