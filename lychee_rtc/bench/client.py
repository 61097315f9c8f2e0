"""A scripted aiortc client: the peer used by the tests and the bench tools.

It sends audio you feed it (48 kHz mono float32, paced as 20 ms frames like a microphone), records
what the server sends back with each frame's RTP-derived sample offset and arrival time, and keeps
every data-channel event.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from lychee_rtc.rtc.codec_threads import limit_codec_threads
from lychee_rtc.aio import cancel_and_wait
from lychee_rtc.rtc.peer import close_peer, quiet_sends_after_close
from lychee_rtc.pcm import FrameResampler

RATE = 48000
FRAME = RATE // 50  # 20 ms: the default; an answer's a=ptime:10 makes it 10 ms, as a browser does


class MicrophoneTrack(MediaStreamTrack):
    """Plays queued samples in real time; silence when nothing is queued."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[np.ndarray] = deque()
        self._queued = 0
        self._t0: float | None = None
        self._n = 0
        self.frame = FRAME  # samples per frame; each frame is one RTP packet
        # Frame index -> monotonic time the frame was handed to the sender (the most recent ones).
        self.send_times: dict[int, float] = {}
        self.max_log = 60 * 50

    def set_frame_ms(self, ms: int) -> None:
        """The packet time, before the first frame is sent."""
        if self._t0 is None:
            self.frame = RATE * ms // 1000
            self.max_log = 60 * 1000 // ms

    def feed(self, samples: np.ndarray) -> float:
        """Queue audio; returns the stream time (s) at which its first sample will be sent."""
        start = (self._n * self.frame + self._queued) / RATE
        samples = np.asarray(samples, dtype=np.float32)
        self._queue.append(samples)
        self._queued += len(samples)
        return start

    @property
    def sent_samples(self) -> int:
        """Samples handed to the sender so far (queued audio and the silence between)."""
        return self._n * self.frame

    def _take(self) -> np.ndarray:
        out = np.zeros(self.frame, dtype=np.float32)
        pos = 0
        while pos < self.frame and self._queue:
            head = self._queue[0]
            k = min(self.frame - pos, len(head))
            out[pos:pos + k] = head[:k]
            pos += k
            self._queued -= k
            if k == len(head):
                self._queue.popleft()
            else:
                self._queue[0] = head[k:]
        return out

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        due = self._t0 + self._n * self.frame / RATE
        if due > now:
            await asyncio.sleep(due - now)
        pcm = self._take()
        pts = self._n * self.frame
        self.send_times[self._n] = time.monotonic()
        self.send_times.pop(self._n - self.max_log, None)
        self._n += 1
        frame = av.AudioFrame.from_ndarray((np.clip(pcm, -1, 1) * 32767).astype(np.int16)[None, :],
                                           format="s16", layout="mono")
        frame.sample_rate = RATE
        frame.pts = pts
        frame.time_base = fractions.Fraction(1, RATE)
        return frame


@dataclass
class ReceivedAudio:
    """Downlink audio placed by RTP timestamp (48 kHz mono)."""

    chunks: list[tuple[int, np.ndarray, float]] = field(default_factory=list)  # (offset, pcm, arrival)

    @property
    def end(self) -> int:
        """Stream position just past the latest sample received (0 before any)."""
        return max((off + len(pcm) for off, pcm, _ in self.chunks[-50:]), default=0)

    def arrived(self, start: int = 0, end: int | None = None) -> int:
        """How many samples of stream positions ``[start, end)`` arrived: less than the span where
        the sender skipped slots (a stall) or packets were lost."""
        end = self.end if end is None else end
        return sum(max(0, min(off + len(pcm), end) - max(off, start)) for off, pcm, _ in self.chunks)

    def joined(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """What arrived for ``[start, end)`` in stream order, the gaps between chunks closed: the
        audio itself, for comparing content (``signal`` keeps the timing, gaps as silence)."""
        end = self.end if end is None else end
        parts = [pcm[max(off, start) - off:min(off + len(pcm), end) - off]
                 for off, pcm, _ in sorted(self.chunks, key=lambda c: c[0]) if off < end and off + len(pcm) > start]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def signal(self, start: int = 0, end: int | None = None) -> np.ndarray:
        if not self.chunks:
            return np.zeros(0, np.float32)
        last = max(off + len(pcm) for off, pcm, _ in self.chunks)
        end = last if end is None else min(end, last)
        out = np.zeros(max(end - start, 0), np.float32)
        for off, pcm, _ in self.chunks:
            a, b = max(off, start), min(off + len(pcm), end)
            if a < b:
                out[a - start:b - start] = pcm[a - off:b - off]
        return out


class LinkImpairment:
    """Drops and delays outgoing RTP packets (not RTCP) to emulate a lossy, jittery uplink."""

    def __init__(self, loss: float = 0.0, jitter_ms: float = 0.0, seed: int = 1) -> None:
        self.loss = loss
        self.jitter_ms = jitter_ms
        self.rng = np.random.default_rng(seed)
        self.sent = 0
        self.dropped = 0

    def install(self, transport) -> None:
        from aiortc.rtp import is_rtcp

        original = transport._send_rtp
        loop = asyncio.get_running_loop()

        async def send(data: bytes) -> None:
            if is_rtcp(data):
                await original(data)
                return
            self.sent += 1
            if self.loss and self.rng.random() < self.loss:
                self.dropped += 1
                return
            if self.jitter_ms:
                delay = float(self.rng.uniform(0, self.jitter_ms)) / 1000.0
                loop.call_later(delay, lambda: loop.create_task(original(data)))
                return
            await original(data)

        transport._send_rtp = send


class RtcClient:
    def __init__(self, base_url: str, *, channel_label: str = "events", codec: str | None = None,
                 jitter_buffer: str = "aiortc", auth_token: str | None = None) -> None:
        limit_codec_threads()
        self.base_url = base_url.rstrip("/")
        self.auth_token = auth_token  # the server key, when the server wants one to create sessions
        self.jitter_buffer = jitter_buffer  # "aiortc" (a stock aiortc caller) or "lowlatency" (ours)
        self.channel_label = channel_label
        self.codec = codec
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = MicrophoneTrack()
        self.received = ReceivedAudio()
        self.on_audio: list[Callable[[np.ndarray], None]] = []  # told of each downlink frame as it arrives
        self.events: list[dict[str, Any]] = []
        self.event_times: list[float] = []
        self.session_id: str | None = None
        self.session_token: str | None = None  # the session's own secret, for its HTTP resource
        self.channel = None
        self._event_signal = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._channel_open = asyncio.Event()

    async def connect(self, session: dict[str, Any] | None = None, resume: dict[str, Any] | None = None) -> None:
        """Offer and apply the answer; ``resume`` ({session_id, session_token, last_seq}) re-attaches a session."""
        body: dict[str, Any] = {"sdp": await self.make_offer(), "type": "offer"}
        if session is not None:
            body["session"] = session
        if resume is not None:
            body["resume"] = resume
        # A resume presents the session's own token (the server key is not needed for it).
        bearer = resume.get("session_token") if resume is not None else None
        bearer = bearer or self.auth_token
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
            async with http.post(f"{self.base_url}/v1/rtc/offer", json=body, headers=headers) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"offer refused: {resp.status} {data}")
        self.session_id = data["session_id"]
        self.session_token = data.get("session_token")
        await self.accept_answer(data["sdp"])

    async def make_offer(self) -> str:
        """Set up the tracks and the data channel; the offer SDP (with gathered candidates)."""
        transceiver = self.pc.addTransceiver(self.mic, direction="sendrecv")
        if self.codec is not None:
            from aiortc import RTCRtpSender

            caps = [c for c in RTCRtpSender.getCapabilities("audio").codecs if c.mimeType.lower() == f"audio/{self.codec.lower()}"]
            transceiver.setCodecPreferences(caps)
        self.channel = self.pc.createDataChannel(self.channel_label)
        self.channel.on("message", self._on_message)
        self.channel.on("open", self._channel_open.set)

        @self.pc.on("track")
        def on_track(track) -> None:
            if self.jitter_buffer != "aiortc":
                from lychee_rtc.config import RtcSettings
                from lychee_rtc.rtc.jitter import install_jitter_buffer

                install_jitter_buffer(self.pc, track, RtcSettings(jitter_buffer=self.jitter_buffer))
            self._tasks.append(asyncio.create_task(self._record(track)))

        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def accept_answer(self, answer_sdp: str, timeout: float = 60.0) -> None:
        """Apply the answer and wait until the data channel is open.

        The answer's a=ptime sets the microphone's packet time (libwebrtc does the same for Opus);
        aiortc itself ignores it.
        """
        ptime = re.search(r"^a=ptime:(\d+)", answer_sdp, re.MULTILINE)
        if ptime and int(ptime.group(1)) in (10, 20):
            self.mic.set_frame_ms(int(ptime.group(1)))
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer_sdp, type="answer"))
        quiet_sends_after_close(self.pc)  # a send after the server closed the path is not an error
        await asyncio.wait_for(self._channel_open.wait(), timeout)

    async def _record(self, track) -> None:
        resampler = FrameResampler("flt", "mono", RATE)
        try:
            while True:
                try:
                    frame = await track.recv()
                except MediaStreamError:
                    return
                arrival = time.monotonic()
                offset = int(frame.pts * frame.time_base * RATE) if frame.pts is not None else 0
                pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in resampler.resample(frame)] or
                                     [np.zeros(0, np.float32)])
                self.received.chunks.append((offset, pcm.astype(np.float32), arrival))
                for listener in self.on_audio:
                    listener(pcm)
        finally:
            resampler.close()

    def _on_message(self, message: str) -> None:
        event = json.loads(message)
        self.events.append(event)
        self.event_times.append(time.monotonic())
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._event_signal:
            self._event_signal.notify_all()

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers that open this session's resource (``/v1/sessions/{id}``)."""
        return {"Authorization": f"Bearer {self.session_token}"} if self.session_token else {}

    def impair_uplink(self, impairment: LinkImpairment) -> None:
        sender = next(s for s in self.pc.getSenders() if s.track is self.mic)
        impairment.install(sender.transport)

    def send(self, event: dict[str, Any] | str) -> None:
        self.channel.send(event if isinstance(event, str) else json.dumps(event))

    def events_of(self, event_type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == event_type]

    async def wait_event(self, event_type: str, timeout: float = 60.0, after: int = 0, **match: Any) -> dict[str, Any]:
        """The first event of ``event_type`` (with ``match`` fields) at index >= ``after``."""

        def find() -> dict[str, Any] | None:
            for e in self.events[after:]:
                if e["type"] == event_type and all(e.get(k) == v for k, v in match.items()):
                    return e
            return None

        async def wait() -> dict[str, Any]:
            async with self._event_signal:
                while (found := find()) is None:
                    await self._event_signal.wait()
                return found

        return await asyncio.wait_for(wait(), timeout)

    async def wait_audio(self, offset: int, timeout: float = 60.0) -> None:
        """Until downlink audio up to stream position ``offset`` (at 48 kHz) has arrived."""
        await self._poll(lambda: self.received.end >= offset, timeout, f"downlink audio up to sample {offset}")

    async def wait_arrived(self, start: int, samples: int, timeout: float = 60.0) -> None:
        """Until ``samples`` samples of downlink audio from stream position ``start`` on have arrived
        (``wait_audio`` counts stream positions, which a sender's skipped slots advance too)."""
        await self._poll(lambda: self.received.arrived(start) >= samples, timeout,
                         f"{samples} downlink samples from position {start}")

    async def wait_sent(self, samples: int, timeout: float = 60.0) -> None:
        """Until the microphone has sent ``samples`` samples in all (the uplink's own clock)."""
        await self._poll(lambda: self.mic.sent_samples >= samples, timeout, f"{samples} uplink samples sent")

    @staticmethod
    async def _poll(done, timeout: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done():
            if loop.time() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        await cancel_and_wait(self._tasks, 5.0)
        await close_peer(self.pc, 30.0)
