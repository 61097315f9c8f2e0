"""``lychee-rtc bench telephony``: mouth-to-ear through a carrier media stream, with a recorded caller.

A carrier emulator speaking Twilio's dialect (base64 mu-law 8 kHz in 20 ms ``media`` frames, paced in
real time; marks echoed when its emulated playout reaches them) dials a server running the loopback
engine and plays a recorded caller: espeak-ng speech by default, or a WAV file. Every 250 ms, the
100 ms of voiced speech starting there is found again in what comes back (normalised matched filter
at 8 kHz). Mouth = when the frame carrying its first sample was handed to the WebSocket, plus its
place in the frame. Ear is reported twice: when the frame carrying it arrived at the carrier
(network and server), and when the carrier's playout reached it (adds the carrier's buffer, which
is the lead we send ahead).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
import subprocess
import time
import wave
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lychee_rtc.bench.carrier import CarrierEmulator
from lychee_rtc.bench.probes import matched_filter, percentile
from lychee_rtc.bench.server_process import cpu_seconds, spawned_server
from lychee_rtc.pcm import PcmResampler

RATE = 8000
SEGMENT_S = 0.1
STEP_S = 0.25
MAX_LATENCY_S = 1.5
THRESHOLD = 0.6
DEFAULT_TEXT = ("Hello, I am calling about my order from last week. It has not arrived yet, and the tracking "
                "page has not changed for three days. Could you tell me where it is, and when I can expect it?")
SID = "MZ00000000000000000000000000000001"
# Twilio's frames (twilio.com/docs/voice/media-streams/websocket-messages), as the emulator plays them.
TWILIO = {
    "audio": {"encoding": "mulaw", "rate": RATE, "transport": "json", "frame_ms": 20},
    "handshake": [
        {"event": "connected", "protocol": "Call", "version": "1.0.0"},
        {"event": "start", "sequenceNumber": "1", "streamSid": SID,
         "start": {"accountSid": "AC0", "streamSid": SID, "callSid": "CA0", "tracks": ["inbound"],
                   "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                   "customParameters": {}}},
    ],
    "media": {"event": "media", "sequenceNumber": "$seq", "streamSid": SID,
              "media": {"track": "inbound", "chunk": "$chunk", "timestamp": "$timestamp", "payload": "$payload"}},
    "mark": {"event": "mark", "sequenceNumber": "$seq", "streamSid": SID, "mark": {"name": "$name"}},
    "dtmf": {"event": "dtmf", "streamSid": SID, "sequenceNumber": "$seq", "dtmf": {"track": "inbound_track",
                                                                                   "digit": "$digit"}},
    "stop": {"event": "stop", "sequenceNumber": "$seq", "streamSid": SID, "stop": {}},
    "cleared": None,
    "marks_echoed_on_clear": True,
    "outbound": {"media": {"event": "media", "streamSid": SID, "media": {"payload": "$payload"}},
                 "mark": {"event": "mark", "streamSid": SID, "mark": {"name": "$name"}},
                 "clear": {"event": "clear", "streamSid": SID}},
}


@dataclass
class TelephonyLatencyReport:
    url: str
    caller_s: float
    segments: int
    found: int
    arrival_p50_ms: float | None
    arrival_p90_ms: float | None
    arrival_p99_ms: float | None
    playout_p50_ms: float | None
    playout_p90_ms: float | None
    playout_p99_ms: float | None
    server_cpu_percent: float | None = None
    server_counters: dict[str, Any] | None = None
    arrival_ms: list[float] = field(default_factory=list)


def speech(text: str, rate: int = RATE) -> np.ndarray:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SystemExit("espeak-ng is needed to synthesise the caller (or pass --wav)")
    data = subprocess.run([exe, "-v", "en", "-s", "160", "--stdout", text], capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(data)) as w:
        src = w.getframerate()
    pcm = np.frombuffer(data[44:], dtype=np.int16).astype(np.float32) / 32768.0  # streamed WAV: data at 44
    return _resample(pcm, src, rate)


def read_wav(path: str, rate: int = RATE) -> np.ndarray:
    with wave.open(path) as w:
        if w.getsampwidth() != 2:
            raise SystemExit(f"{path}: only 16-bit PCM WAV files are supported")
        channels, src = w.getnchannels(), w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    return _resample(pcm.reshape(-1, channels).mean(axis=1), src, rate)


def _resample(pcm: np.ndarray, src: int, rate: int) -> np.ndarray:
    r = PcmResampler(src, rate)
    return np.concatenate([r.process(pcm), r.flush()])


def analyse(caller: np.ndarray, lead: int, phone: CarrierEmulator) -> tuple[int, list[float], list[float]]:
    """(voiced segments, arrival latencies ms, playout latencies ms) of the segments found again."""
    audio = phone.log.audio
    if not audio:
        return 0, [], []
    offsets = np.cumsum([0] + [len(a.samples) for a in audio])
    received = np.concatenate([a.samples for a in audio])
    arrivals = np.array([a.arrival for a in audio])
    sends = dict(phone.send_times)
    seg, step, frame = int(SEGMENT_S * RATE), int(STEP_S * RATE), RATE // 50
    rms = np.sqrt(np.convolve(caller ** 2, np.ones(seg) / seg, mode="valid"))
    loud = 0.1 * float(rms.max()) if len(rms) else 0.0
    voiced, arrival_ms, playout_ms = 0, [], []
    for start in range(0, len(caller) - seg, step):
        if rms[start] < loud:
            continue
        voiced += 1
        stream = lead + start
        sent = sends.get(stream - stream % frame)
        if sent is None:
            continue
        mouth = sent + (stream % frame) / RATE
        first = int(np.searchsorted(arrivals, mouth))
        last = int(np.searchsorted(arrivals, mouth + MAX_LATENCY_S))
        if first >= len(audio):
            continue
        window = received[offsets[first]:offsets[min(last + 1, len(audio))]]
        if len(window) < seg:
            continue
        score = matched_filter(window, caller[start:start + seg])
        hits = np.flatnonzero(score >= THRESHOLD)
        if len(hits) == 0:
            continue
        at = offsets[first] + int(hits[0] + np.argmax(score[hits[0]:hits[0] + seg]))
        k = int(np.searchsorted(offsets, at, side="right")) - 1
        into = (at - offsets[k]) / RATE
        arrival_ms.append(1000.0 * (audio[k].arrival + into - mouth))
        playout_ms.append(1000.0 * (audio[k].play_start + into - mouth))
    return voiced, arrival_ms, playout_ms


async def measure(url: str, caller: np.ndarray, token: str, server_pid: int | None = None) -> TelephonyLatencyReport:
    from lychee_rtc.telephony.auth import TWILIO_SIGNATURE, twilio_signature

    ws_url = url.replace("http://", "ws://").replace("https://", "wss://") + "/v1/telephony/ws"
    phone = CarrierEmulator(ws_url, TWILIO, headers={TWILIO_SIGNATURE: twilio_signature(token, ws_url)})
    await phone.connect()
    lead = RATE // 2
    cpu0, wall0 = (cpu_seconds(server_pid), time.monotonic()) if server_pid else (None, None)
    try:
        await phone.play(np.concatenate([np.zeros(lead, np.float32), caller, np.zeros(RATE, np.float32)]))
        await asyncio.sleep(MAX_LATENCY_S)
        cpu = 100.0 * (cpu_seconds(server_pid) - cpu0) / (time.monotonic() - wall0) if server_pid else None
        counters = None
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/sessions") as resp:
                if resp.status == 200:
                    sessions = (await resp.json())["sessions"]
                    counters = sessions[0]["counters"] if sessions else None
    finally:
        await phone.close()
    voiced, arrival, playout = analyse(caller, lead, phone)
    return TelephonyLatencyReport(
        url, round(len(caller) / RATE, 2), voiced, len(arrival),
        percentile(arrival, 50), percentile(arrival, 90), percentile(arrival, 99),
        percentile(playout, 50), percentile(playout, 90), percentile(playout, 99),
        cpu, counters, [round(x, 2) for x in arrival])


def format_report(r: TelephonyLatencyReport) -> str:
    f = lambda v: f"{v:8.1f}" if v is not None else f"{'-':>8}"  # noqa: E731
    lines = [f"mouth-to-ear through {r.url}/v1/telephony/ws (Twilio dialect, mu-law 8 kHz, 20 ms frames; "
             f"{r.caller_s:.1f} s caller, {r.found}/{r.segments} speech segments found)",
             f"{'ear at':<22}{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}",
             f"{'carrier (arrival)':<22}{f(r.arrival_p50_ms)}{f(r.arrival_p90_ms)}{f(r.arrival_p99_ms)}",
             f"{'carrier playout':<22}{f(r.playout_p50_ms)}{f(r.playout_p90_ms)}{f(r.playout_p99_ms)}"]
    if r.server_cpu_percent is not None:
        lines.append(f"server CPU: {r.server_cpu_percent:.1f} % of one core (one call)")
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    caller = read_wav(args.wav) if args.wav else speech(args.text)
    if args.url:
        report = await measure(args.url, caller, args.twilio_token)
    else:
        env = {"LYCHEE_RTC_TELEPHONY__TWILIO__AUTH_TOKEN": args.twilio_token}
        if args.lead_ms is not None:
            env["LYCHEE_RTC_TELEPHONY__LEAD_MS"] = str(args.lead_ms)
        async with spawned_server(args.config, env) as (url, pid):
            report = await measure(url, caller, args.twilio_token, server_pid=pid)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0 if report.found else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("telephony", help="mouth-to-ear of a phone call through /v1/telephony/ws (loopback engine)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one with --config)")
    p.add_argument("--config", default="loopback",
                   help="profile for the spawned server (default: configs/loopback.yaml)")
    p.add_argument("--twilio-token", default="bench-twilio-auth-token",
                   help="Twilio auth token the server checks signatures with (set on a spawned server)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="what the synthesised caller says (espeak-ng)")
    p.add_argument("--wav", help="a recorded caller (16-bit PCM WAV, any rate) instead of synthesised speech")
    p.add_argument("--lead-ms", type=int, help="telephony.lead_ms of the spawned server (the carrier's cushion)")
    p.add_argument("--json", help="also write the report as JSON here")
    p.set_defaults(func=_main)
