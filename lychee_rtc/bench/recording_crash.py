"""``lychee-rtc bench recording-crash``: what a recording loses when its server is killed.

Each round starts a server (``configs/echo.yaml``, every call recorded) in a child process, places a
WebRTC call whose caller talks without pause, lets it run a few seconds (a different stretch each
round, so the kill lands anywhere in the writer's blocks and pages), and SIGKILLs the server. The
file it left is then read by libsndfile (the ``soundfile`` wheel, an Ogg/Opus decoder independent
of the PyAV that wrote it). The loss is how far the playable audio ends before the kill: the time
from the recording's ``t = 0`` (its meta's ``started_at``, the unix time of that instant) to the kill,
less the duration libsndfile decodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lychee_rtc.bench.client import RATE, RtcClient
from lychee_rtc.bench.recording import speech_like
from lychee_rtc.bench.server_process import spawned_server


@dataclass
class CrashRound:
    lived_s: float  # from the recording's t = 0 to the kill
    playable_s: float  # what libsndfile decodes of the file left behind
    loss_s: float


def read_duration(path: Path) -> float:
    try:
        import soundfile
    except ImportError as exc:  # the test extra has it
        raise SystemExit("bench recording-crash reads the file with libsndfile: pip install soundfile") from exc
    info = soundfile.info(str(path))
    data, rate = soundfile.read(str(path), dtype="float32")  # decode it all: a truncated page must not count
    return len(data) / rate if info.frames else 0.0


async def one_round(directory: Path, run_s: float) -> CrashRound:
    env = {"LYCHEE_RTC_RECORDING__ENABLED": "true", "LYCHEE_RTC_RECORDING__DIRECTORY": str(directory),
           "LYCHEE_RTC_SESSION__WINDOW_GRACE_MS": "2000", "PYTHONPATH": os.pathsep.join(sys.path)}
    async with spawned_server("configs/echo.yaml", env) as (url, pid):
        client = RtcClient(url)
        await client.connect()
        try:
            client.mic.feed(speech_like(RATE, run_s + 10.0, seed=3))
            meta_path = directory / client.session_id / "meta.json"
            deadline = time.monotonic() + 30
            while not meta_path.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the recording's meta never appeared")
                await asyncio.sleep(0.05)
            await asyncio.sleep(run_s)
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
                await asyncio.sleep(0.02)
        finally:
            await client.close()
    started_at = json.loads(meta_path.read_text())["started_at"]
    lived = killed_at - started_at
    playable = read_duration(directory / client.session_id / "audio.ogg")
    return CrashRound(round(lived, 3), round(playable, 3), round(lived - playable, 3))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


async def _main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="lychee-rec-crash-") as tmp:
            r = await one_round(Path(tmp), rng.uniform(args.min_s, args.max_s))
        rounds.append(r)
        print(f"round {i + 1}: lived {r.lived_s:.3f} s, playable {r.playable_s:.3f} s, lost {r.loss_s:.3f} s",
              flush=True)
    losses = np.array([r.loss_s for r in rounds])
    summary = {"rounds": len(rounds), "loss_s_min": float(losses.min()), "loss_s_median": float(np.median(losses)),
               "loss_s_max": float(losses.max())}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": [asdict(r) for r in rounds]}, indent=2))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recording-crash", help="audio a recording loses when its server is SIGKILLed mid-call",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--min-s", type=float, default=3.0, help="shortest call before the kill")
    p.add_argument("--max-s", type=float, default=6.0, help="longest call before the kill")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write every round as JSON here")
    p.set_defaults(func=lambda args: asyncio.run(_main(args)))
