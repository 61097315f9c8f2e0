"""Twilio bidirectional Media Streams (``<Connect><Stream>``): JSON frames, base64 mu-law 8 kHz.

Twilio -> us: ``connected``, ``start``, ``media``, ``dtmf``, ``mark`` (our mark, echoed once the audio
before it has played, or at once when a ``clear`` discards it), ``stop``. Us -> Twilio: only
``media``, ``mark`` and ``clear``; anything else is an error on Twilio's side (31924).
"""

from __future__ import annotations

from typing import Any

from lychee_rtc.telephony.carriers.base import (
    TwilioLikeDialect,
    number,
    obj,
    string_map,
    text,
    unsupported,
)
from lychee_rtc.telephony.frames import (
    AudioFormat,
    CarrierEvent,
    StreamStarted,
    StreamStopped,
)


class TwilioDialect(TwilioLikeDialect):
    name = "twilio"
    label = "Twilio"
    stream_key = "streamSid"

    @classmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        start = first.get("start")
        return first.get("event") == "start" and isinstance(start, dict) and "streamSid" in start \
            and "callSid" in start

    def parse_other(self, event: Any, data: dict[str, Any]) -> CarrierEvent | None:
        if event == "start":
            return self._start(obj(data, "start"))
        if event == "stop":
            return StreamStopped("stop")
        return None

    def _start(self, start: dict[str, Any]) -> StreamStarted:
        fmt = start.get("mediaFormat") or {}
        encoding = fmt.get("encoding", "audio/x-mulaw")
        if encoding != "audio/x-mulaw" or number(fmt.get("sampleRate", 8000), "sampleRate") != 8000:
            raise unsupported(f"Twilio media format {encoding}/{fmt.get('sampleRate')} is not audio/x-mulaw/8000")
        self.started = StreamStarted(text(start, "callSid", "start."), text(start, "streamSid", "start."),
                                     AudioFormat("mulaw", 8000), string_map(start.get("customParameters")))
        return self.started
