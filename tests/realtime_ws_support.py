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


class TcpRelay:
    """A TCP relay in front of a server whose connections the test can cut, as a network drops them."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.accepted = 0
        self.frozen = False
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> "TcpRelay":
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {client_writer, server_writer}
        pumps = [asyncio.ensure_future(self._pump(client_reader, server_writer)),
                 asyncio.ensure_future(self._pump(server_reader, client_writer))]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for writer in (client_writer, server_writer):
            writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.frozen:
                    continue  # swallowed: the network stopped carrying anything
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass

    def freeze(self) -> None:
        """Carry nothing more either way, without closing anything: a peer gone silent."""
        self.frozen = True

    def sever(self) -> None:
        """Cut every connection through the relay at once, both ways (no close handshake)."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def load_duplex_client():
    """vLLM-Omni 0.30.0's own duplex client module, from its package as installed without its
    dependencies by ``make install-test``: the package's ``__init__`` imports vLLM (and needs a GPU),
    the client module needs only pybase64 and websockets, so a bare ``vllm_omni`` package object is
    registered with the installed folder as its path and the module is imported from it, unchanged."""
    import importlib
    import os
    import sys
    import types
    from pathlib import Path

    from strict import unavailable

    root = Path(os.environ.get("CLIENT_VENVS", Path(__file__).resolve().parent.parent / ".venv-clients"))
    package = root / "vllm-omni" / "vllm_omni"
    if not (package / "clients" / "duplex.py").is_file():
        unavailable(f"vLLM-Omni's package is not at {package}: `make install-test` fetches it")
    if "vllm_omni" not in sys.modules:
        bare = types.ModuleType("vllm_omni")
        bare.__path__ = [str(package)]
        sys.modules["vllm_omni"] = bare
    return importlib.import_module("vllm_omni.clients.duplex")
