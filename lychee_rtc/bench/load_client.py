"""The load generator of ``lychee-rtc bench load``: many cheap WebRTC calls in one process.

Each call is a real aiortc peer (ICE, DTLS, SRTP, the ``events`` data channel) that costs as little
as a WebRTC peer in Python can:

* **Uplink: pre-encoded Opus.** What the calls say is encoded once per process before any call
  connects (libopus, 20 ms packets); each call's track hands aiortc's sender those packets
  (``av.Packet``), which it only packetizes: no encoder, no resampler, no audio level per packet.
* **Downlink: no decoding while the calls run.** Each call's receiver gets a stand-in for its
  jitter buffer that notes every packet (sequence number, RTP timestamp, payload, arrival time)
  and hands nothing to aiortc's decoder thread. After the measured span, the notes of the probes'
  span are decoded and the probes found in them.

``--mode loopback``: low-level noise with a 20 ms chirp every ``--interval`` seconds, staggered
across calls (the probes of ``bench latency``); mouth = when the packet carrying the chirp's first
sample was handed to the sender, ear = when the packet carrying it back arrived at the client
(before any jitter buffer: the server's own delay, and what load adds to it, are not hidden by a
client's playout buffer). ``--mode speech``: a spoken utterance and a pause, over and over, so an
echo engine hears turns and answers them; no probes.

Driven over stdin/stdout by the bench: it encodes its calls' scripts, connects the calls, prints
one JSON line, waits for a line ``go`` on stdin, plays the scripts (probes from ``--lead`` seconds
after ``go``, for ``--span`` seconds), prints a line when they have played, and after the next line
on stdin hangs up and prints one JSON line of results.
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import aiohttp
import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from lychee_rtc.bench.client import ReceivedAudio
from lychee_rtc.bench.latency import analyse, probe_schedule
from lychee_rtc.rtc import opus

RATE = 48000
FRAME = 960  # 20 ms packets, what every profile asks for
TIME_BASE = fractions.Fraction(1, RATE)
CONNECTS_AT_ONCE = 8  # ICE and DTLS handshakes in flight together
NOISE_RMS = 0.01  # the uplink between probes: -40 dBFS noise keeps the codecs working as for speech
TAIL_S = 1.5  # after the last probe, for its echo to come back


def encode(pcm: np.ndarray, bitrate: int = 32000) -> list[bytes]:
    """``pcm`` (48 kHz mono float) as one Opus packet per 20 ms, as a browser sends a microphone."""
    encoder = opus.OpusEncoder(RATE, "voip", bitrate)
    pcm = np.pad(pcm, (0, -len(pcm) % FRAME))
    pcm16 = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
    try:
        return [encoder.encode(pcm16[i:i + FRAME]) for i in range(0, len(pcm16), FRAME)]
    finally:
        encoder.close()


class PacketTrack(MediaStreamTrack):
    """Sends pre-encoded packets in real time: ``idle`` over and over, ``script`` once from a frame on."""

    kind = "audio"

    def __init__(self, idle: list[bytes]) -> None:
        super().__init__()
        self.idle = idle
        self.script: list[bytes] = []
        self.script_at: int | None = None  # frame index where the script starts
        self.send_times: dict[int, float] = {}  # frame index -> when it was handed to the sender
        self.frame = FRAME
        self._t0: float | None = None
        self._n = 0

    def play(self, script: list[bytes], lead_frames: int) -> int:
        """Play ``script`` ``lead_frames`` from now; returns the stream sample where it starts."""
        self.script, self.script_at = script, self._n + lead_frames
        return self.script_at * FRAME

    async def recv(self) -> av.Packet:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        due = self._t0 + self._n * FRAME / RATE
        if due > now:
            await asyncio.sleep(due - now)
        n, self._n = self._n, self._n + 1
        k = n - self.script_at if self.script_at is not None else -1
        payload = self.script[k] if 0 <= k < len(self.script) else self.idle[n % len(self.idle)]
        if 0 <= k < len(self.script):
            self.send_times[n] = time.monotonic()
        packet = av.Packet(payload)
        packet.pts, packet.time_base = n * FRAME, TIME_BASE
        return packet


class ArrivalLog:
    """Stands in for a receiver's jitter buffer: notes each packet, decodes nothing (see module doc)."""

    capacity = 16

    def __init__(self) -> None:
        self.recording = False
        self.packets: list[tuple[int, int, bytes, float]] = []  # (sequence number, timestamp, payload, arrival)
        self.received = 0

    def add(self, packet) -> tuple[bool, None]:
        self.received += 1
        if self.recording:
            self.packets.append((packet.sequence_number, packet.timestamp, packet._data, time.monotonic()))
        return False, None


@dataclass
class DownlinkGaps:
    lost_packets: int = 0  # sequence numbers that never came
    skipped_ms: float = 0.0  # RTP time the sender jumped over (a stalled server skips its slots)


@dataclass
class CallResult:
    session_id: str
    latencies_ms: list[float | None]
    gaps: DownlinkGaps
    received: int


def downlink_gaps(packets: list[tuple[int, int, bytes, float]]) -> DownlinkGaps:
    gaps = DownlinkGaps()
    ordered = sorted(packets, key=lambda p: p[3])
    for (seq0, ts0, _, _), (seq1, ts1, _, _) in zip(ordered, ordered[1:]):
        missing = (seq1 - seq0 - 1) % 65536
        if missing < 1000:
            gaps.lost_packets += missing
            jump = ((ts1 - ts0) % 2**32) - (missing + 1) * FRAME
            if 0 < jump < 10 * RATE:
                gaps.skipped_ms += 1000.0 * jump / RATE
    return gaps


def received_audio(packets: list[tuple[int, int, bytes, float]]) -> ReceivedAudio:
    """The noted packets decoded, placed by RTP timestamp (what ``bench.latency.analyse`` reads)."""
    audio = ReceivedAudio()
    if not packets:
        return audio
    decoder = opus.OpusDecoder(RATE)
    first = packets[0][1]
    try:
        for _, ts, payload, arrival in sorted(packets, key=lambda p: (p[1] - first) % 2**32):
            try:
                pcm = decoder.decode(payload)
            except opus.OpusError:
                continue
            audio.chunks.append(((ts - first) % 2**32, pcm, arrival))
    finally:
        decoder.close()
    return audio


class LoadCall:
    def __init__(self, url: str, idle: list[bytes], token: str | None) -> None:
        self.url = url
        self.token = token
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.track = PacketTrack(idle)
        self.log = ArrivalLog()
        self.session_id = ""
        self.events = 0
        self.starts: list[int] = []

    async def connect(self, timeout_s: float = 60.0) -> None:
        self.pc.addTransceiver(self.track, direction="sendrecv")
        channel = self.pc.createDataChannel("events")
        opened = asyncio.Event()
        channel.on("open", opened.set)
        channel.on("message", self._on_event)

        @self.pc.on("track")
        def on_track(track) -> None:
            for transceiver in self.pc.getTransceivers():
                if transceiver.receiver is not None and transceiver.receiver.track is track:
                    transceiver.receiver._RTCRtpReceiver__jitter_buffer = self.log

        await self.pc.setLocalDescription(await self.pc.createOffer())
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        body = {"sdp": self.pc.localDescription.sdp, "type": "offer"}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.url}/v1/rtc/offer", json=body, headers=headers) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"offer refused: {resp.status} {data.get('error', data)}")
        self.session_id = data["session_id"]
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=data["sdp"], type="answer"))
        await asyncio.wait_for(opened.wait(), timeout_s)

    def _on_event(self, message: str) -> None:
        self.events += 1  # counted, not parsed: the server's cost of sending them is what is measured

    def result(self, interval_s: float) -> CallResult:
        latencies: list[float | None] = []
        if self.starts:
            client = SimpleNamespace(received=received_audio(self.log.packets),
                                     mic=SimpleNamespace(send_times=self.track.send_times, frame=FRAME))
            latencies = [None if x is None else round(x, 2) for x in analyse(client, self.starts, interval_s)]
        return CallResult(self.session_id, latencies, downlink_gaps(self.log.packets), self.log.received)

    async def close(self) -> None:
        await self.pc.close()


@dataclass
class ClientReport:
    calls: int
    failed: list[str] = field(default_factory=list)
    results: list[CallResult] = field(default_factory=list)


def _script(mode: str, span_s: float, interval_s: float, index: int, calls: int, speech: np.ndarray | None,
            rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    if mode == "speech":
        assert speech is not None
        return speech, []
    spacing = int(interval_s * RATE)
    count = max(1, int(span_s / interval_s))
    # Stagger the calls' probes so they do not all hit the server at the same instant.
    audio, offsets = probe_schedule(count, spacing, lead=int(index * spacing / max(calls, 1)))
    audio = audio + rng.normal(0, NOISE_RMS, len(audio)).astype(np.float32)
    return audio, offsets


async def run(args: argparse.Namespace) -> ClientReport:
    rng = np.random.default_rng(args.seed)
    speech = None
    if args.mode == "speech":
        from lychee_rtc.bench.telephony import read_wav

        utterance = read_wav(args.wav, RATE)
        speech = np.concatenate([utterance, np.zeros(int(args.pause_s * RATE), np.float32)])
        speech = speech + rng.normal(0, NOISE_RMS / 10, len(speech)).astype(np.float32)
        idle = encode(speech)
    else:
        idle = encode(rng.normal(0, NOISE_RMS, RATE).astype(np.float32))
    report = ClientReport(args.calls)
    calls = [LoadCall(args.url, idle, args.token) for _ in range(args.calls)]
    scripts: list[tuple[list[bytes], list[int]]] = []
    for i in range(args.calls):  # encoded now: never on the event loop while calls run
        audio, offsets = _script(args.mode, args.span, args.interval, args.first_index + i, args.total_calls,
                                 speech, rng)
        scripts.append((encode(audio) if offsets else [], offsets))
    gate = asyncio.Semaphore(CONNECTS_AT_ONCE)

    async def connect(call: LoadCall) -> None:
        async with gate:
            await call.connect()

    outcomes = await asyncio.gather(*(connect(c) for c in calls), return_exceptions=True)
    live = [(c, s) for c, s, o in zip(calls, scripts, outcomes) if not isinstance(o, BaseException)]
    report.failed = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
    print(json.dumps({"ready": len(live), "failed": report.failed}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for call, (script, offsets) in live:
        base = call.track.play(script, int(args.lead * RATE / FRAME)) if script else 0
        call.starts = [base + off for off in offsets]
        call.log.recording = True
    await asyncio.sleep(args.lead + args.span + TAIL_S)
    for call, _ in live:
        call.log.recording = False
    # The bench reads the server's counters of these calls before they hang up.
    print(json.dumps({"played": True}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await asyncio.gather(*(c.close() for c, _ in live), return_exceptions=True)
    report.results = [c.result(args.interval) for c, _ in live]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--calls", type=int, required=True)
    parser.add_argument("--mode", choices=("loopback", "speech"), default="loopback")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between a call's probes")
    parser.add_argument("--lead", type=float, default=3.0, help="seconds from go to the first probe")
    parser.add_argument("--span", type=float, default=10.0, help="seconds of probes")
    parser.add_argument("--first-index", type=int, default=0, help="this process's first call among all")
    parser.add_argument("--total-calls", type=int, default=0, help="calls over all load processes")
    parser.add_argument("--wav", help="--mode speech: the utterance (16-bit PCM WAV)")
    parser.add_argument("--pause-s", type=float, default=3.0, help="--mode speech: silence after each utterance")
    parser.add_argument("--token", help="the server key, if the server wants one")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    args.total_calls = args.total_calls or args.calls
    report = asyncio.run(run(args))
    print(json.dumps(asdict(report)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
