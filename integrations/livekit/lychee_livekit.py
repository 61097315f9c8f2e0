"""lychee-rtc as a full-duplex model inside LiveKit Agents: ``AgentSession(llm=LycheeDuplexModel(...))``.

LiveKit's OpenAI realtime plugin assumes a half-duplex model: it holds the model's speech until the
user is silent and cancels it whenever the server says the user started speaking. A full-duplex
model listens while it speaks and decides itself when to yield. This module implements LiveKit's
``DuplexModel`` interface (``livekit.agents.llm.DuplexModel``; ``AgentSession`` wraps it in its
``DuplexRealtimeAdapter``, with overlapping speech allowed) over lychee-rtc's realtime WebSocket in
vLLM-Omni's duplex dialect:

* the user's audio goes up as it comes, at its own rate, in ~100 ms appends;
* the model's audio comes back as the server makes it and is handed to LiveKit at playback pace,
  as a continuous stream in which the model's silence is silence; a burst (LiveKit's generation)
  is exactly one response of the model (``ResponseGate``), not a guess from loudness;
* an answer the model cuts (its own barge-in) stops at once: what was queued of it is dropped;
  the client never cancels on its own;
* the model's transcript of its speech arrives as ``transcript_delta``; the server's events are
  acknowledged so its resume journal stays small.

LiveKit discards the user's audio for ``aec_warmup_duration`` (3 s by default) after the agent
starts speaking; a full-duplex model needs to hear it, so pass ``aec_warmup_duration=None`` to the
``AgentSession`` (or use an echo-cancelled input). Install: ``pip install ./integrations/livekit``
(it needs only ``livekit-agents``), or copy this file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlencode, urlsplit, urlunsplit

import aiohttp
import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.agents.types import NOT_GIVEN, NotGivenOr

log = logging.getLogger("lychee_livekit")

OUT_RATE = 24000
FRAME_MS = 20
APPEND_MS = 100
HEARTBEAT_S = 20.0
__all__ = ["LycheeDuplexModel", "LycheeDuplexSession", "ResponseGate"]


class ResponseGate:
    """LiveKit's ``AudioGate``: open exactly while the frame handed over belongs to a response."""

    def __init__(self) -> None:
        self.speaking = False  # set by the session for the frame it is handing over

    def update(self, frame: rtc.AudioFrame) -> bool:
        return self.speaking

    def deactivate(self) -> None:
        pass  # a burst ends with its response; nothing is learned


class LycheeDuplexModel(llm.DuplexModel):
    def __init__(self, *, base_url: str, api_key: str = "local", model: str = "lychee-fd",
                 http_session: aiohttp.ClientSession | None = None) -> None:
        """``base_url``: the server, ``http(s)://host:port`` (a ``/v1`` suffix is allowed)."""
        super().__init__(capabilities=llm.DuplexCapabilities(
            user_transcription=False, auto_tool_reply_generation=False, mutable_chat_context=False,
            mutable_instructions=True, mutable_tools=False))
        parts = urlsplit(base_url)
        scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
        path = parts.path.rstrip("/").removesuffix("/v1") + "/v1/realtime"
        query = urlencode({"duplex": "1", "autostart": "0", "model": model})
        self.url = urlunsplit((scheme, parts.netloc, path, query, ""))
        self.api_key = api_key
        self._model = model
        self._http = http_session
        self._own_http = http_session is None
        self._gates: list[ResponseGate] = []

    @property
    def model(self) -> str:
        return self._model

    @property
    def provider(self) -> str:
        return "lychee-rtc"

    def audio_gate(self) -> llm.AudioGate:
        gate = ResponseGate()
        self._gates.append(gate)
        return gate

    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    def session(self) -> "LycheeDuplexSession":
        # the adapter asks for the gate just before the session: the two share it
        gate = self._gates[-1] if self._gates else ResponseGate()
        return LycheeDuplexSession(self, gate)

    async def aclose(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.close()
            self._http = None


class LycheeDuplexSession(llm.DuplexSession):
    def __init__(self, model: LycheeDuplexModel, gate: ResponseGate) -> None:
        super().__init__(model)
        self._model = model
        self._gate = gate
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._connected = asyncio.Event()
        self._outgoing: asyncio.Queue[dict] = asyncio.Queue(maxsize=256)
        self._pending = bytearray()
        self._pending_rate = 0
        self._frames: deque[tuple[str, bytes]] = deque()  # (response id, 20 ms of PCM16 at 24 kHz)
        self._speaking: str | None = None  # the response of the frame last handed over
        self._cut: deque[str] = deque(maxlen=16)  # responses the model ended early: their queued audio goes
        self._instructions: str | None = None
        self.session_id: str | None = None
        self.event_listeners: list[Callable[[dict], None]] = []  # every server event, for an application
        self._main = asyncio.create_task(self._run(), name="lychee-duplex-session")

    # --- LiveKit's side ---------------------------------------------------------------------------

    @property
    def audio_stream(self) -> AsyncIterator[llm.DuplexAudioFrame]:
        return self._play()

    @property
    def tools(self) -> llm.ToolContext:
        return llm.ToolContext.empty()

    def push_audio(self, frame: rtc.AudioFrame) -> None:
        if frame.sample_rate != self._pending_rate:
            self._flush_audio()
            self._pending_rate = frame.sample_rate
        data = bytes(frame.data)
        if frame.num_channels > 1:
            data = np.frombuffer(data, np.int16).reshape(-1, frame.num_channels)[:, 0].tobytes()
        self._pending.extend(data)
        if len(self._pending) >= self._pending_rate * 2 * APPEND_MS // 1000:
            self._flush_audio()

    def _flush_audio(self) -> None:
        if self._pending and self._pending_rate:
            self._send({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(self._pending)).decode(),
                        "format": "pcm16", "sample_rate_hz": self._pending_rate})
        self._pending.clear()

    async def _update_instructions(self, instructions: str) -> None:
        self._instructions = instructions
        self._send({"type": "session.update", "session": {"instructions": instructions}})

    async def _append_items(self, items: list[llm.ChatItem]) -> None:
        pass  # the model takes speech only: its context is what it heard

    async def _update_tools(self, tools: list[llm.Tool]) -> None:
        pass

    def _update_options(self, *, tool_choice: NotGivenOr[llm.ToolChoice | None] = NOT_GIVEN) -> None:
        pass

    async def aclose(self) -> None:
        await super().aclose()
        if self._ws is not None and not self._ws.closed:
            with contextlib.suppress(Exception):
                await self._ws.send_str(json.dumps({"type": "session.close"}))
        self._main.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._main
        if self._ws is not None:
            await self._ws.close()

    # --- the model's audio, at playback pace --------------------------------------------------------

    async def _play(self) -> AsyncIterator[llm.DuplexAudioFrame]:
        samples = OUT_RATE * FRAME_MS // 1000
        silence = bytes(samples * 2)
        next_at = time.monotonic()
        while not self._closing:
            now = time.monotonic()
            if next_at > now:
                await asyncio.sleep(next_at - now)
            next_at = max(next_at + FRAME_MS / 1000, time.monotonic() - 0.1)
            while self._frames and self._frames[0][0] in self._cut:
                self._frames.popleft()  # an answer the model cut: what was left of it is never said
            rid, pcm = self._frames[0] if self._frames else (None, silence)
            if rid is not None and self._gate.speaking and rid != self._speaking:
                rid, pcm = None, silence  # one frame of silence between two responses: two generations
            elif rid is not None:
                self._frames.popleft()
            self._speaking = rid
            self._gate.speaking = rid is not None
            yield llm.DuplexAudioFrame(rtc.AudioFrame(data=pcm, sample_rate=OUT_RATE, num_channels=1,
                                                      samples_per_channel=samples))

    # --- the server's side -------------------------------------------------------------------------

    def _send(self, event: dict) -> None:
        try:
            self._outgoing.put_nowait(event)
        except asyncio.QueueFull:
            log.warning("lychee-rtc socket is not keeping up; %s dropped", event["type"])

    async def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self._model.api_key}"}
        async with self._model.http().ws_connect(self._model.url, headers=headers, max_msg_size=0) as ws:
            self._ws = ws
            session = {"input_audio_format": "pcm16", "sample_rate_hz": 16000, "turn_detection": None,
                       "audio": {"output": {"sample_rate_hz": OUT_RATE}}}
            if self._instructions:
                session["instructions"] = self._instructions
            await ws.send_str(json.dumps({"type": "session.update", "session": session}))
            writer = asyncio.create_task(self._write(ws))
            try:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        await self._on_event(ws, json.loads(msg.data))
                    elif msg.type == aiohttp.WSMsgType.ERROR:
                        break
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
        if not self._closing:
            self.emit("error", llm.RealtimeModelError(timestamp=time.time(), label=self._model.label,
                                                      error=ConnectionError("lychee-rtc closed the socket"),
                                                      recoverable=False))

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while True:
            try:
                event = await asyncio.wait_for(self._outgoing.get(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                event = {"type": "session.heartbeat"}  # keeps an idle socket open
            await ws.send_str(json.dumps(event))

    async def _on_event(self, ws: aiohttp.ClientWebSocketResponse, event: dict) -> None:
        kind = event.get("type")
        for listener in self.event_listeners:
            listener(event)
        if isinstance(event.get("server_event_seq"), int):  # the journal may forget it
            self._send({"type": "session.event_ack", "server_event_seq": event["server_event_seq"]})
        if kind == "session.created":
            self.session_id = event["session"]["id"]
            self._connected.set()
        elif kind == "response.output_audio.delta":
            pcm = base64.b64decode(event["delta"])
            step = OUT_RATE * FRAME_MS // 1000 * 2
            for i in range(0, len(pcm), step):
                self._frames.append((event["response_id"], pcm[i:i + step].ljust(step, b"\0")))
        elif kind == "response.done":
            response = event.get("response") or {}
            if response.get("status") != "completed":
                self._cut.append(response.get("id", ""))
        elif kind == "response.output_audio_transcript.delta":
            self.emit("transcript_delta", llm.DuplexOutputTranscriptDelta(text=event["delta"]))
        elif kind == "input_audio_buffer.speech_started":
            self.emit("input_speech_started", llm.InputSpeechStartedEvent())
        elif kind == "input_audio_buffer.speech_stopped":
            self.emit("input_speech_stopped", llm.InputSpeechStoppedEvent(user_transcription_enabled=False))
        elif kind == "error":
            error = event.get("error") or {}
            log.warning("lychee-rtc: %s: %s", error.get("code"), error.get("message"))
            self.emit("error", llm.RealtimeModelError(timestamp=time.time(), label=self._model.label,
                                                      error=RuntimeError(str(error.get("message"))),
                                                      recoverable=True))
