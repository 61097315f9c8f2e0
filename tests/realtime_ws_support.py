"""Helpers for the realtime WebSocket tests: audio in and out of base64 PCM, hearing an echo, and a
plain socket client for what no SDK would send."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import numpy as np

from conftest import wait_until
from lychee_rtc.pcm import PcmResampler
from recording_support import correlation_at, lag_of

RATE = 24000


def to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def from_pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def resample(samples: np.ndarray, src: int, dst: int) -> np.ndarray:
    r = PcmResampler(src, dst)
    return np.concatenate([r.process(samples), r.flush()])


def chunks(data: bytes, ms: int, rate: int = RATE, width: int = 2) -> list[bytes]:
    step = rate * width * ms // 1000
    return [data[i:i + step] for i in range(0, len(data), step)]


def audio_of(events: list[dict[str, Any]], response_id: str | None = None) -> bytes:
    """The PCM of the ``response.output_audio.delta`` events (of one response, if named)."""
    return b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
                    and (response_id is None or e["response_id"] == response_id))


def echo_similarity(sent: np.ndarray, heard: np.ndarray, rate: int = RATE) -> float:
    """How alike what came back is to what was said: 10 ms envelopes, correlated at their best lag."""
    hop = rate // 100
    lag = lag_of(sent, heard, hop=rate // 1000)
    return correlation_at(sent, heard, lag, hop=hop)


class RawSocket:
    """A WebSocket client of our own, for frames no SDK sends (and for reading every event raw)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.close_code: int | None = None
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, http: aiohttp.ClientSession, url: str, **kwargs: Any) -> "RawSocket":
        return cls(await http.ws_connect(url.replace("http", "ws", 1), max_msg_size=0, **kwargs))

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                self.events.append(json.loads(msg.data))
        self.close_code = self.ws.close_code

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(event))

    def of(self, event_type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == event_type]

    async def wait(self, event_type: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            return next((e for e in self.events if e["type"] == event_type
                         and all(e.get(k) == v for k, v in match.items())), None)
        return await wait_until(find, timeout, f"a {event_type} event")

    async def closed(self, timeout: float = 30.0) -> int | None:
        await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        return self.close_code

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)
