"""Twilio bidirectional Media Streams (``<Connect><Stream>``): JSON frames, base64 mu-law 8 kHz.

Twilio -> us: ``connected``, ``start``, ``media``, ``dtmf``, ``mark`` (our mark, echoed once the audio
before it has played, or at once when a ``clear`` discards it), ``stop``. Us -> Twilio: only
``media``, ``mark`` and ``clear``; anything else is an error on Twilio's side (31924).
"""

from __future__ import annotations

import json
from typing import Any

from lychee_rtc.telephony.carriers.base import (
    Dialect,
    b64,
    digit,
    load_json,
    number,
    obj,
    payload,
    string_map,
    text,
    unsupported,
)
from lychee_rtc.telephony.frames import (
    AudioFormat,
    AudioIn,
    CarrierEvent,
    FrameError,
    MarkPlayed,
    StreamStarted,
    StreamStopped,
    Unhandled,
)


class TwilioDialect(Dialect):
    name = "twilio"

    @classmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        start = first.get("start")
        return first.get("event") == "start" and isinstance(start, dict) and "streamSid" in start \
            and "callSid" in start

    def parse(self, raw: str | bytes) -> CarrierEvent:
        data = load_json(raw, "Twilio")
        event = data.get("event")
        if event == "media":
            media = obj(data, "media")
            if media.get("track", "inbound") != "inbound":
                return Unhandled(f"media of track {media.get('track')!r}")
            return AudioIn(payload(media), number(media.get("timestamp"), "media.timestamp"))
        if event == "mark":
            return MarkPlayed(text(obj(data, "mark"), "name", "mark."))
        if event == "dtmf":
            return digit(obj(data, "dtmf").get("digit"))
        if event == "start":
            return self._start(obj(data, "start"))
        if event == "stop":
            return StreamStopped("stop")
        if event == "connected":
            return Unhandled("connected")
        raise FrameError(f"unknown Twilio event {event!r}")

    def _start(self, start: dict[str, Any]) -> StreamStarted:
        fmt = start.get("mediaFormat") or {}
        encoding = fmt.get("encoding", "audio/x-mulaw")
        if encoding != "audio/x-mulaw" or number(fmt.get("sampleRate", 8000), "sampleRate") != 8000:
            raise unsupported(f"Twilio media format {encoding}/{fmt.get('sampleRate')} is not audio/x-mulaw/8000")
        self.started = StreamStarted(text(start, "callSid", "start."), text(start, "streamSid", "start."),
                                     AudioFormat("mulaw", 8000), string_map(start.get("customParameters")))
        return self.started

    @property
    def _sid(self) -> str:
        return self.started.stream_id if self.started else ""

    def media(self, data: bytes) -> str:
        return json.dumps({"event": "media", "streamSid": self._sid, "media": {"payload": b64(data)}})

    def mark(self, name: str) -> str:
        return json.dumps({"event": "mark", "streamSid": self._sid, "mark": {"name": name}})

    def clear(self) -> str:
        return json.dumps({"event": "clear", "streamSid": self._sid})
