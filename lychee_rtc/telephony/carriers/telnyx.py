"""Telnyx media streaming (Call Control ``streaming_start`` with ``stream_bidirectional_mode: rtp``).

Like Twilio's, with snake_case ids (top-level ``stream_id``, ``start.call_control_id``), the codec
named in ``start.media_format`` (PCMU or PCMA here), outbound frames without a stream id, ``mark``
echoes (queued marks come back on ``clear``) and ``error`` events.
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
    text,
    unsupported,
)
from lychee_rtc.telephony.frames import (
    AudioFormat,
    AudioIn,
    CarrierEvent,
    CarrierReported,
    FrameError,
    MarkPlayed,
    StreamStarted,
    StreamStopped,
    Unhandled,
)

ENCODINGS = {"PCMU": "mulaw", "PCMA": "alaw"}


class TelnyxDialect(Dialect):
    name = "telnyx"

    @classmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        start = first.get("start")
        return "stream_id" in first and isinstance(start, dict) and "call_control_id" in start

    def parse(self, raw: str | bytes) -> CarrierEvent:
        data = load_json(raw, "Telnyx")
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
            return self._start(data)
        if event == "stop":
            return StreamStopped("stop")
        if event == "error":
            detail = data.get("payload") if isinstance(data.get("payload"), dict) else {}
            return CarrierReported(f"Telnyx error {detail.get('code', '?')}: "
                                   f"{detail.get('title', '')} {detail.get('detail', '')}".strip())
        if event == "connected":
            return Unhandled("connected")
        raise FrameError(f"unknown Telnyx event {event!r}")

    def _start(self, data: dict[str, Any]) -> StreamStarted:
        start = obj(data, "start")
        fmt = start.get("media_format") or {}
        encoding = str(fmt.get("encoding", "PCMU")).upper()
        if encoding not in ENCODINGS:
            raise unsupported(f"Telnyx encoding {encoding!r} is not supported (PCMU or PCMA)")
        audio = AudioFormat(ENCODINGS[encoding], rate(fmt.get("sample_rate", 8000), (8000,), "Telnyx"))
        params = {k: str(start[k]) for k in ("client_state", "from", "to") if isinstance(start.get(k), str)}
        self.started = StreamStarted(text(start, "call_control_id", "start."), text(data, "stream_id"), audio, params)
        return self.started

    def media(self, data: bytes) -> str:
        return json.dumps({"event": "media", "media": {"payload": b64(data)}})

    def mark(self, name: str) -> str:
        return json.dumps({"event": "mark", "mark": {"name": name}})

    def clear(self) -> str:
        return json.dumps({"event": "clear"})
