"""``lychee-rtc bench e2e``: the duplex path end to end through the server, N callers at once.

The server is started from a profile (``--config``, e.g. configs/lychee-c4.yaml); with ``--tiny DIR``
its model and vocoder are swapped for tiny random ones written to DIR, with ``--checkpoint DIR`` for
the folders in DIR (a ``--dir`` download or a ``random-checkpoint``), and ``--device`` moves both,
so the same run checks the step on a CPU. For each N (``--sessions``, default 1,2,4) N aiortc callers
connect at once; each speaks recorded utterances (16-bit WAVs from ``--speech``), one after the
other, and after each one marks the end of its turn with ``input_audio_buffer.commit`` (random
weights cannot hear where an utterance ends, so the caller says so, as a push-to-talk client would),
waits for the answer's first audio, then cancels it. Reported per N:

* end of utterance to first answer audio: from the moment the caller's last utterance frame left
  its microphone to the arrival of the answer's first audio frame (p50 / p95 / max over the turns);
* window deadline misses: engine steps that took longer than one 400 ms window (the server's
  ``lychee_rtc_engine_step_seconds`` histogram, counted over this N);
* dropped windows: windows the engine queue dropped because it was behind
  (``engine_windows_dropped``), and uplink windows completed late with silence
  (``window_underruns``), summed over the N sessions.

The command exits with status 1 when a turn got no answer or an N could not run, so a script
running it learns that the figures are incomplete.

    lychee-rtc bench e2e --config configs/lychee-c4.yaml --json e2e.json            # GPU, mounted models
    lychee-rtc bench e2e --config configs/lychee-c4.yaml --tiny /tmp/e2e --device cpu  # a check on a CPU
    lychee-rtc bench e2e --config configs/lychee-c4.yaml --checkpoint /tmp/lychee-full # a random full-size one
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from lychee_rtc.bench.client import RATE, RtcClient
from lychee_rtc.bench.probes import percentile
from lychee_rtc.bench.server_process import spawned_server
from lychee_rtc.bench.soak import parse_metrics
from lychee_rtc.bench.telephony import read_wav

WINDOW_S = 0.4
STEP_HISTOGRAM = "lychee_rtc_engine_step_seconds"


@dataclass
class Turn:
    session: int
    utterance: str
    seconds: float  # utterance length
    first_audio_ms: float | None  # end of utterance -> first answer audio; None: no answer


@dataclass
class E2EStep:
    sessions: int
    turns: list[Turn]
    first_audio_p50_ms: float | None
    first_audio_p95_ms: float | None
    first_audio_max_ms: float | None
    engine_steps: int
    deadline_misses: int  # engine steps longer than one window
    windows_dropped: int  # engine queue overflow
    window_underruns: int  # uplink windows completed late with silence
    error: str | None = None

    @property
    def answered(self) -> int:
        return sum(t.first_audio_ms is not None for t in self.turns)


def load_utterances(folder: Path, limit: int | None = None) -> list[tuple[str, np.ndarray]]:
    """The WAVs of ``folder`` at the caller's rate, shortest first (a short run takes the short ones)."""
    files = sorted(folder.glob("*.wav"))
    if not files:
        raise SystemExit(f"--speech: no .wav files in {folder}")
    audio = sorted(((f.name, read_wav(str(f), RATE)) for f in files), key=lambda x: len(x[1]))
    return audio[:limit] if limit else audio


def swapped_profile(config: Path, out: Path, model_root: str, vocoder: dict | None, device: str | None) -> Path:
    """The profile with its model and vocoder folders swapped for ``model_root`` / ``vocoder``;
    ``device`` cpu also moves both to the CPU (fp32, a short context, one thread)."""
    profile = yaml.safe_load(config.read_text())
    lychee = profile["engine"]["lychee"]
    lychee["model_root"] = model_root
    if lychee.get("token2wav") and vocoder is not None:
        lychee["token2wav"] = {**lychee["token2wav"], **vocoder}
    if device is not None:
        lychee["device"] = device
        if lychee.get("token2wav"):
            lychee["token2wav"]["device"] = device
    if device == "cpu":
        # The profile's context sizes follow max_seq.
        lychee.update({"dtype": "fp32", "max_seq": 1024, "progress": False, "torch_threads": 1})
    profile["server"]["host"] = "127.0.0.1"
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{config.stem}-swapped.yaml"
    target.write_text(yaml.safe_dump(profile))
    return target


def tiny_profile(config: Path, root: Path, device: str) -> Path:
    """The profile with its model and vocoder swapped for tiny random ones written under ``root``."""
    from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint
    from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder

    # decision_bias: the tiny model speaks only when the caller commits its turn.
    model = write_tiny_checkpoint(root / "lychee", seed=11, spec=TinySpec(decision_bias=4.0))
    vocoder = {k: v for k, v in write_tiny_vocoder(root, seed=3).items() if k in ("folder", "voices", "default_voice")}
    return swapped_profile(config, root, str(model), vocoder, device)


def checkpoint_profile(config: Path, checkpoint: Path, device: str | None) -> Path:
    """The profile serving a downloaded (``lychee-rtc download --dir``) or random
    (``lychee-rtc random-checkpoint``) folder: ``lychee_full_duplex/`` and ``token2wav/`` in it."""
    return swapped_profile(config, checkpoint, str(checkpoint / "lychee_full_duplex"),
                           {"folder": str(checkpoint / "token2wav")}, device)


async def step_histogram(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(steps, steps within one window) so far, from the server's /metrics."""
    async with http.get(f"{url}/metrics") as resp:
        if resp.status != 200:
            raise RuntimeError(f"/metrics answered {resp.status}: the profile needs metrics.enabled")
        samples = parse_metrics(await resp.text())
    count = sum(v for _, v in samples.get(f"{STEP_HISTOGRAM}_count", []))
    within = sum(v for labels, v in samples.get(f"{STEP_HISTOGRAM}_bucket", []) if float(labels["le"]) == WINDOW_S)
    return count, within


async def session_counters(http: aiohttp.ClientSession, url: str, ids: list[str]) -> dict[str, int]:
    async with http.get(f"{url}/v1/sessions") as resp:
        body = await resp.json()
    totals = {"engine_windows_dropped": 0, "window_underruns": 0}
    for s in body.get("sessions", []):
        if s["session_id"] in ids:
            for k in totals:
                totals[k] += int(s["counters"].get(k, 0))
    return totals


async def speak_turns(client: RtcClient, index: int, utterances: list[tuple[str, np.ndarray]], turns: int,
                      answer_timeout_s: float) -> list[Turn]:
    """One caller: each utterance, commit, first answer audio, cancel."""
    out = []
    await client.wait_event("session.created", timeout=answer_timeout_s)
    for k in range(turns):
        name, pcm = utterances[(index + k) % len(utterances)]
        turn = Turn(index, name, round(len(pcm) / RATE, 2), None)
        out.append(turn)
        end = round(client.mic.feed(pcm) * RATE) + len(pcm)
        await client.wait_sent(end, timeout=len(pcm) / RATE + answer_timeout_s)
        last_frame = (end - 1) // client.mic.frame
        spoken_at = client.mic.send_times.get(last_frame, time.monotonic())
        mark = len(client.events)
        client.send({"type": "input_audio_buffer.commit"})
        try:
            started = await client.wait_event("output_audio_buffer.started", timeout=answer_timeout_s, after=mark)
        except asyncio.TimeoutError:
            return out  # no answer: the turn stays unanswered, the caller stops
        offset = started["sample_offset"] * RATE // started["sample_rate"]
        await client.wait_audio(offset + client.mic.frame, timeout=answer_timeout_s)
        arrival = min(t for off, a, t in client.received.chunks if off + len(a) > offset)
        turn.first_audio_ms = round((arrival - spoken_at) * 1000.0, 1)
        client.send({"type": "response.cancel"})
        await client.wait_event("response.done", timeout=answer_timeout_s, after=mark,
                                response_id=started["response_id"])
    return out


async def run_step(url: str, n: int, utterances: list[tuple[str, np.ndarray]], turns: int,
                   answer_timeout_s: float) -> E2EStep:
    clients = [RtcClient(url) for _ in range(n)]
    async with aiohttp.ClientSession() as http:
        steps0, within0 = await step_histogram(http, url)
        error = None
        results: list[Turn] = []
        counters = {"engine_windows_dropped": 0, "window_underruns": 0}
        try:
            await asyncio.gather(*(c.connect() for c in clients))
            per_caller = await asyncio.gather(*(speak_turns(c, i, utterances, turns, answer_timeout_s)
                                                for i, c in enumerate(clients)), return_exceptions=True)
            for r in per_caller:
                if isinstance(r, BaseException):
                    error = f"{type(r).__name__}: {r}"
                else:
                    results += r
            counters = await session_counters(http, url, [c.session_id for c in clients if c.session_id])
        except (OSError, RuntimeError, TimeoutError, aiohttp.ClientError) as exc:  # e.g. an offer refused
            error = f"{type(exc).__name__}: {exc}"
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        steps1, within1 = await step_histogram(http, url)
    found = [t.first_audio_ms for t in results if t.first_audio_ms is not None]
    return E2EStep(n, results, percentile(found, 50), percentile(found, 95), max(found, default=None),
                   int(steps1 - steps0), int((steps1 - within1) - (steps0 - within0)),
                   counters["engine_windows_dropped"], counters["window_underruns"], error)


def format_step(s: E2EStep, turns: int) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    return (f"| N{s.sessions} | {s.answered} / {s.sessions * turns} | {ms(s.first_audio_p50_ms)} / "
            f"{ms(s.first_audio_p95_ms)} / {ms(s.first_audio_max_ms)} | {s.deadline_misses} / {s.engine_steps} "
            f"| {s.windows_dropped} | {s.window_underruns} |")


TABLE_HEAD = ("| N | turns answered | end of utterance -> first audio ms p50 / p95 / max "
              "| steps over 400 ms / steps | windows dropped | uplink windows late |\n|---|---|---|---|---|---|")


def shortfalls(steps: list[E2EStep], asked: list[int], turns: int) -> list[str]:
    out = [f"N{n}: not run" for n in asked if n not in {s.sessions for s in steps}]
    for s in steps:
        if s.error:
            out.append(f"N{s.sessions}: {s.error}")
        if s.answered < s.sessions * turns:
            out.append(f"N{s.sessions}: {s.answered} of {s.sessions * turns} turns answered")
    return out


async def _main(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in str(args.sessions).split(",") if x]
    utterances = load_utterances(Path(args.speech))
    config = Path(args.config)
    if args.tiny:
        config = tiny_profile(config, Path(args.tiny), args.device or "cpu")
    elif args.checkpoint:
        config = checkpoint_profile(config, Path(args.checkpoint), args.device)
    env = {"LYCHEE_RTC_SESSION__MAX_SESSIONS": str(max(sizes))}
    steps: list[E2EStep] = []
    print(TABLE_HEAD, flush=True)
    async with spawned_server(str(config), env, ready_timeout_s=args.ready_timeout) as (url, _pid):
        for n in sizes:
            step = await run_step(url, n, utterances, args.turns, args.answer_timeout)
            steps.append(step)
            print(format_step(step, args.turns), flush=True)
            await asyncio.sleep(1.0)  # let the server release the slots
    if args.json:
        report: dict[str, Any] = {"config": str(args.config), "tiny": bool(args.tiny), "checkpoint": args.checkpoint,
                                  "turns": args.turns,
                                  "steps": [asdict(s) | {"answered": s.answered} for s in steps]}
        Path(args.json).write_text(json.dumps(report, indent=2))
    missing = shortfalls(steps, sizes, args.turns)
    for line in missing:
        print(f"incomplete: {line}", file=sys.stderr)
    return 1 if missing else 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("e2e", help="N callers speaking recorded utterances through the server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/lychee-c4.yaml", help="the server's profile (a file)")
    p.add_argument("--tiny", metavar="DIR", help="swap the model and vocoder for tiny random ones written to DIR")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="serve DIR/lychee_full_duplex and DIR/token2wav (lychee-rtc download --dir, or "
                        "lychee-rtc random-checkpoint) instead of the profile's folders")
    p.add_argument("--device", help="with --tiny (default cpu) or --checkpoint: where model and vocoder run")
    p.add_argument("--sessions", default="1,2,4", help="comma-separated numbers of simultaneous callers")
    p.add_argument("--turns", type=int, default=2, help="utterances each caller speaks per N")
    p.add_argument("--speech", default="tests/fixtures/speech", help="folder of 16-bit WAV utterances")
    p.add_argument("--answer-timeout", type=float, default=60.0, help="seconds a caller waits for an answer")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds the server may take to start")
    p.add_argument("--json", help="also write the report as JSON here")
    p.set_defaults(func=run)
