"""``lychee-rtc bench bargein``: when the engine hears a caller talk over the agent, with and without
the uplink processing, with and without the agent's echo on the line.

Offline and deterministic: the session's own processing stage (``media/audio_processing.py``) and the
echo engine's own VAD (``engine/echo.py``, fed its 400 ms windows) are driven as a call drives them,
20 ms at a time (the stage's revisions of the window not yet heard applied as the session's window clock
applies them). The agent speaks from 1 s on (the espeak-ng recordings of ``bench aec``); each frame
leaves for the caller at the leg's rate (8 kHz phone, 48 kHz WebRTC) and, on a line with echo, comes
back through the simulated office of ``bench/speakerphone.py`` ``--delay-ms`` later at ``--echo-db``
against the caller, with pink noise at ``--snr-db``. The caller ("Wait, stop, stop please…", another
voice, as loud as the agent) barges in once per run, at one of ``--barge-ins`` moments spread from
``--first-s`` (0.8 s) to ``--last-s`` (20 s) into the agent's speech (``--first-s 0 --last-s 0.7``: all
over the agent's first words, before the echo could have been found). When the engine reports the
caller's speech the agent stops 100 ms later (the cut reaching the caller) and the engine answers with
what it heard.

Reported per configuration and barge-in: the VAD's start of the caller's speech (``SpeechStarted``)
against where the same barge-in starts with the processing off and no echo on the line (the
reference), and how the engine's answer matches what the caller said (10 ms energy envelopes,
normalised correlation at the best lag). Earlier starts (the agent's own echo) are counted as
self-interruptions. On a line with echo, also against the same line without the echo (its room's noise
kept, the processing off: ``*_same_line``), which the noise alone moves by a VAD chunk at times.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lychee_rtc.bench.aec import AGENT_WAVS, CALLER_WAV, FIXTURES, at_level, read_wav, resample
from lychee_rtc.bench.speakerphone import EchoPath, pink_noise, room_impulse_response
from lychee_rtc.config import AudioProcessing, EchoSettings
from lychee_rtc.engine.base import AudioChunk, ResponseStarted, SessionOptions, SlotWindow, SpeechStarted
from lychee_rtc.engine.echo import OUTPUT_RATE, WINDOW_SAMPLES, EchoBackend
from lychee_rtc.media.audio_processing import AudioProcessingStage

RATE = 16000  # the engine's input, where the stage runs
FRAME = RATE // 50  # a transport frame, 20 ms
AGENT_FROM_S = 1.0
CUT_S = 0.1  # from the engine's report to the agent's audio stopping at the caller
AFTER_S = 7.0  # of the call after the barge-in: the interjection, its end, the answer
PHONE_LEG = AudioProcessing(echo_cancellation=True, high_pass_filter=True)


@dataclass
class BargeIn:
    at_s: float  # into the agent's speech
    start_s: float | None  # the VAD's start of the caller's speech, from the barge-in (None: missed)
    self_interruptions: int
    answer_match: float | None


@dataclass
class Configuration:
    name: str
    processing: bool
    echo_db: float | None
    runs: list[BargeIn] = field(default_factory=list)
    # Filled against the reference (processing off, no echo):
    late_ms: list[float | None] = field(default_factory=list)
    # ... and, on a line with echo, against the same line without it (its room's noise kept, processing off)
    late_same_line_ms: list[float | None] = field(default_factory=list)


def envelope(x: np.ndarray, hop: int) -> np.ndarray:
    n = len(x) // hop
    return np.sqrt(np.mean(np.square(x[:n * hop].reshape(n, hop)), axis=1)) if n else np.zeros(0)


def envelope_match(heard: np.ndarray, said: np.ndarray, rate: int) -> float:
    """Normalised correlation of 10 ms energy envelopes, ``said`` (trimmed to its voice) at its best lag."""
    hop = rate // 100
    b = envelope(said, hop)
    voiced = np.flatnonzero(b > 0.1 * b.max())
    b = b[voiced[0]:voiced[-1] + 1]
    b = (b - b.mean()) / (b.std() + 1e-9)
    best = -1.0
    for offset in range(0, hop, hop // 4):
        a = np.concatenate([envelope(heard[offset:], hop), np.zeros(len(b))])
        for lag in range(max(1, len(a) - len(b) + 1)):
            w = a[lag:lag + len(b)]
            if len(w) == len(b) and w.std() > 1e-6:
                best = max(best, float(np.mean((w - w.mean()) / w.std() * b)))
    return best


def run_once(settings: AudioProcessing | None, leg_rate: int, echo_db: float | None, delay_ms: float,
             snr_db: float | None, at_s: float, agent: np.ndarray, caller: np.ndarray, rir: np.ndarray) -> BargeIn:
    stage = AudioProcessingStage(RATE, settings) if settings is not None else None
    if stage is not None:
        stage.reference_continuous = leg_rate != 8000  # as the WebRTC track feeds it (a carrier: not)
    engine = EchoBackend(EchoSettings(), 1)
    engine.open_slot(0, SessionOptions())
    path = EchoPath(rir, 10 ** (echo_db / 20), int(delay_ms * RATE / 1000)) if echo_db is not None else None
    total = int((AGENT_FROM_S + at_s + AFTER_S) * RATE)
    noise = (pink_noise(total) * 0.1 * 10 ** (-snr_db / 20)) if snr_db is not None else np.zeros(total, np.float32)
    barge_at = int((AGENT_FROM_S + at_s) * RATE)
    near = np.zeros(total, np.float32)
    near[barge_at:barge_at + len(caller)] = caller[:max(0, total - barge_at)]
    agent_stop = total
    window = np.zeros(0, np.float32)
    seq, epoch = 0, 0
    start: float | None = None
    early = 0
    answer_id: str | None = None
    answer: list[np.ndarray] = []
    for k in range(total // FRAME):
        pos = k * FRAME
        a0 = pos - int(AGENT_FROM_S * RATE)
        play = agent[a0:a0 + FRAME] if 0 <= a0 and pos < agent_stop else np.zeros(0, np.float32)
        play = np.pad(play, (0, FRAME - len(play)))
        if stage is not None:
            stage.far_end(resample(play, RATE, leg_rate) if leg_rate != RATE else play, leg_rate)
        echo = np.zeros(FRAME, np.float32)
        if path is not None:
            path.hear(play)
            echo = path.take(FRAME)
        mic = near[pos:pos + FRAME] + echo + noise[pos:pos + FRAME]
        heard = stage.process(mic) if stage is not None else mic
        if stage is not None:  # as the session's window clock takes it: the open window is revised
            revision = stage.take_revision()
            n = min(len(revision), len(window))
            if n:
                window[len(window) - n:] = revision[len(revision) - n:]
        window = np.concatenate([window, heard])
        while len(window) >= WINDOW_SAMPLES:
            w, window = window[:WINDOW_SAMPLES], window[WINDOW_SAMPLES:]
            for ev in engine.step([SlotWindow(0, w, seq, epoch)])[0]:
                if isinstance(ev, SpeechStarted):
                    if ev.sample < barge_at - int(0.3 * RATE):
                        early += 1  # the agent's own echo
                    elif start is None:
                        start = (ev.sample - barge_at) / RATE
                        agent_stop = min(agent_stop, pos + FRAME + int(CUT_S * RATE))
                        epoch += 1  # the session's interruption: what the engine still says of it is stale
                elif isinstance(ev, ResponseStarted) and start is not None and answer_id is None:
                    answer_id = ev.response_id
                elif isinstance(ev, AudioChunk) and ev.response_id == answer_id:
                    answer.append(ev.pcm)
            seq += 1
    if stage is not None:
        stage.close()
    said = resample(caller, RATE, OUTPUT_RATE)
    match = envelope_match(np.concatenate(answer), said, OUTPUT_RATE) if answer else None
    return BargeIn(round(at_s, 2), None if start is None else round(start, 3), early,
                   None if match is None else round(match, 3))


def _summary(c: Configuration) -> dict[str, Any]:
    late = [x for x in c.late_ms if x is not None]
    matches = [r.answer_match for r in c.runs if r.answer_match is not None]
    out = {"configuration": c.name, "detected": sum(r.start_s is not None for r in c.runs), "runs": len(c.runs),
           "within_40_ms": sum(x <= 40 for x in late),
           "late_ms_max": round(max(late), 1) if late else None,
           "late_ms_median": round(float(np.median(late)), 1) if late else None,
           "self_interruptions": sum(r.self_interruptions for r in c.runs),
           "answer_match_min": min(matches) if matches else None,
           "answer_match_median": round(float(np.median(matches)), 3) if matches else None}
    same = [x for x in c.late_same_line_ms if x is not None]
    if same:
        out |= {"within_40_ms_same_line": sum(x <= 40 for x in same), "late_ms_max_same_line": round(max(same), 1)}
    return out


def _late(runs: list[BargeIn], reference: list[BargeIn]) -> list[float | None]:
    return [None if r.start_s is None or ref.start_s is None else round(1000 * (r.start_s - ref.start_s), 1)
            for r, ref in zip(runs, reference)]


def voices(leg_rate: int, speech_rms: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """The bench's agent (its three fixtures three times over) and caller at ``speech_rms``, at the stage's
    rate; on a phone leg (``leg_rate`` 8000) both narrowband, as they are there."""
    agent = np.concatenate([read_wav(FIXTURES / w, RATE) for w in AGENT_WAVS])
    agent = at_level(np.tile(agent, 3), speech_rms)
    caller = at_level(read_wav(FIXTURES / CALLER_WAV, RATE), speech_rms)
    if leg_rate == 8000:
        agent = resample(resample(agent, RATE, 8000), 8000, RATE)
        caller = resample(resample(caller, RATE, 8000), 8000, RATE)
    return agent, caller


def _main(args: argparse.Namespace) -> int:
    leg_rate = 8000 if args.leg == "phone" else 48000
    agent, caller = voices(leg_rate, args.speech_rms)
    rir = room_impulse_response(RATE)
    moments = np.linspace(args.first_s, args.last_s, args.barge_ins)
    echoes = [None] + [float(x) for x in args.echo_db.split(",") if x]
    configs = [Configuration("off, no echo", False, None)]
    # The same line as those with echo, less the echo (its room's noise kept): the barge-in with the processing
    # off where the echo would make the agent cut itself off. The silent line stays the reference: noise moves
    # some of the VAD's starts by a 32 ms chunk of its own.
    same_line = Configuration("off, no echo, the room's noise", False, None) \
        if not args.noise_without_echo and any(e is not None for e in echoes) else None
    if same_line is not None:
        configs.append(same_line)
    for echo in echoes:
        name = "no echo" if echo is None else f"echo {echo:g} dB"
        configs.append(Configuration(f"processing, {name}", True, echo))
        if echo is not None:
            configs.append(Configuration(f"off, {name}", False, echo))
    for c in configs:
        snr = args.snr_db if (c.echo_db is not None or args.noise_without_echo or c is same_line) else None
        for at in moments:
            c.runs.append(run_once(PHONE_LEG if c.processing else None, leg_rate, c.echo_db, args.delay_ms, snr,
                                   float(at), agent, caller, rir))
    reference = configs[0]
    for c in configs:
        c.late_ms = _late(c.runs, reference.runs)
        if same_line is not None and c.echo_db is not None:
            c.late_same_line_ms = _late(c.runs, same_line.runs)
        print(json.dumps(_summary(c)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"leg": args.leg, "setup": vars(args) | {"func": None},
                                               "configurations": [asdict(c) | {"summary": _summary(c)} for c in configs]},
                                              indent=2, default=str))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bargein", help="barge-in detection with and without the uplink processing, echo or none",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--leg", choices=["phone", "webrtc"], default="phone")
    p.add_argument("--echo-db", default="0,-10,-20", help="echo levels to try besides none (comma-separated dB)")
    p.add_argument("--delay-ms", type=float, default=120.0, help="loudspeaker to microphone delay of the echo")
    p.add_argument("--snr-db", type=float, default=25.0, help="the room's noise under the caller, where there is echo")
    p.add_argument("--noise-without-echo", action="store_true",
                   help="the room's noise on the lines without echo too (default: digital silence, as a handset)")
    p.add_argument("--barge-ins", type=int, default=10)
    p.add_argument("--first-s", type=float, default=0.8, help="the first barge-in, this far into the agent's speech")
    p.add_argument("--last-s", type=float, default=20.0, help="the last barge-in")
    p.add_argument("--speech-rms", type=float, default=0.1)
    p.add_argument("--json", help="also write every run as JSON here")
    p.set_defaults(func=_main)
