"""``lychee-rtc bench recording-alignment``: do the recording's two channels keep the caller's time?

A recording puts what the caller said (left) and what the caller heard (right) on one clock, so
that a barge-in shows where it happened. It does if a sound the caller made at time M and a sound
they heard at time E lie ``E - M`` apart in it. The bench checks exactly that: a server with the
loopback engine (it sends each input window straight back) records the call, a caller sends a chirp
every ``--interval`` seconds and hears it come back, and each chirp is found again in both channels
of the recording (read back with libsndfile). Per chirp, the alignment error is::

    (where the recording has it heard - where the recording has it said) - (E - M)

M is when the chirp's first sample was spoken: the caller's audio goes out in 20 ms frames, each
handed to the transport when its last sample is in, so a sample is spoken a frame before its
frame's hand-over plus its place in the frame. E is when its first sample reaches the caller's ear:
the frame that carries it leaves the caller's receiver (WebRTC: aiortc's track; a carrier: the
emulated playout) plus its place in that frame. Callers: an aiortc peer over WebRTC (Opus), or the
carrier emulator (Twilio's frames, mu-law 8 kHz; ``--transport carrier``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from lychee_rtc.bench.probes import SIGNATURES, chirp, find_onsets
from lychee_rtc.bench.server_process import spawned_server

REC_RATE = 48000
TWILIO_TOKEN = "bench-twilio-auth-token"


@dataclass
class AlignmentReport:
    transport: str
    probes: int
    found: int
    error_ms_p50: float | None
    error_ms_p10: float | None
    error_ms_p90: float | None
    error_ms_max_abs: float | None
    mouth_to_ear_ms_p50: float | None
    # Each channel against the caller's own time (the recording's t = 0 taken from its meta's wall
    # clock and this machine's monotonic clock): caller channel minus when it was said, agent
    # channel minus when it was heard. The error is the second less the first.
    said_offset_ms_p50: float | None = None
    heard_offset_ms_p50: float | None = None
    # What the recording's stamps took out (its meta's ``alignment``: codec delay, transit estimate).
    compensation: dict = field(default_factory=dict)
    errors_ms: list[float] = field(default_factory=list)


def probe(k: int, rate: int) -> np.ndarray:
    f0, f1 = SIGNATURES[k % len(SIGNATURES)]
    return chirp(f0=f0, f1=f1, rate=rate)


def schedule(count: int, spacing: int, lead: int, rate: int) -> tuple[np.ndarray, list[int]]:
    offsets = [lead + k * spacing for k in range(count)]
    audio = np.zeros(lead + count * spacing, np.float32)
    for k, off in enumerate(offsets):
        p = probe(k, rate)
        audio[off:off + len(p)] = p
    return audio, offsets


def frame_time(sample: int, times: dict[int, float], frame: int, rate: int) -> float | None:
    """When ``sample`` was spoken: a frame before its frame's hand-over, plus its place in the frame."""
    handed = times.get(sample // frame)
    return None if handed is None else handed - frame / rate + (sample % frame) / rate


def chunk_time(sample: int, chunks: list[tuple[int, int, float]], rate: int) -> float | None:
    """When ``sample`` of what was received reached the ear: its chunk's time plus its place in it."""
    for offset, length, at in chunks:
        if offset <= sample < offset + length:
            return at + (sample - offset) / rate
    return None


def heard_onsets(signal: np.ndarray, rate: int, count: int) -> dict[int, list[int]]:
    return {s: find_onsets(signal, probe(s, rate)) for s in range(min(count, len(SIGNATURES)))}


def in_order(onsets: dict[int, list[int]], k: int) -> int | None:
    """The onset of probe ``k``: the (k // 4)-th of its signature."""
    found = onsets.get(k % len(SIGNATURES), [])
    j = k // len(SIGNATURES)
    return found[j] if j < len(found) else None


def placed(onsets: dict[int, list[int]], times: list[float | None], interval_s: float) -> list[float | None]:
    """Each probe's time in the recording (s): the onset of its signature nearest to where the
    caller's time ``times[k]`` lands on the recording's clock. That offset is first taken from the
    probes in order (the median, so a lost or extra detection does not move it), then each probe
    takes the onset nearest to it, if within a quarter of the interval."""
    guesses = [in_order(onsets, k) / REC_RATE - t for k, t in enumerate(times)
               if t is not None and in_order(onsets, k) is not None]
    if not guesses:
        return [None] * len(times)
    offset = float(np.median(guesses))
    out: list[float | None] = []
    for k, t in enumerate(times):
        near = [o / REC_RATE for o in onsets.get(k % len(SIGNATURES), [])]
        best = min(near, key=lambda x: abs(x - (t + offset)), default=None) if t is not None else None
        out.append(best if best is not None and abs(best - (t + offset)) < interval_s / 4 else None)
    return out


def read_recording(path: Path) -> np.ndarray:
    try:
        import soundfile
    except ImportError as exc:  # the test extra has it
        raise SystemExit("bench recording-alignment reads the recording with libsndfile: pip install soundfile") from exc
    data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    assert rate == REC_RATE
    return data


async def wait_complete(meta: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if meta.exists() and json.loads(meta.read_text()).get("status") in ("complete", "failed"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the recording did not complete")
        await asyncio.sleep(0.1)


async def webrtc_call(url: str, count: int, interval_s: float, jitter_buffer: str = "lowlatency",
                      ) -> tuple[str, list[float | None], list[float | None]]:
    """(session id, mouth and ear time of each probe)."""
    from lychee_rtc.bench.client import RATE, RtcClient

    client = RtcClient(url, jitter_buffer=jitter_buffer)
    await client.connect()
    try:
        audio, offsets = schedule(count, int(interval_s * RATE), RATE, RATE)
        base = round(client.mic.feed(audio) * RATE)
        await client.wait_sent(base + len(audio))
        await asyncio.sleep(1.5)
        signal = client.received.signal()
        chunks = sorted((off, len(pcm), at) for off, pcm, at in client.received.chunks)
        onsets = heard_onsets(signal, RATE, count)
        mouths = [frame_time(base + off, client.mic.send_times, client.mic.frame, RATE) for off in offsets]
        ears = []
        for k in range(count):
            at = in_order(onsets, k)
            ears.append(None if at is None else chunk_time(at, chunks, RATE))
        return client.session_id, mouths, ears
    finally:
        await client.close()


async def carrier_call(url: str, count: int, interval_s: float) -> tuple[str, list[float | None], list[float | None]]:
    from lychee_rtc.bench.carrier import CarrierEmulator
    from lychee_rtc.bench.telephony import TWILIO
    from lychee_rtc.telephony.auth import TWILIO_SIGNATURE, twilio_signature

    rate = 8000
    ws_url = url.replace("http://", "ws://") + "/v1/telephony/ws"
    phone = CarrierEmulator(ws_url, TWILIO, headers={TWILIO_SIGNATURE: twilio_signature(TWILIO_TOKEN, ws_url)})
    await phone.connect()
    try:
        audio, offsets = schedule(count, int(interval_s * rate), rate, rate)
        await phone.play(np.concatenate([audio, np.zeros(rate, np.float32)]))
        await asyncio.sleep(1.0)
        frame = rate * phone.frame_ms // 1000
        handed = {sample // frame: t for sample, t in phone.send_times}
        received = np.concatenate([a.samples for a in phone.log.audio]) if phone.log.audio else np.zeros(0)
        chunks, pos = [], 0
        for a in phone.log.audio:
            chunks.append((pos, len(a.samples), a.play_start))
            pos += len(a.samples)
        onsets = heard_onsets(received, rate, count)
        mouths = [frame_time(off, handed, frame, rate) for off in offsets]
        ears = []
        for k in range(count):
            at = in_order(onsets, k)
            ears.append(None if at is None else chunk_time(at, chunks, rate))
        session_id = await _only_session(url)
        return session_id, mouths, ears
    finally:
        await phone.close()


async def _only_session(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/recordings") as resp:
            body = await resp.json()
    return body["recordings"][-1]["session_id"]


async def measure(transport: str, count: int, interval_s: float, directory: Path, lead_ms: float | None = None,
                  jitter_buffer: str = "lowlatency", delay_ms: float = 0.0) -> AlignmentReport:
    env = {"LYCHEE_RTC_RECORDING__ENABLED": "true", "LYCHEE_RTC_RECORDING__DIRECTORY": str(directory),
           "LYCHEE_RTC_TELEPHONY__TWILIO__AUTH_TOKEN": TWILIO_TOKEN, "PYTHONPATH": os.pathsep.join(sys.path)}
    if lead_ms is not None:
        env["LYCHEE_RTC_RTC__PASSTHROUGH_LEAD_MS"] = str(lead_ms)
    async with spawned_server("configs/loopback.yaml", env) as (url, _):
        if transport == "webrtc" and delay_ms:
            from lychee_rtc.bench.impairment import ImpairedPath, PathSettings

            # Media and RTCP both go through the relay, each way delayed alike. It stays up until the
            # recording is complete: the caller's hang-up (DTLS close) goes through it too.
            async with ImpairedPath(url, PathSettings.symmetric(delay_up_ms=delay_ms, delay_down_ms=delay_ms)) as path:
                session_id, mouths, ears = await webrtc_call(path.url, count, interval_s, jitter_buffer)
                await wait_complete(directory / session_id / "meta.json")
        else:
            if transport == "webrtc":
                session_id, mouths, ears = await webrtc_call(url, count, interval_s, jitter_buffer)
            else:
                session_id, mouths, ears = await carrier_call(url, count, interval_s)
            await wait_complete(directory / session_id / "meta.json")
    audio = read_recording(directory / session_id / "audio.ogg")
    said = placed(heard_onsets(audio[:, 0], REC_RATE, count), mouths, interval_s)
    heard = placed(heard_onsets(audio[:, 1], REC_RATE, count), ears, interval_s)
    meta = json.loads((directory / session_id / "meta.json").read_text())
    t0 = meta["started_at"] - (time.time() - time.monotonic())
    errors, m2e, said_off, heard_off = [], [], [], []
    for k in range(count):
        c, a = said[k], heard[k]
        if None in (c, a, mouths[k], ears[k]):
            continue
        m2e.append(1000.0 * (ears[k] - mouths[k]))
        errors.append(1000.0 * ((a - c) - (ears[k] - mouths[k])))
        said_off.append(1000.0 * (c - (mouths[k] - t0)))
        heard_off.append(1000.0 * (a - (ears[k] - t0)))
    pct = lambda q: round(float(np.percentile(errors, q)), 2) if errors else None  # noqa: E731
    return AlignmentReport(transport, count, len(errors), pct(50), pct(10), pct(90),
                           round(float(np.max(np.abs(errors))), 2) if errors else None,
                           round(float(np.median(m2e)), 1) if m2e else None,
                           round(float(np.median(said_off)), 2) if said_off else None,
                           round(float(np.median(heard_off)), 2) if heard_off else None, meta.get("alignment", {}),
                           [round(e, 2) for e in errors])


async def _main(args: argparse.Namespace) -> int:
    reports = []
    for transport in args.transport.split(","):
        with tempfile.TemporaryDirectory(prefix="lychee-rec-align-") as tmp:
            report = await measure(transport, args.probes, args.interval, Path(tmp), args.lead_ms,
                                   args.client_jitter_buffer, args.delay_ms)
        reports.append(report)
        print(f"{transport}: {report.found}/{report.probes} chirps; alignment error p50 {report.error_ms_p50} ms "
              f"(p10 {report.error_ms_p10}, p90 {report.error_ms_p90}, max |e| {report.error_ms_max_abs}); "
              f"mouth-to-ear p50 {report.mouth_to_ear_ms_p50} ms; caller channel {report.said_offset_ms_p50:+} ms "
              f"from when it was said, agent channel {report.heard_offset_ms_p50:+} ms from when it was heard; "
              f"compensation {json.dumps(report.compensation)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in reports], indent=2))
    return 0 if all(r.found for r in reports) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recording-alignment", help="whether a recording's caller and agent channels keep the caller's time",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", default="webrtc,carrier", help="webrtc, carrier or both (comma-separated)")
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between chirps")
    p.add_argument("--lead-ms", type=float, help="rtc.passthrough_lead_ms of the spawned server (how early a "
                   "passthrough engine's frame may leave; 0: on its slot, as a prebuffered answer does)")
    p.add_argument("--client-jitter-buffer", choices=["lowlatency", "aiortc"], default="lowlatency",
                   help="the WebRTC caller's receive path: ours (default, near the wire) or aiortc's stock buffer, "
                        "whose own delay no server can see")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="WebRTC: put the call through a UDP relay that delays every packet this much each way "
                        "(a longer path the recording must take out by RTCP's round trip)")
    p.add_argument("--json", help="also write the reports as JSON here")
    p.set_defaults(func=lambda args: asyncio.run(_main(args)))
