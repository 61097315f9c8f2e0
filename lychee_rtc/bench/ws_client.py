"""A plain realtime WebSocket client for the benches: appends PCM16, keeps the answer's timing.

It speaks the OpenAI GA dialect's few events a bench needs (``input_audio_buffer.append`` out;
``response.*`` and ``response.output_audio.delta`` in) and records, for every audio delta, when it
arrived and where it sits in the answer stream, so a bench can tell how long after an append its
audio came back. The frameworks themselves are tested in tests/test_realtime_frameworks.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

RATE = 24000


@dataclass
class Delta:
    arrived: float  # monotonic
    start: int  # answer stream position (24 kHz samples) of its first sample
    samples: int
    response_id: str


@dataclass
class SocketRecord:
    deltas: list[Delta] = field(default_factory=list)
    created: dict[str, float] = field(default_factory=dict)  # response id -> arrival of response.created
    done: dict[str, float] = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)
    position: int = 0  # samples of answer audio received so far

    def first_audio_after(self, t: float) -> float | None:
        return next((d.arrived for d in self.deltas if d.arrived >= t), None)


class SocketClient:
    def __init__(self, http: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse, keep_audio: bool) -> None:
        self.http = http
        self.ws = ws
        self.record = SocketRecord()
        self.audio: list[np.ndarray] = []  # the answer's PCM (kept only when asked)
        self._keep = keep_audio
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, url: str, query: str = "model=bench", keep_audio: bool = False) -> "SocketClient":
        http = aiohttp.ClientSession()
        ws = await http.ws_connect(f"{url.replace('http', 'ws', 1)}/v1/realtime?{query}", max_msg_size=0)
        return cls(http, ws, keep_audio)

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            now = time.monotonic()
            event = json.loads(msg.data)
            kind = event.get("type")
            if kind == "response.output_audio.delta":
                pcm = np.frombuffer(base64.b64decode(event["delta"]), "<i2")
                self.record.deltas.append(Delta(now, self.record.position, len(pcm), event["response_id"]))
                self.record.position += len(pcm)
                if self._keep:
                    self.audio.append(pcm.astype(np.float32) / 32768.0)
            elif kind == "response.created":
                self.record.created[event["response"]["id"]] = now
            elif kind == "response.done":
                self.record.done[event["response"]["id"]] = now
            elif kind == "error":
                self.record.errors.append(event["error"])

    async def append(self, pcm16: bytes) -> float:
        """Send one append; when it was handed to the socket."""
        await self.ws.send_str(json.dumps({"type": "input_audio_buffer.append",
                                           "audio": base64.b64encode(pcm16).decode("ascii")}))
        return time.monotonic()

    async def stream(self, pcm16: bytes, chunk_ms: int = 20, realtime: bool = True) -> list[tuple[float, int]]:
        """Append ``pcm16`` in chunks, paced in real time unless told otherwise; (sent at, end sample)
        of each chunk, the end counted in input samples at 24 kHz."""
        step = RATE * 2 * chunk_ms // 1000
        sent: list[tuple[float, int]] = []
        start = time.monotonic()
        for i in range(0, len(pcm16), step):
            piece = pcm16[i:i + step]
            sent.append((await self.append(piece), (i + len(piece)) // 2))
            if realtime:
                due = start + (i + len(piece)) / 2 / RATE
                await asyncio.sleep(max(0.0, due - time.monotonic()))
        return sent

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self.http.close()


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
