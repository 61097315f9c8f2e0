"""Vonage Voice API WebSocket endpoint (NCCO ``connect`` to a ``websocket`` endpoint).

Audio both ways is binary 16-bit little-endian PCM in 20 ms frames at the rate of the NCCO's
``content-type`` (``audio/l16;rate=16000`` or 8000). Text frames carry events: the first is
``websocket:connected`` (with the NCCO's custom headers), then ``websocket:dtmf``,
``websocket:notify`` (our ``notify`` echoed once the audio before it has played) and
``websocket:cleared`` (the answer to our ``clear``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from lychee_rtc.telephony.carriers.base import (
    MAX_FRAME_BYTES,
    Dialect,
    digit,
    load_json,
    rate,
    string_map,
    unsupported,
)
from lychee_rtc.telephony.frames import (
    AudioFormat,
    AudioIn,
    CarrierEvent,
    CarrierReported,
    FrameError,
    MarkPlayed,
    PlaybackCleared,
    StreamStarted,
    StreamStopped,
    Unhandled,
)


class VonageDialect(Dialect):
    name = "vonage"
    acknowledges_clear = True

    @classmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        return first.get("event") == "websocket:connected"

    def parse(self, raw: str | bytes) -> CarrierEvent:
        if isinstance(raw, bytes):
            if self.started is None:
                raise FrameError("audio before websocket:connected")
            if len(raw) > MAX_FRAME_BYTES:
                raise FrameError(f"frame of {len(raw)} bytes exceeds {MAX_FRAME_BYTES}")
            return AudioIn(raw)
        data = load_json(raw, "Vonage")
        event = data.get("event")
        if event == "websocket:connected":
            return self._start(data)
        if event == "websocket:notify":
            body = data.get("payload")
            if not isinstance(body, dict) or not isinstance(body.get("name"), str):
                raise FrameError("websocket:notify without payload.name")
            return MarkPlayed(body["name"])
        if event == "websocket:cleared":
            return PlaybackCleared()
        if event == "websocket:dtmf":
            inner = data.get("dtmf") if isinstance(data.get("dtmf"), dict) else data
            return digit(inner.get("digit"))
        if event == "websocket:error":
            return CarrierReported(f"Vonage error: {data.get('reason') or data.get('message') or data}")
        if event in ("websocket:disconnected", "stop"):
            return StreamStopped(event)
        if isinstance(event, str) and event.startswith("websocket:"):
            return Unhandled(event)
        raise FrameError(f"unknown Vonage event {event!r}")

    def _start(self, data: dict[str, Any]) -> StreamStarted:
        content = str(data.get("content-type", ""))
        match = re.fullmatch(r"\s*audio/l16\s*;\s*rate\s*=\s*(\d+)\s*", content)
        if match is None:
            raise unsupported(f"Vonage content-type {content!r} is not audio/l16;rate=N")
        audio = AudioFormat("pcm16", rate(match.group(1), (8000, 16000), "Vonage"))
        params = string_map({k: v for k, v in data.items() if k not in ("event", "content-type")})
        call_id = params.get("uuid") or params.get("conversation_uuid") or params.get("call_id") or ""
        self.started = StreamStarted(call_id, "", audio, params)
        return self.started

    def media(self, data: bytes) -> bytes:
        return data

    def mark(self, name: str) -> str:
        return json.dumps({"action": "notify", "payload": {"name": name}})

    def clear(self) -> str:
        return json.dumps({"action": "clear"})
