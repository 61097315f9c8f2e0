"""The realtime WebSocket with the agent frameworks people use, installed from the registry and
unmodified: the OpenAI Agents SDK (``RealtimeRunner``, in the ``test`` extra), Pipecat's and LiveKit
Agents' OpenAI realtime services (each in a virtual environment of its own, made by the test set-up:
their pins conflict with this project's, see docs/testing.md), each pointed at this server with its
documented option. Each holds a spoken conversation with the echo engine and hears its answer (the
answer correlates with what it said), is interrupted by speech over the answer, and logs no
validation error or ``error`` event.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from conftest import PATIENT_WINDOWS, running_server, synthesize, wait_until

from lychee_rtc.server.app import REGISTRY_KEY
from realtime_ws_support import RATE, chunks, echo_similarity, from_pcm16, to_pcm16
from test_openai_realtime import assert_ga_events_valid

QUESTION = ("The quick brown fox jumps over the lazy dog, and then it runs far away across the green hills "
            "towards the river, where it rests until the evening comes.")
INTERJECTION = "Wait, stop, stop please, I have a question for you."


def speech_pcm(text: str, voice: str = "en") -> tuple[np.ndarray, bytes]:
    speech = synthesize(text, rate=RATE, voice=voice)
    return speech, to_pcm16(speech)


# --- the OpenAI Agents SDK ---------------------------------------------------------------------------


async def test_the_openai_agents_sdk_converses_and_is_interrupted(caplog):
    from agents.realtime import RealtimeAgent, RealtimeRunner

    caplog.set_level(logging.WARNING, logger="openai.agents")
    question, question_pcm = speech_pcm(QUESTION)
    over, over_pcm = speech_pcm(INTERJECTION, "en+f3")
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        runner = RealtimeRunner(RealtimeAgent(name="lychee", instructions="Answer briefly."),
                                config={"tracing_disabled": True})
        session = await runner.run(model_config={
            "url": f"{url.replace('http', 'ws')}/v1/realtime?model=gpt-realtime-2.1",  # used verbatim
            "api_key": "local",
        })
        raw: list[dict] = []
        kinds: list[str] = []
        audio: dict[str, bytearray] = {}
        answers: list[str] = []  # items whose audio ended, in order

        async def say(pcm: bytes) -> None:
            for piece in chunks(pcm, 40):  # the SDK's own CLI sends 40 ms
                await session.send_audio(piece)
                await asyncio.sleep(0.04)

        async def listen() -> None:
            async for event in session:
                kinds.append(event.type)
                if event.type == "raw_model_event" and event.data.type == "raw_server_event":
                    raw.append(event.data.data)
                elif event.type == "audio":
                    audio.setdefault(event.item_id, bytearray()).extend(event.audio.data)
                elif event.type == "audio_end":
                    answers.append(event.item_id)

        async with session:
            reader = asyncio.ensure_future(listen())
            await say(question_pcm + bytes(RATE * 2))
            await wait_until(lambda: audio, 60, "the answer's audio")
            first = next(iter(audio))
            await say(over_pcm + bytes(3 * RATE * 2))  # talk over the answer
            await wait_until(lambda: len(answers) >= 2 or (answers and answers[-1] != first), 60,
                             "the answer to the interjection")
            reader.cancel()
        await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the slot to be freed")

    assert "audio_interrupted" in kinds and "error" not in kinds
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    types = [e["type"] for e in raw]
    # The SDK saw the barge-in while the answer was live, and told the server how much it played.
    cut = next(e for e in raw if e["type"] == "response.done")
    assert cut["response"]["status_details"]["reason"] == "turn_detected"
    assert types.index("input_audio_buffer.speech_started", types.index("response.created")) < raw.index(cut)
    assert "conversation.item.truncated" in types and "error" not in types
    second = answers[-1]
    assert echo_similarity(over, from_pcm16(bytes(audio[second]))) > 0.7
    assert echo_similarity(question, from_pcm16(bytes(audio[first]))[:len(question)]) > 0.5
    assert_ga_events_valid(raw)
