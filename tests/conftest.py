"""Shared fixtures (synthesised speech, a real server on a loopback port) and the CI skip rule."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import io
import shutil
import socket
import subprocess
import wave
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np
import pytest
from aiohttp import web

from log_guard import guard_logs  # noqa: F401 (autouse: every test's log is checked)
from strict import CUDA_REASON_PREFIX, allowed_in_ci, in_ci

from lychee_rtc.config import load_settings
from lychee_rtc.pcm import PcmResampler
from lychee_rtc.server.app import create_app
from lychee_rtc.server.lifecycle import HANDLER_DRAIN_S


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allowed_logs(*patterns): log lines this test causes on purpose "
                            "(regular expressions; tests/log_guard.py fails a test on any other error)")


# --- no passing by skipping (tests/strict.py) -----------------------------------------------------

_SKIPS: list[tuple[str, str]] = []  # (test or collector, reason) of every skip in this run


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a module that skipped itself (pytest.skip at import, importorskip)
        _SKIPS.append((report.nodeid, _skip_reason(report)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, _skip_reason(report)))


def _forbidden_skips() -> list[tuple[str, str]]:
    return [(node, reason) for node, reason in _SKIPS if not allowed_in_ci(reason)] if in_ci() else []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI a skip other than a CUDA-only one fails the run: the suite cannot pass by skipping."""
    if _forbidden_skips() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    forbidden = _forbidden_skips()
    if forbidden:
        terminalreporter.section("skips not allowed under CI", sep="=", red=True, bold=True)
        for node, reason in forbidden:
            terminalreporter.line(f"{node}: {reason}", red=True)
        terminalreporter.line(f"{len(forbidden)} test(s) skipped under CI=true for a reason other than "
                              f"one starting with {CUDA_REASON_PREFIX!r}: the run fails", red=True)


# --- speech -----------------------------------------------------------------------------------------

SPEECH_DIR = Path(__file__).resolve().parent / "fixtures" / "speech"


def speech_fixture(text: str, voice: str = "en") -> Path:
    """The WAV of ``text`` spoken by espeak-ng, kept in the repository so tests need no synthesizer.

    A new sentence is synthesised once (espeak-ng must be installed then) and written next to the
    others; commit it with the test that uses it.
    """
    key = hashlib.sha1(f"{voice}\n{text}".encode()).hexdigest()[:12]
    path = SPEECH_DIR / f"{key}.wav"
    if path.exists():
        return path
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.fail(f"no speech fixture for {text!r} ({path.name}); install espeak-ng once to create it")
    wav = subprocess.run([exe, "-v", voice, "-s", "160", "--stdout", text], capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        src_rate = w.getframerate()
    SPEECH_DIR.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(src_rate)
        # espeak-ng streams its WAV with an unknown length in the header; the data starts at byte 44.
        out.writeframes(wav[44:])
    (SPEECH_DIR / "index.txt").open("a").write(f"{path.name}\t{voice}\t{text}\n")
    return path


def synthesize(text: str, rate: int = 48000, voice: str = "en") -> np.ndarray:
    """Speech (see ``speech_fixture``), resampled to ``rate`` mono float32."""
    with wave.open(str(speech_fixture(text, voice))) as w:
        src_rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    r = PcmResampler(src_rate, rate)
    return np.concatenate([r.process(pcm), r.flush()])


@pytest.fixture(scope="session")
def utterance() -> np.ndarray:
    return synthesize("Hello there. This is a test of the echo engine, one two three.")


@pytest.fixture(scope="session")
def long_utterance() -> np.ndarray:
    return synthesize("The quick brown fox jumps over the lazy dog, and then it runs far away "
                      "across the green hills towards the river, where it rests until the evening comes.")


@pytest.fixture(scope="session")
def interjection() -> np.ndarray:
    return synthesize("Wait, stop, stop please, I have a question for you.", voice="en+f3")


async def wait_until(condition: Callable[[], Any], timeout: float = 60.0, what: str = "the condition") -> Any:
    """Poll ``condition`` until it returns something truthy (returned); fail after ``timeout`` s.

    ``condition`` may return an awaitable (a probe that does I/O), which is awaited each time.
    Tests wait for what they need to have happened, never for a fixed time: on a busy machine
    everything takes longer, and the deadline is only there to end a test that hangs.
    """
    async def check() -> Any:
        result = condition()
        return await result if inspect.isawaitable(result) else result

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (result := await check()):
        if loop.time() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(0.02)
    return result


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """PyTorch on one thread for a module's tests: tiny matmuls on a shared machine run far faster
    single-threaded than fighting other work for every core."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """A bare aiohttp ``app`` served on a free local port: its base URL, until the block ends."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def running_server(config: str = "configs/echo.yaml", **overrides: Any) -> AsyncIterator[tuple[str, web.Application]]:
    port = free_port()
    merged: dict[str, Any] = {"server": {"port": port}}
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    settings = load_settings(config, environ={}, overrides=merged)
    app = create_app(settings)
    runner = web.AppRunner(app, shutdown_timeout=HANDLER_DRAIN_S)  # as `lychee-rtc serve` runs it
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


# Tests that compare what came back with what was said check the pipeline, not whether this
# machine keeps real time: a window waits up to 2 s (the most the setting allows) for late uplink
# audio, so a busy machine's late packets are not cut away as a live server would cut them.
PATIENT_WINDOWS = {"window_grace_ms": 2000}


@pytest.fixture
async def echo_server() -> AsyncIterator[tuple[str, web.Application]]:
    async with running_server(session=PATIENT_WINDOWS) as server:
        yield server
