"""A cloud carrier's side of a media-stream WebSocket, for tests and ``lychee-rtc bench telephony``.

It dials the server the way a carrier does: the carrier's handshake and start frames, the caller's
audio in the carrier's frames paced in real time, keypad digits, ``stop``. It also plays the role of
the carrier's playout buffer: audio it receives is "played" in real time from its arrival, a mark
(``mark``, ``checkpoint``, ``notify``) is echoed when the playout reaches it, and a flush empties the
buffer, echoing pending marks at once where the carrier does (Twilio, Telnyx) or dropping them.

The carrier's frames come from a spec (a dict, e.g. one of the JSON fixtures in ``tests/``) holding
templates: ``$name`` in a string is filled in (a whole ``"#name"`` as a number) and, in the templates of
what the server sends (``outbound``), ``"$name"`` captures whatever is there; everything else must
match exactly, so a frame of the wrong shape is caught.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from lychee_rtc.aio import spawn_kept
from lychee_rtc.telephony.g711 import g711_decode, g711_encode, pcm16_decode, pcm16_encode


PLACEHOLDER = re.compile(r"\$([A-Za-z_]+)")


def fill(template: Any, values: dict[str, Any]) -> Any:
    if isinstance(template, dict):
        return {k: fill(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [fill(v, values) for v in template]
    if isinstance(template, str):
        if template[:1] == "#" and template[1:] in values:
            return values[template[1:]]
        return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), template)
    return template


def match(template: Any, message: Any, captures: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Captures of ``$name`` placeholders if ``message`` has exactly the template's shape, else None."""
    captures = {} if captures is None else captures
    if isinstance(template, str) and template.startswith("$"):
        captures[template[1:]] = message
        return captures
    if isinstance(template, dict):
        if not isinstance(message, dict) or set(template) != set(message):
            return None
        for key, value in template.items():
            if match(value, message[key], captures) is None:
                return None
        return captures
    return captures if template == message else None


@dataclass
class ReceivedAudio:
    arrival: float  # when the frame reached the carrier
    play_start: float  # when the carrier's playout reached it
    samples: np.ndarray
    cut_at: float | None = None  # a flush discarded what had not played by then


@dataclass
class CarrierLog:
    audio: list[ReceivedAudio] = field(default_factory=list)
    marks_received: list[tuple[float, str]] = field(default_factory=list)
    marks_echoed: list[tuple[float, str, bool]] = field(default_factory=list)  # (time, name, because of a clear)
    clears: list[float] = field(default_factory=list)
    unexpected: list[Any] = field(default_factory=list)  # server frames matching no outbound template
    close_code: int | None = None


class CarrierEmulator:
    def __init__(self, url: str, spec: dict[str, Any], headers: dict[str, str] | None = None,
                 values: dict[str, Any] | None = None) -> None:
        self.url = url
        self.spec = spec
        self.headers = headers or {}
        self.values = values or {}  # fills the spec's other placeholders (e.g. a token in extraHeaders)
        self.encoding = spec["audio"]["encoding"]
        self.rate = int(spec["audio"]["rate"])
        self.binary_audio = spec["audio"].get("transport") == "binary"
        self.frame_ms = int(spec["audio"].get("frame_ms", 20))
        self.log = CarrierLog()
        self.send_times: list[tuple[int, float]] = []  # (stream sample offset, time the frame was sent)
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task | None = None
        self._play_clock = 0.0
        self._pending_marks: list[tuple[str, asyncio.TimerHandle]] = []
        self._seq = 0
        self._sent_samples = 0
        self.closed = asyncio.Event()
        self._replies: set[asyncio.Task] = set()  # replies sent from a timer or the reader, in flight

    # --- connection ------------------------------------------------------------------------------

    async def connect(self, handshake: bool = True) -> None:
        self._http = aiohttp.ClientSession()
        try:
            self._ws = await self._http.ws_connect(self.url, headers=self.headers, autoping=True)
        except BaseException:
            await self._http.close()
            raise
        self._reader = asyncio.create_task(self._read())
        if handshake:
            for frame in self.spec["handshake"]:
                await self.send_json(fill(frame, self._values()))

    async def close(self) -> None:
        if self._ws is not None and not self._ws.closed:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.wait([self._reader], timeout=10)
        for _, timer in self._pending_marks:
            timer.cancel()
        if self._replies:
            await asyncio.wait(list(self._replies), timeout=10)
        if self._http is not None:
            await self._http.close()

    async def send_json(self, frame: Any) -> None:
        assert self._ws is not None
        await self._ws.send_str(json.dumps(frame))

    def _reply(self, frame: Any) -> None:
        """Send ``frame`` without waiting for it (from a timer or the reader). The server may close the
        stream while it is on its way, as a real carrier's reply is then lost; so is this one, and not left
        as an error on a task no one awaits. Anything else is reported as such a task's would be."""
        spawn_kept(self.send_json(frame), self._replies, "a carrier emulator's reply", expected=(ConnectionError,))

    async def send_raw(self, data: str | bytes) -> None:
        assert self._ws is not None
        if isinstance(data, bytes):
            await self._ws.send_bytes(data)
        else:
            await self._ws.send_str(data)

    def _values(self, **extra: Any) -> dict[str, Any]:
        self._seq += 1
        return {**self.values, "seq": self._seq, **extra}

    # --- the caller ------------------------------------------------------------------------------

    def encode(self, samples: np.ndarray) -> bytes:
        return pcm16_encode(samples) if self.encoding == "pcm16" else g711_encode(samples, self.encoding)

    def decode(self, data: bytes) -> np.ndarray:
        return pcm16_decode(data) if self.encoding == "pcm16" else g711_decode(data, self.encoding)

    async def play(self, samples: np.ndarray, realtime: bool = True) -> None:
        """The caller speaks ``samples`` (at the carrier's rate), one frame per ``frame_ms``."""
        n = self.rate * self.frame_ms // 1000
        t0 = time.monotonic()
        for k, start in enumerate(range(0, len(samples), n)):
            chunk = samples[start:start + n]
            if len(chunk) < n:
                chunk = np.pad(chunk, (0, n - len(chunk)))
            if realtime:
                delay = t0 + k * self.frame_ms / 1000 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if self._ws is None or self._ws.closed:
                return
            await self.send_frame(chunk)

    async def send_frame(self, chunk: np.ndarray) -> None:
        assert self._ws is not None
        self.send_times.append((self._sent_samples, time.monotonic()))
        timestamp = self._sent_samples * 1000 // self.rate
        self._sent_samples += len(chunk)
        data = self.encode(chunk)
        if self.binary_audio:
            await self._ws.send_bytes(data)
        else:
            values = self._values(payload=base64.b64encode(data).decode(), timestamp=timestamp,
                                  chunk=len(self.send_times))
            await self._ws.send_str(json.dumps(fill(self.spec["media"], values)))

    async def press(self, digit: str) -> None:
        await self.send_json(fill(self.spec["dtmf"], self._values(digit=digit)))

    async def hang_up(self) -> None:
        await self.send_json(fill(self.spec["stop"], self._values()))

    # --- what the server sends ---------------------------------------------------------------------

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for msg in self._ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    if self.binary_audio:
                        self._on_audio(msg.data)
                    else:
                        self.log.unexpected.append(("binary", len(msg.data)))
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    self._on_text(json.loads(msg.data))
        finally:
            self.log.close_code = self._ws.close_code
            self.closed.set()

    def _on_text(self, frame: Any) -> None:
        out = self.spec["outbound"]
        for kind in ("media", "mark", "clear"):
            template = out.get(kind)
            captures = match(template, frame) if template is not None else None
            if captures is None:
                continue
            if kind == "media":
                self._on_audio(base64.b64decode(captures["payload"]))
            elif kind == "mark":
                self._on_mark(str(captures["name"]))
            else:
                self._on_clear()
            return
        self.log.unexpected.append(frame)

    def _on_audio(self, data: bytes) -> None:
        now = time.monotonic()
        samples = self.decode(data)
        start = max(self._play_clock, now)
        self._play_clock = start + len(samples) / self.rate
        self.log.audio.append(ReceivedAudio(now, start, samples))

    def _on_mark(self, name: str) -> None:
        now = time.monotonic()
        self.log.marks_received.append((now, name))
        loop = asyncio.get_running_loop()
        timer = loop.call_at(loop.time() + max(0.0, self._play_clock - now), self._echo, name, False)
        self._pending_marks.append((name, timer))

    def _echo(self, name: str, cleared: bool) -> None:
        self._pending_marks = [(n, t) for n, t in self._pending_marks if n != name]
        self.log.marks_echoed.append((time.monotonic(), name, cleared))
        if self._ws is not None and not self._ws.closed:
            self._reply(fill(self.spec["mark"], self._values(name=name)))

    def _on_clear(self) -> None:
        now = time.monotonic()
        self.log.clears.append(now)
        self._play_clock = now
        for a in self.log.audio:
            if a.cut_at is None and a.play_start + len(a.samples) / self.rate > now:
                a.cut_at = now
        pending, self._pending_marks = self._pending_marks, []
        for name, timer in pending:
            timer.cancel()
            if self.spec.get("marks_echoed_on_clear"):
                self._echo(name, True)
        if self.spec.get("cleared") is not None and self._ws is not None and not self._ws.closed:
            self._reply(fill(self.spec["cleared"], self._values()))

    # --- what the caller heard -------------------------------------------------------------------

    def heard(self, since: float = 0.0) -> np.ndarray:
        chunks = [a.samples for a in self.log.audio if a.arrival >= since]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)

    def played_ms(self, at: float) -> float:
        """Audio the emulated playout had played by time ``at`` (for comparing with ``played_ms``)."""
        total = 0.0
        for a in self.log.audio:
            end = min(at, a.play_start + len(a.samples) / self.rate, a.cut_at if a.cut_at is not None else at)
            total += max(0.0, end - a.play_start)
        return 1000.0 * total
