"""``lychee-rtc bench websocket``: the realtime WebSocket beside WebRTC, in one run.

Each part spawns its own server (``--config``-style profiles: loopback, echo, a tiny Lychee-FD) and
measures, side by side where both transports apply:

* ``transport``: the round trip of audio through the loopback engine: for the socket, from an
  append (20 ms, sent in real time) to the delta that carries its end; for WebRTC, mouth-to-ear
  of chirps (``bench latency``'s method). Milliseconds, p50 / p90.
* ``answer``: end of the user's speech to the first answer audio, echo engine (its VAD waits
  ``engine.echo.min_silence_ms`` of silence): the socket client streams on (silence) or stops after
  its last append; the WebRTC caller's microphone sends silence. Milliseconds, median of runs.
* ``cpu``: N sessions talking at once (an utterance, then silence, in real time) for a while:
  server CPU seconds per session-second, both transports.
* ``capacity``: the largest N of concurrent loopback sessions whose transport p90 stays within
  ``--budget-ms`` (the socket; WebRTC's is ``bench load``).
* ``throughput``: a file sent at once (``--file-s`` seconds of speech and silence) to the echo and
  the tiny Lychee-FD engines: audio seconds the session heard per wall second, and server CPU
  seconds per audio second.
* ``vllm``: vLLM-Omni's own ``DuplexClient`` and ``EventCollector`` against the echo engine over
  ``/v1/duplex``: ttfp (``response.created`` to the first audio) and RTF (``response.created`` to the
  last audio, over the audio's duration), as vLLM-Omni defines them, per turn; and the stream
  variants, from the start of the input. Needs the package's folder (``--vllm-omni``).

Clients run in this process, beside the server's on the same machine: on a busy or small machine
the client side competes too, which is why CPU is reported as CPU time, not wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from lychee_rtc.bench import load as webrtc_load
from lychee_rtc.bench.telephony import read_wav
from lychee_rtc.bench.client import RtcClient
from lychee_rtc.bench.probes import percentile
from lychee_rtc.bench.server_process import cpu_seconds, spawned_server
from lychee_rtc.bench.ws_client import RATE, SocketClient, pcm16

SPEECH = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "speech"
QUESTION, SHORT = "fb16d488a14d.wav", "c8e5ba25e6e5.wav"
PARTS = ("transport", "answer", "cpu", "capacity", "throughput", "vllm")


def _env(sessions: int) -> dict[str, str]:
    return {"LYCHEE_RTC_SESSION__MAX_SESSIONS": str(sessions), "LYCHEE_RTC_SESSION__WINDOW_GRACE_MS": "120"}


def _p(values: list[float], q: float) -> float | None:
    found = percentile(values, q)
    return None if found is None else round(found, 1)


# --- transport: the loopback engine's round trip --------------------------------------------------------


async def socket_round_trips(url: str, seconds: float) -> list[float]:
    """Per 20 ms append: when the delta carrying its last sample arrived, minus when it was sent."""
    client = await SocketClient.open(url)
    try:
        noise = (0.05 * np.random.default_rng(0).standard_normal(int(seconds * RATE))).astype(np.float32)
        sent = await client.stream(pcm16(noise), 20)
        await asyncio.sleep(1.0)
    finally:
        await client.close()
    deltas = client.record.deltas
    out = []
    for at, end in sent:
        back = next((d.arrived for d in deltas if d.start + d.samples >= end), None)
        if back is not None:
            out.append(1000.0 * (back - at))
    return out[int(0.1 * len(out)):]  # the first appends meet a cold server


async def transport(args: argparse.Namespace) -> dict[str, Any]:
    async with spawned_server("loopback", _env(4)) as (url, _pid):
        socket = await socket_round_trips(url, args.seconds)
    async with spawned_server("loopback", _env(4)) as (url, pid):
        from lychee_rtc.bench.latency import measure
        report = await measure(url, probes=max(10, int(args.seconds * 2)), interval_s=0.5, loss=0.0, jitter_ms=0.0,
                               lossy_s=0.0, settle_s=0.0, codec=None, seed=0, server_pid=pid)
    webrtc = report.phases[0]
    return {"socket_ms": {"p50": _p(socket, 50), "p90": _p(socket, 90), "n": len(socket)},
            "webrtc_ms": {"p50": webrtc.p50_ms, "p90": webrtc.p90_ms, "n": webrtc.found}}


# --- answer: end of speech to the first answer audio (echo) -------------------------------------------------


async def socket_answer(url: str, speech: np.ndarray, keep_streaming: bool) -> float | None:
    client = await SocketClient.open(url)
    try:
        sent = await client.stream(pcm16(speech), 20)
        spoke_until = sent[-1][0]
        if keep_streaming:  # a framework's microphone goes on with silence
            feeder = asyncio.ensure_future(client.stream(bytes(4 * RATE * 2), 20))
        deadline = time.monotonic() + 30
        while client.record.first_audio_after(spoke_until) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if keep_streaming:
            feeder.cancel()
        first = client.record.first_audio_after(spoke_until)
        return None if first is None else 1000.0 * (first - spoke_until)
    finally:
        await client.close()


async def webrtc_answer(url: str, speech16k: np.ndarray) -> float | None:
    client = RtcClient(url)
    await client.connect()
    try:
        await client.wait_event("session.created", timeout=30)
        start = client.mic.feed(speech16k * 1.0)
        client.mic.feed(np.zeros(RATE * 4, np.float32))
        from lychee_rtc.bench.client import RATE as MIC_RATE
        last = int(start * MIC_RATE) + len(speech16k) - 1
        started = await client.wait_event("output_audio_buffer.started", timeout=30)
        frame = last // client.mic.frame
        spoke_until = client.mic.send_times.get(frame)
        heard = client.event_times[client.events.index(started)]
        return None if spoke_until is None else 1000.0 * (heard - spoke_until)
    finally:
        await client.close()


async def answer(args: argparse.Namespace, speech: np.ndarray) -> dict[str, Any]:
    from lychee_rtc.bench.client import RATE as MIC_RATE
    from lychee_rtc.pcm import PcmResampler

    r = PcmResampler(RATE, MIC_RATE)
    speech_mic = np.concatenate([r.process(speech), r.flush()])
    results: dict[str, list[float]] = {"socket_streaming": [], "socket_stopped": [], "webrtc": []}
    async with spawned_server("echo", _env(2)) as (url, _pid):
        for _ in range(args.runs):
            for name, keep in (("socket_streaming", True), ("socket_stopped", False)):
                if (ms := await socket_answer(url, speech, keep)) is not None:
                    results[name].append(ms)
            if (ms := await webrtc_answer(url, speech_mic)) is not None:
                results["webrtc"].append(ms)
    return {k: {"median_ms": _p(v, 50), "runs": len(v)} for k, v in results.items()}


# --- cpu per session, both transports ---------------------------------------------------------------------------


async def _talk_socket(url: str, turn: np.ndarray, seconds: float) -> None:
    client = await SocketClient.open(url)
    try:
        reps = int(np.ceil(seconds * RATE / len(turn)))
        await client.stream(pcm16(np.tile(turn, reps)[:int(seconds * RATE)]), 40)
    finally:
        await client.close()


async def _talk_webrtc(url: str, turn16k: np.ndarray, seconds: float) -> None:
    client = RtcClient(url)
    await client.connect()
    try:
        client.mic.feed(np.tile(turn16k, int(np.ceil(seconds * 48000 / len(turn16k))))[:int(seconds * 48000)])
        await asyncio.sleep(seconds)
    finally:
        await client.close()


async def cpu(args: argparse.Namespace, speech: np.ndarray) -> dict[str, Any]:
    from lychee_rtc.pcm import PcmResampler

    turn = np.concatenate([speech, np.zeros(3 * RATE, np.float32)])
    r = PcmResampler(RATE, 48000)
    turn_mic = np.concatenate([r.process(turn), r.flush()])
    out: dict[str, Any] = {}
    for name, talk, audio in (("socket", _talk_socket, turn), ("webrtc", _talk_webrtc, turn_mic)):
        async with spawned_server("echo", _env(args.sessions)) as (url, pid):
            cpu0, wall0 = cpu_seconds(pid), time.monotonic()
            await asyncio.gather(*(talk(url, audio, args.seconds) for _ in range(args.sessions)))
            used, wall = cpu_seconds(pid) - cpu0, time.monotonic() - wall0
        out[name] = {"sessions": args.sessions, "cpu_s_per_session_s": round(used / (args.sessions * wall), 4),
                     "server_cpu_percent": round(100.0 * used / wall, 1)}
    return out


# --- capacity: sockets within the latency budget --------------------------------------------------------------


async def capacity(args: argparse.Namespace) -> dict[str, Any]:
    steps = [int(x) for x in args.steps.split(",")]
    found: list[dict[str, Any]] = []
    async with spawned_server("loopback", _env(max(steps))) as (url, pid):
        for n in steps:
            cpu0, wall0 = cpu_seconds(pid), time.monotonic()
            trips = await asyncio.gather(*(socket_round_trips(url, args.seconds) for _ in range(n)))
            used = cpu_seconds(pid) - cpu0
            flat = [x for t in trips for x in t]
            p90 = _p(flat, 90)
            found.append({"sessions": n, "p90_ms": p90, "server_cpu_percent": round(100 * used / (time.monotonic() - wall0), 1)})
            if p90 is None or p90 > args.budget_ms:
                break
    webrtc_steps: list[Any] = []
    if not args.skip_webrtc_capacity:
        async with spawned_server("loopback", _env(max(steps))) as (url, pid):
            webrtc_steps = await webrtc_load.measure(url, steps, args.seconds, 0.5, args.budget_ms, pid)
    ok = [s["sessions"] for s in found if s["p90_ms"] is not None and s["p90_ms"] <= args.budget_ms]
    web_ok = [s.sessions for s in webrtc_steps if s.within_budget]
    return {"socket": found, "socket_largest_n": max(ok) if ok else None,
            "webrtc_largest_n": max(web_ok) if web_ok else None, "budget_ms": args.budget_ms}


# --- throughput: a file sent at once ---------------------------------------------------------------------------------


async def _stepped(url: str) -> tuple[int, int]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/sessions") as resp:
            sessions = (await resp.json())["sessions"]
    if not sessions:
        return 0, 0
    c = sessions[0]["counters"]
    return c["engine_windows_stepped"], c["window_underruns"]


async def file_at_once(url: str, pid: int, audio: np.ndarray, window_s: float = 0.4) -> dict[str, Any]:
    client = await SocketClient.open(url)
    try:
        windows = int(len(audio) / RATE / window_s)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        await client.stream(pcm16(audio), 1000, realtime=False)
        while (await _stepped(url))[0] < windows:
            await asyncio.sleep(0.05)
        wall, used = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    finally:
        await client.close()
    seconds = len(audio) / RATE
    return {"audio_s": round(seconds, 1), "wall_s": round(wall, 2), "x_real_time": round(seconds / wall, 1),
            "server_cpu_s_per_audio_s": round(used / seconds, 4)}


def _tiny_profile(folder: Path) -> str:
    from lychee_rtc.engine.lychee import tiny

    tiny.main([str(folder / "tiny"), "--seed", "11", "--decision-bias", "4"])
    return str(folder / "tiny" / "lychee-cpu.yaml")


async def throughput(args: argparse.Namespace, speech: np.ndarray) -> dict[str, Any]:
    turn = np.concatenate([speech, np.zeros(2 * RATE, np.float32)])
    audio = np.tile(turn, int(np.ceil(args.file_s * RATE / len(turn))))[:int(args.file_s * RATE)]
    out: dict[str, Any] = {}
    async with spawned_server("echo", _env(1)) as (url, pid):
        out["echo"] = await file_at_once(url, pid, audio)
    with tempfile.TemporaryDirectory() as folder:
        profile = args.tiny or _tiny_profile(Path(folder))
        async with spawned_server(profile, _env(1), ready_timeout_s=300) as (url, pid):
            out["lychee_tiny_cpu"] = await file_at_once(url, pid, audio[:int(min(args.file_s, 30) * RATE)])
    return out


# --- vLLM-Omni's own client and metrics --------------------------------------------------------------------------------


def load_duplex_client(folder: str) -> Any:
    """vLLM-Omni's client module from its installed package, without importing vLLM (its package's
    ``__init__`` does): a bare ``vllm_omni`` package object with the folder as its path."""
    package = Path(folder) / "vllm_omni"
    if not (package / "clients" / "duplex.py").is_file():
        raise SystemExit(f"--vllm-omni: no vllm_omni/clients/duplex.py under {folder} (make install-test fetches it)")
    if "vllm_omni" not in sys.modules:
        bare = types.ModuleType("vllm_omni")
        bare.__path__ = [str(package)]
        sys.modules["vllm_omni"] = bare
    import importlib

    return importlib.import_module("vllm_omni.clients.duplex")


async def vllm(args: argparse.Namespace, speech: np.ndarray) -> dict[str, Any]:
    duplex = load_duplex_client(args.vllm_omni)
    from lychee_rtc.pcm import PcmResampler

    r = PcmResampler(RATE, 16000)
    speech16 = np.concatenate([r.process(speech), r.flush()])
    turns: list[dict[str, Any]] = []
    async with spawned_server("echo", _env(1)) as (url, _pid):
        collector = duplex.EventCollector()
        async with duplex.DuplexClient(url.replace("http", "ws"), model="lychee-fd") as client:
            consuming = asyncio.ensure_future(collector.consume(client))
            responses = client.responses()
            for _ in range(args.runs):
                started = time.monotonic()
                await client.stream_pcm(pcm16(speech16) + bytes(2 * 16000 * 2))
                response = await asyncio.wait_for(anext(responses), 60)
                while response.decision == "listen":
                    response = await asyncio.wait_for(anext(responses), 60)
                async for _chunk in response.audio():
                    pass
                timing = collector.timing_summary(after_s=started, response_id=response.response_id)
                metrics = timing.get("request_metrics", {})
                stream = collector.global_timing_summary(after_s=started, window_started_at_s=started,
                                                         response_ids=[response.response_id],
                                                         measurement_origin={"ttfp": "input stream start"})
                duration = metrics.get("audio_duration_ms") or 0
                turns.append({"ttfp_ms": metrics.get("ttfp_ms"),
                              "rtf": round(metrics["audio_generation_ms"] / duration, 4) if duration else None,
                              "stream_ttfp_ms": stream.get("ttfp_ms"),
                              "stream_rtf": round(stream["audio_generation_ms"] / stream["audio_duration_ms"], 4)
                              if stream.get("audio_duration_ms") else None,
                              "audio_duration_ms": duration})
        consuming.cancel()
    keys = ("ttfp_ms", "rtf", "stream_ttfp_ms", "stream_rtf")
    return {"turns": turns, **{f"median_{k}": _p([t[k] for t in turns if t[k] is not None], 50) for k in keys}}


# --- the command ---------------------------------------------------------------------------------------------------------


async def _main(args: argparse.Namespace) -> int:
    speech = read_wav(args.speech, RATE)
    parts = args.parts.split(",")
    report: dict[str, Any] = {"load_average": [round(x, 2) for x in os.getloadavg()]}
    for part in parts:
        started = time.monotonic()
        if part == "transport":
            report[part] = await transport(args)
        elif part == "answer":
            report[part] = await answer(args, speech)
        elif part == "cpu":
            report[part] = await cpu(args, speech)
        elif part == "capacity":
            report[part] = await capacity(args)
        elif part == "throughput":
            report[part] = await throughput(args, speech)
        elif part == "vllm":
            report[part] = await vllm(args, speech)
        else:
            raise SystemExit(f"unknown part {part!r}; parts: {', '.join(PARTS)}")
        print(f"{part} ({time.monotonic() - started:.0f} s): {json.dumps(report[part])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("websocket", help="the realtime WebSocket beside WebRTC: latency, CPU, capacity, throughput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS[:-1]), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--speech", default=str(SPEECH / QUESTION), help="the user's utterance (16-bit WAV)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of audio per transport/capacity/cpu run")
    p.add_argument("--runs", type=int, default=3, help="answers measured per client (answer, vllm)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions for the cpu part")
    p.add_argument("--steps", default="1,2,4,8,16", help="concurrent sessions tried by the capacity part")
    p.add_argument("--budget-ms", type=float, default=200.0, help="capacity: p90 round-trip budget")
    p.add_argument("--skip-webrtc-capacity", action="store_true", help="capacity: the socket only")
    p.add_argument("--file-s", type=float, default=60.0, help="throughput: seconds of audio sent at once")
    p.add_argument("--tiny", help="throughput: a tiny Lychee-FD profile (default: written to a temporary folder)")
    p.add_argument("--vllm-omni", default=".venv-clients/vllm-omni",
                   help="vllm: the folder holding vLLM-Omni's installed package (vllm_omni/)")
    p.add_argument("--json", help="also write the report as JSON here")
    p.set_defaults(func=_main)
