"""``lychee-rtc bench aec``: the uplink processing stage on a speakerphone, offline and timed.

The session's own stage (``media/audio_processing.py``) is driven as a call drives it: every 20 ms
the transport reports the agent's frame as it leaves (at the transport's rate: 48 kHz WebRTC, or an
8 kHz phone leg) and the caller's microphone arrives at 16 kHz. The microphone hears the agent
through a simulated room (``bench/speakerphone.py``) ``--delay-ms`` later, ``--echo-db`` against the
caller's speech level, with pink noise at ``--snr-db``. Reported, per leg:

* ERLE (echo return loss enhancement) while only the agent speaks, over 250 ms blocks: the median
  after convergence, with the echo canceller alone (no noise, noise suppression off) and with the
  whole phone-leg stage (echo canceller, noise suppression, high-pass; noise present);
* convergence: time from the agent's first word until a block first reaches 20 dB ERLE;
* the caller's speech distortion: correlation and SNR of the processed microphone against the
  caller's clean speech, when the caller speaks alone and when both talk at once (double talk);
* CPU per call (process time per second of call, one core) and the latency the stage adds: what it
  holds back waiting for a whole 10 ms frame, the time it takes per frame, and the measured lag of
  its output against its input.
"""

from __future__ import annotations

import argparse
import json
import time
import wave
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lychee_rtc.bench.speakerphone import pink_noise, rms, room_impulse_response
from lychee_rtc.config import AudioProcessing
from lychee_rtc.media.audio_processing import AudioProcessingStage
from lychee_rtc.pcm import PcmResampler

RATE = 16000  # the stage's rate (the engine's input)
STEP_S = 0.02  # a transport frame
BLOCK_S = 0.25
CONVERGED_DB = 20.0
# Speech recorded in the repository (espeak-ng, tests/fixtures/speech): the agent and the caller.
FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "speech"
AGENT_WAVS = ("fb16d488a14d.wav", "21f7d4628b87.wav", "c8e5ba25e6e5.wav", "95f217570b12.wav")
CALLER_WAV = "0303df910901.wav"
ECHO_ONLY = AudioProcessing(echo_cancellation=True, high_pass_filter=True)
WITH_NS = AudioProcessing(echo_cancellation=True, noise_suppression=True, high_pass_filter=True)


def read_wav(path: Path, rate: int) -> np.ndarray:
    with wave.open(str(path)) as w:
        src = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    r = PcmResampler(src, rate)
    x = np.concatenate([r.process(pcm), r.flush()])
    return x - np.mean(x)  # espeak-ng's recordings carry a DC offset, which a high-pass filter rightly removes


def resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    r = PcmResampler(src, dst)
    return np.concatenate([r.process(x), r.flush()])[:len(x) * dst // src]


def at_level(x: np.ndarray, level: float) -> np.ndarray:
    return (x * (level / max(rms(x[np.abs(x) > 0.01 * np.max(np.abs(x))]), 1e-9))).astype(np.float32)


@dataclass
class Run:
    output: np.ndarray
    cpu_s: float
    frame_ms: list[float]


def run_stage(settings: AudioProcessing, agent_tx: np.ndarray, tx_rate: int, mic: np.ndarray,
              chunk: int = 320) -> Run:
    """Drive a stage like a call: agent frames leave every 20 ms, the microphone arrives ``chunk`` at a time."""
    stage = AudioProcessingStage(RATE, settings)
    stage.reference_continuous = tx_rate != 8000  # as the WebRTC track feeds it (a carrier: not)
    tx_frame = int(tx_rate * STEP_S)
    out: list[np.ndarray] = []
    frame_ms: list[float] = []
    cpu0 = time.process_time()
    steps = len(mic) // chunk
    for k in range(steps):
        start = int(round(k * chunk / RATE * tx_rate))
        end = int(round((k + 1) * chunk / RATE * tx_rate))
        for a in range(start, end, tx_frame):  # what the transport sent meanwhile
            stage.far_end(agent_tx[a:min(a + tx_frame, end)], tx_rate)
        t = time.perf_counter()
        out.append(stage.process(mic[k * chunk:(k + 1) * chunk]))
        frame_ms.append(1000.0 * (time.perf_counter() - t) / max(1, chunk // stage.frame))
    cpu = time.process_time() - cpu0
    stage.close()
    return Run(np.concatenate(out), cpu, frame_ms)


def blocks_db(reference: np.ndarray, processed: np.ndarray, active: np.ndarray) -> list[tuple[float, float]]:
    """(block start s, 10 log10 of energy in / energy out) for blocks where ``active``."""
    n = int(BLOCK_S * RATE)
    out = []
    for i in range(0, min(len(reference), len(processed)) - n + 1, n):
        if not active[i:i + n].any():
            continue
        e_in = float(np.mean(reference[i:i + n] ** 2))
        if e_in == 0.0:  # nothing to take out yet (the agent's first word has not come back): no ratio
            continue
        e_out = max(float(np.mean(processed[i:i + n] ** 2)), 1e-12)
        out.append((i / RATE, 10 * np.log10(e_in / e_out)))
    return out


def speech_activity(x: np.ndarray) -> np.ndarray:
    """Where ``x`` has speech (10 ms energy within 30 dB of its peak), widened by 50 ms."""
    hop = RATE // 100
    n = len(x) // hop
    energy = np.mean(x[:n * hop].reshape(n, hop) ** 2, axis=1)
    on = energy > np.max(energy) * 1e-3
    on = np.convolve(on.astype(float), np.ones(11), "same") > 0
    return np.repeat(on, hop)[:len(x)] if n else np.zeros(len(x), bool)


def stft_magnitude(x: np.ndarray, n: int = 512, hop: int = 256) -> np.ndarray:
    frames = len(x) // hop - 1
    if frames <= 0:
        return np.zeros((0, n // 2 + 1))
    idx = np.arange(n)[None, :] + hop * np.arange(frames)[:, None]
    return np.abs(np.fft.rfft(x[idx] * np.hanning(n), axis=1))


def distortion(clean: np.ndarray, processed: np.ndarray, where: np.ndarray) -> dict[str, float]:
    """How the caller's own speech came through, by its spectrum: the high-pass filter turns the phase
    of the lowest harmonics, which no listener (or model) hears but a waveform correlation punishes."""
    n = min(len(clean), len(processed))
    idx = np.flatnonzero(where[:n])
    c, p = clean[idx[0]:idx[-1] + 1], processed[idx[0]:idx[-1] + 1]
    mc, mp = stft_magnitude(c), stft_magnitude(p)
    voiced = mc.sum(axis=1) > 0.05 * mc.sum(axis=1).max()
    mc, mp = mc[voiced], mp[voiced]
    g = float(np.sum(mc * mp) / max(np.sum(mp * mp), 1e-12))  # the level the stage applied, taken out
    err = float(np.sum((mc - g * mp) ** 2))
    return {"spectral_correlation": round(float(np.corrcoef(mc.ravel(), mp.ravel())[0, 1]), 3),
            "spectral_snr_db": round(10 * np.log10(float(np.sum(mc ** 2)) / max(err, 1e-12)), 1)}


def lag_samples(x: np.ndarray, y: np.ndarray, max_lag: int = 400) -> int:
    """The lag of ``y`` behind ``x`` that correlates best."""
    best, arg = -np.inf, 0
    for lag in range(0, max_lag):
        v = float(np.dot(x[:len(x) - lag], y[lag:len(x)]))
        if v > best:
            best, arg = v, lag
    return arg


def measure_leg(name: str, tx_rate: int, args: argparse.Namespace, rir: np.ndarray) -> dict[str, Any]:
    agent = np.concatenate([read_wav(FIXTURES / w, RATE) for w in AGENT_WAVS])
    agent = at_level(np.tile(agent, max(1, int(np.ceil(args.seconds * RATE / len(agent)))))[:int(args.seconds * RATE)],
                     args.speech_rms)
    caller = at_level(read_wav(FIXTURES / CALLER_WAV, RATE), args.speech_rms)
    if tx_rate == 8000:  # a phone leg: both directions are narrowband
        agent = resample(resample(agent, RATE, 8000), 8000, RATE)
        caller = resample(resample(caller, RATE, 8000), 8000, RATE)
    agent_tx = resample(agent, RATE, tx_rate)
    delay = int(args.delay_ms * RATE / 1000)
    echo = np.convolve(agent, rir)[:len(agent)] * 10 ** (args.echo_db / 20)
    echo = np.concatenate([np.zeros(delay, np.float32), echo])[:len(agent)].astype(np.float32)
    noise = pink_noise(len(agent)) * args.speech_rms * 10 ** (-args.snr_db / 20)
    agent_on = speech_activity(np.concatenate([np.zeros(delay), agent])[:len(agent)])

    # Single talk, the phone legs' default (echo canceller, high-pass), no noise: ERLE and convergence.
    alone = run_stage(ECHO_ONLY, agent_tx, tx_rate, echo)
    erle = blocks_db(echo, alone.output, agent_on)
    first_word = next((t for t, _ in erle), 0.0)
    converged = next((t - first_word for t, db in erle if db >= CONVERGED_DB), None)
    # From when on every block stays above it (a canceller that loses the path shows here).
    below = [t for t, db in erle if db < CONVERGED_DB]
    stable = 0.0 if not below else (below[-1] + BLOCK_S - first_word)
    after = [db for t, db in erle if t >= first_word + args.settle_s]
    leg_mic = echo + noise
    call_s = len(agent) / RATE

    # The caller's speech, alone (near-end single talk) and over the agent (double talk), late in the
    # call so the canceller has converged; distortion with the stage's own delay taken out.
    at = int((args.seconds - len(caller) / RATE - 1.0) * RATE)
    clean = np.zeros(len(agent), np.float32)
    clean[at:at + len(caller)] = caller
    caller_on = speech_activity(clean)
    spoken = clean[at:at + len(caller)]
    quiet_agent = np.zeros_like(agent_tx)
    configs: dict[str, Any] = {}
    for label, settings in (("default", ECHO_ONLY), ("with_noise_suppression", WITH_NS)):
        with_noise = run_stage(settings, agent_tx, tx_rate, leg_mic)
        reduction = [db for t, db in blocks_db(leg_mic, with_noise.output, agent_on) if t >= first_word + args.settle_s]
        alone_caller = run_stage(settings, quiet_agent, tx_rate, clean + noise)
        double = run_stage(settings, agent_tx, tx_rate, clean + leg_mic)
        lag = lag_samples(spoken, alone_caller.output[at:at + len(caller)])
        dlag = lag_samples(spoken, double.output[at:at + len(caller)])
        frame_ms = np.array(with_noise.frame_ms)
        configs[label] = {
            "settings": {k: v for k, v in settings.model_dump().items() if v},
            "echo_and_noise_reduction_db_median": round(float(np.median(reduction)), 1) if reduction else None,
            "caller_alone": distortion(clean, alone_caller.output[lag:lag + len(clean)], caller_on),
            "double_talk": distortion(clean, double.output[dlag:dlag + len(clean)], caller_on),
            "cpu_percent_of_one_core": round(100.0 * with_noise.cpu_s / call_s, 2),
            "frame_compute_ms_p50": round(float(np.percentile(frame_ms, 50)), 3),
            "frame_compute_ms_p99": round(float(np.percentile(frame_ms, 99)), 3),
            "lag_ms": round(1000 * lag / RATE, 2),
        }
    return {
        "leg": name,
        "transport_rate": tx_rate,
        "erle_db_median_after_convergence": round(float(np.median(after)), 1) if after else None,
        "erle_db_p10_after_convergence": round(float(np.percentile(after, 10)), 1) if after else None,
        "first_block_above_20_db_s": None if converged is None else round(converged, 2),
        "stays_above_20_db_after_s": round(stable, 2),
        "configs": configs,
        "stage_lag_ms": stage_lags(spoken, tx_rate),
    }


def stage_lags(speech: np.ndarray, tx_rate: int) -> dict[str, float]:
    """The delay each stage adds by itself (the library's own buffering), measured on speech."""
    x = np.concatenate([np.zeros(RATE // 2, np.float32), speech, np.zeros(RATE // 2, np.float32)])
    x = x[:len(x) // 320 * 320]
    silent = np.zeros(len(x) * tx_rate // RATE, np.float32)
    out = {}
    for name in ("high_pass_filter", "echo_cancellation", "noise_suppression", "auto_gain_control"):
        y = run_stage(AudioProcessing(**{name: True}), silent, tx_rate, x).output
        out[name] = round(1000 * lag_samples(x, y) / RATE, 2)
    y = run_stage(AudioProcessing(echo_cancellation=True, high_pass_filter=True), silent, tx_rate, x).output
    out["default_phone_leg"] = round(1000 * lag_samples(x, y) / RATE, 2)
    return out


@dataclass
class Report:
    setup: dict[str, Any]
    legs: list[dict[str, Any]]


def _main(args: argparse.Namespace) -> int:
    rir = room_impulse_response(RATE)
    legs = [measure_leg("webrtc 48 kHz", 48000, args, rir), measure_leg("phone 8 kHz", 8000, args, rir)]
    # Held back for a whole frame: none when the transport's frames are whole 10 ms multiples (20 ms
    # RTP, 20 ms carrier frames); at most one frame less a sample otherwise.
    setup = {"echo_db": args.echo_db, "delay_ms": args.delay_ms, "snr_db": args.snr_db, "seconds": args.seconds,
             "rir_s": round(len(rir) / RATE, 3), "settle_s": args.settle_s,
             "hold_ms_max": round(1000 * (RATE // 100 - 1) / RATE, 2)}
    report = Report(setup, legs)
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("aec", help="echo cancellation on a simulated speakerphone: ERLE, distortion, CPU",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--echo-db", type=float, default=0.0, help="echo against the caller's speech level (dB)")
    p.add_argument("--delay-ms", type=float, default=150.0, help="loudspeaker to microphone delay (ms)")
    p.add_argument("--snr-db", type=float, default=25.0, help="caller's speech over the room's noise (dB)")
    p.add_argument("--seconds", type=float, default=30.0, help="length of the agent's speech")
    p.add_argument("--settle-s", type=float, default=2.0, help="ERLE is reported from this long after the first word")
    p.add_argument("--speech-rms", type=float, default=0.1, help="speech level (RMS, full scale 1.0)")
    p.add_argument("--json", help="also write the report as JSON here")
    p.set_defaults(func=_main)
