"""Plivo audio streams (``<Stream bidirectional="true">``).

``start`` carries ``streamId``/``callId``, the content type (mu-law 8 kHz or L16 8/16 kHz) and the
stream's ``extraHeaders`` (``extra_headers``, the only place Plivo can put a credential). We send
``playAudio``, ``checkpoint`` (answered by ``playedStream`` once the audio before it has played) and
``clearAudio`` (answered by ``clearedAudio``; pending checkpoints are dropped, not echoed).
"""

from __future__ import annotations

import json
import re
from typing import Any

from lychee_rtc.telephony.carriers.base import (
    Dialect,
    b64,
    digit,
    inbound_media,
    load_json,
    obj,
    rate,
    text,
    unsupported,
)
from lychee_rtc.telephony.frames import (
    AudioFormat,
    CarrierEvent,
    FrameError,
    MarkPlayed,
    PlaybackCleared,
    StreamStarted,
    StreamStopped,
)

CONTENT_TYPES = {"audio/x-mulaw": "mulaw", "audio/x-l16": "pcm16"}


def parse_extra_headers(value: Any) -> dict[str, str]:
    """``"key1=v1,key2=v2"`` (the XML attribute) or ``;``-separated, as Plivo passes it on."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    if not isinstance(value, str):
        return {}
    out = {}
    for item in re.split(r"[;,]", value):
        key, sep, val = item.partition("=")
        if sep and key.strip():
            out[key.strip()] = val.strip()
    return out


class PlivoDialect(Dialect):
    name = "plivo"
    acknowledges_clear = True

    @classmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        start = first.get("start")
        return isinstance(start, dict) and "streamId" in start and "callId" in start

    def parse(self, raw: str | bytes) -> CarrierEvent:
        data = load_json(raw, "Plivo")
        event = data.get("event")
        if event == "media":
            return inbound_media(obj(data, "media"))
        if event == "playedStream":
            return MarkPlayed(text(data, "name"))
        if event == "clearedAudio":
            return PlaybackCleared()
        if event == "dtmf":
            return digit(obj(data, "dtmf").get("digit"))
        if event == "start":
            return self._start(data)
        if event == "stop":
            return StreamStopped("stop")
        raise FrameError(f"unknown Plivo event {event!r}")

    def _start(self, data: dict[str, Any]) -> StreamStarted:
        start = obj(data, "start")
        fmt = start.get("mediaFormat") or {}
        content = fmt.get("encoding", "audio/x-mulaw")
        if content not in CONTENT_TYPES:
            raise unsupported(f"Plivo encoding {content!r} is not supported (audio/x-mulaw or audio/x-l16)")
        allowed = (8000,) if content == "audio/x-mulaw" else (8000, 16000)
        audio = AudioFormat(CONTENT_TYPES[content], rate(fmt.get("sampleRate", 8000), allowed, "Plivo"))
        self.started = StreamStarted(text(start, "callId", "start."), text(start, "streamId", "start."), audio,
                                     parse_extra_headers(data.get("extra_headers")))
        return self.started

    def media(self, data: bytes) -> str:
        content = "audio/x-mulaw" if self.audio.encoding == "mulaw" else "audio/x-l16"
        return json.dumps({"event": "playAudio", "streamId": self.stream_id,
                           "media": {"contentType": content, "sampleRate": self.audio.rate, "payload": b64(data)}})

    def mark(self, name: str) -> str:
        return json.dumps({"event": "checkpoint", "streamId": self.stream_id, "name": name})

    def clear(self) -> str:
        return json.dumps({"event": "clearAudio", "streamId": self.stream_id})
