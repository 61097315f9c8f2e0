"""Exotel Voicebot applet (bidirectional AgentStream).

Twilio-like events with snake_case ids (``stream_sid``, ``call_sid``, ``account_sid``) and raw
16-bit little-endian PCM (8, 16 or 24 kHz) instead of mu-law. Outbound chunks should be multiples
of 320 bytes and at least 3,200 bytes, so frames are longer than 20 ms.
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
    rate,
    string_map,
    text,
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

MIN_CHUNK_BYTES = 3200
CHUNK_MULTIPLE_BYTES = 320


class ExotelDialect(Dialect):
    name = "exotel"

    @classmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        start = first.get("start")
        return first.get("event") == "start" and isinstance(start, dict) and "stream_sid" in start \
            and "call_sid" in start and "account_sid" in start

    def parse(self, raw: str | bytes) -> CarrierEvent:
        data = load_json(raw, "Exotel")
        event = data.get("event")
        if event == "media":
            media = obj(data, "media")
            return AudioIn(payload(media), number(media.get("timestamp"), "media.timestamp"))
        if event == "mark":
            return MarkPlayed(text(obj(data, "mark"), "name", "mark."))
        if event == "dtmf":
            return digit(obj(data, "dtmf").get("digit"))
        if event == "start":
            return self._start(obj(data, "start"))
        if event == "stop":
            stop = data.get("stop") if isinstance(data.get("stop"), dict) else {}
            return StreamStopped(str(stop.get("reason", "stop")))
        if event == "connected":
            return Unhandled("connected")
        raise FrameError(f"unknown Exotel event {event!r}")

    def _start(self, start: dict[str, Any]) -> StreamStarted:
        fmt = start.get("media_format") or {}
        audio = AudioFormat("pcm16", rate(fmt.get("sample_rate", 8000), (8000, 16000, 24000), "Exotel"))
        self.started = StreamStarted(text(start, "call_sid", "start."), text(start, "stream_sid", "start."), audio,
                                     string_map(start.get("custom_parameters")))
        return self.started

    def frame_ms(self) -> int:
        """The shortest multiple of 20 ms whose PCM fills Exotel's minimum chunk."""
        per_20ms = self.audio.rate // 50 * 2
        frames = -(-MIN_CHUNK_BYTES // per_20ms)
        while (frames * per_20ms) % CHUNK_MULTIPLE_BYTES:
            frames += 1
        return 20 * frames

    @property
    def _sid(self) -> str:
        return self.started.stream_id if self.started else ""

    def media(self, data: bytes) -> str:
        return json.dumps({"event": "media", "stream_sid": self._sid, "media": {"payload": b64(data)}})

    def mark(self, name: str) -> str:
        return json.dumps({"event": "mark", "stream_sid": self._sid, "mark": {"name": name}})

    def clear(self) -> str:
        return json.dumps({"event": "clear", "stream_sid": self._sid})
