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
import base64
import json
import logging
import os
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import PATIENT_WINDOWS, running_server, synthesize, wait_until

from lychee_rtc.server.app import REGISTRY_KEY
from realtime_ws_support import RATE, chunks, echo_similarity, from_pcm16, resample, to_pcm16
from strict import unavailable
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
    second = from_pcm16(bytes(audio[answers[-1]]))
    assert len(second) > 0.7 * len(over) and echo_similarity(over, second) > 0.7
    assert echo_similarity(question, from_pcm16(bytes(audio[first]))[:len(question)]) > 0.5
    assert_ga_events_valid(raw)


# --- frameworks in virtual environments of their own ---------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
DRIVERS = ROOT / "tests" / "clients"
# Where `make install-test` makes them (one folder per framework); CLIENT_VENVS points elsewhere.
CLIENT_VENVS = Path(os.environ.get("CLIENT_VENVS", ROOT / ".venv-clients"))


def client_python(name: str) -> str:
    python = CLIENT_VENVS / name / "bin" / "python"
    if not python.exists():
        unavailable(f"no {name} environment at {python.parent.parent}: `make install-test` makes it "
                    f"(tests/clients/requirements-{name}.txt)")
    return str(python)


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> str:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(to_pcm16(samples))
    return str(path)


async def run_driver(python: str, script: str, args: list[str], out: Path, timeout: float = 240.0) -> dict:
    """Run a framework's driver to its end; what it wrote."""
    proc = await asyncio.create_subprocess_exec(python, str(DRIVERS / script), *args, "--out", str(out),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        output, _ = await proc.communicate()
        pytest.fail(f"{script} did not finish in {timeout:.0f} s:\n{output.decode(errors='replace')[-4000:]}")
    assert proc.returncode == 0 and out.exists(), output.decode(errors="replace")[-4000:]
    result = json.loads(out.read_text())
    result["log"] = output.decode(errors="replace")
    return result


def spoken(tmp_path: Path) -> tuple[np.ndarray, np.ndarray, str, str]:
    question = synthesize(QUESTION, rate=16000)
    over = synthesize(INTERJECTION, rate=16000, voice="en+f3")
    return (question, over, write_wav(tmp_path / "question.wav", question),
            write_wav(tmp_path / "interjection.wav", over))


async def test_pipecat_converses_and_is_interrupted(tmp_path):
    python = client_python("pipecat")
    question, over, question_wav, over_wav = spoken(tmp_path)
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        result = await run_driver(python, "pipecat_driver.py", [
            "--url", f"{url.replace('http', 'ws')}/v1/realtime",  # Pipecat takes the full socket URL
            "--question", question_wav, "--interjection", over_wav], tmp_path / "pipecat.json")
        await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the slot to be freed")
    assert result["outcome"] == [] and result["errors"] == [], result["log"][-3000:]
    answers = [from_pcm16(base64.b64decode(a)) for a in result["answers"]]
    assert len(answers) == 2, result["kinds"]
    kinds = result["kinds"]
    # Pipecat heard the barge-in (the server's speech_started) and ended both answers.
    assert kinds.count("ProposedUserStartedSpeakingFrame") == 2 and kinds.count("LLMFullResponseEndFrame") == 2
    assert echo_similarity(resample_to(question), answers[0][:len(resample_to(question))]) > 0.5
    assert len(answers[1]) > 0.7 * len(resample_to(over)) and echo_similarity(resample_to(over), answers[1]) > 0.7


async def test_livekit_agents_converses_and_is_interrupted(tmp_path):
    python = client_python("livekit")
    question, over, question_wav, over_wav = spoken(tmp_path)
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        result = await run_driver(python, "livekit_driver.py", [
            "--url", f"{url}/v1", "--question", question_wav, "--interjection", over_wav], tmp_path / "livekit.json")
        await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the slot to be freed")
    assert result["outcome"] == "ok" and result["problems"] == [], result["log"][-3000:]
    raw = result["raw"]
    assert not [e for e in raw if e["type"] == "error"]
    first, second = result["segments"][0], result["segments"][-1]
    # The first answer was cut where the user spoke: LiveKit cleared its playback and told the
    # server how far it had played; the answer to the interjection played out.
    assert first["interrupted"] is True and second["interrupted"] is False
    truncated = next(e for e in raw if e["type"] == "conversation.item.truncated")
    assert abs(truncated["audio_end_ms"] - 1000 * first["played_bytes"] / 2 / RATE) < 100
    cut = next(e for e in raw if e["type"] == "response.done")
    assert cut["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    heard_first = from_pcm16(base64.b64decode(first["captured"]))
    heard_second = from_pcm16(base64.b64decode(second["captured"]))
    assert echo_similarity(resample_to(question), heard_first[:len(resample_to(question))]) > 0.5
    assert len(heard_second) > 0.7 * len(resample_to(over)) and echo_similarity(resample_to(over), heard_second) > 0.7
    done_at = raw.index(cut)
    assert not [e for e in raw[done_at:] if e["type"] == "response.output_audio.delta"
                and e["response_id"] == cut["response"]["id"]]
    assert_ga_events_valid(raw)


def resample_to(samples: np.ndarray) -> np.ndarray:
    return resample(samples, 16000, RATE)


# --- LiveKit with lychee-rtc as a full-duplex model (integrations/livekit) ----------------------------


async def livekit_duplex(tmp_path: Path, **session: Any) -> tuple[dict, np.ndarray, np.ndarray]:
    python = client_python("livekit")
    question, over, question_wav, over_wav = spoken(tmp_path)
    async with running_server(session={**PATIENT_WINDOWS, **session}) as (url, app):
        result = await run_driver(python, "livekit_driver.py", [
            "--url", url, "--question", question_wav, "--interjection", over_wav, "--mode", "duplex",
            "--integration", str(ROOT / "integrations" / "livekit"), "--interject-after-s", "1"],
            tmp_path / "livekit-duplex.json")
        await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the slot to be freed")
    assert result["outcome"] == "ok" and result["problems"] == [], result["log"][-3000:]
    assert not [e for e in result["raw"] if e["type"] == "error"]
    return result, resample_to(question), resample_to(over)


async def test_livekit_runs_lychee_as_a_full_duplex_model_that_yields_by_itself(tmp_path):
    """The model (here the echo engine's barge-in) cuts its answer; LiveKit neither cancels nor
    truncates anything itself, and stops playing the answer where the model stopped it."""
    result, question, over = await livekit_duplex(tmp_path)
    raw = result["raw"]
    cut = next(e for e in raw if e["type"] == "response.done")
    assert cut["response"]["status_details"] == {"type": "cancelled", "reason": "barge_in"}  # the model's own
    assert "conversation.item.truncated" not in [e["type"] for e in raw]  # the client truncated nothing
    first, second = result["segments"][0], result["segments"][-1]
    sent_first = sum(len(base64.b64decode(e["delta"])) for e in raw if e["type"] == "response.output_audio.delta"
                     and e["response_id"] == cut["response"]["id"])
    heard_first = from_pcm16(base64.b64decode(first["captured"]))
    # What played of the first answer is what the server sent of it before the cut, and it is
    # far short of the whole answer: the rest was never said.
    assert first["played_bytes"] <= sent_first and len(heard_first) < 0.6 * len(question)
    assert echo_similarity(question[:len(heard_first)], heard_first) > 0.5
    heard_second = from_pcm16(base64.b64decode(second["captured"]))
    assert len(heard_second) > 0.7 * len(over) and echo_similarity(over, heard_second) > 0.7


async def test_livekit_with_the_full_duplex_model_keeps_talking_over_the_user_when_the_model_does(tmp_path):
    """Overlapping speech: without server barge-in the model goes on while the user talks (the
    echo engine turns to the newer utterance only once it has ended), and LiveKit plays it on,
    as a full-duplex model means it; then the answer to the interjection, as a generation of its own."""
    result, question, over = await livekit_duplex(tmp_path, vad_barge_in=False)
    first, second = result["segments"][0], result["segments"][-1]
    heard_first = from_pcm16(base64.b64decode(first["captured"]))
    assert first["interrupted"] is False and first["played_bytes"] == len(base64.b64decode(first["captured"]))
    # It played on through the whole interjection, said after its first second.
    assert len(heard_first) > RATE * 1.0 + 0.8 * len(over)
    assert echo_similarity(question[:len(heard_first)], heard_first) > 0.8
    dones = [e for e in result["raw"] if e["type"] == "response.done"]
    assert dones[0]["response"]["status_details"]["reason"] == "new_response"
    heard_second = from_pcm16(base64.b64decode(second["captured"]))
    assert len(heard_second) > 0.7 * len(over) and echo_similarity(over, heard_second) > 0.7
