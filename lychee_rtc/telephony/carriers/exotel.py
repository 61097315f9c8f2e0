"""Exotel Voicebot applet (bidirectional AgentStream).

Twilio-like events with snake_case ids (``stream_sid``, ``call_sid``, ``account_sid``) and raw
16-bit little-endian PCM (8, 16 or 24 kHz) instead of mu-law. Outbound chunks should be multiples
of 320 bytes and at least 3,200 bytes, so frames are longer than 20 ms.
"""

from __future__ import annotations

from typing import Any

from lychee_rtc.telephony.carriers.base import (
    TwilioLikeDialect,
    obj,
    rate,
    string_map,
    text,
)
from lychee_rtc.telephony.frames import (
    AudioFormat,
    CarrierEvent,
    StreamStarted,
    StreamStopped,
)

MIN_CHUNK_BYTES = 3200
CHUNK_MULTIPLE_BYTES = 320


class ExotelDialect(TwilioLikeDialect):
    name = "exotel"
    label = "Exotel"
    stream_key = "stream_sid"

    @classmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        start = first.get("start")
        return first.get("event") == "start" and isinstance(start, dict) and "stream_sid" in start \
            and "call_sid" in start and "account_sid" in start

    def parse_other(self, event: Any, data: dict[str, Any]) -> CarrierEvent | None:
        if event == "start":
            return self._start(obj(data, "start"))
        if event == "stop":
            stop = data.get("stop") if isinstance(data.get("stop"), dict) else {}
            return StreamStopped(str(stop.get("reason", "stop")))
        return None

    def _start(self, start: dict[str, Any]) -> StreamStarted:
        # Exotel's documentation spells the fields in snake_case, its own sample code in camelCase
        # and says spellings vary: either is taken (auto-detection needs the snake_case ones; a
        # camelCase stream is told from Twilio's by the URL, /v1/telephony/ws/exotel).
        def field(snake: str, camel: str) -> str:
            return camel if snake not in start and camel in start else snake

        fmt = start.get(field("media_format", "mediaFormat")) or {}
        sample_rate = fmt.get("sample_rate", fmt.get("sampleRate", 8000))
        audio = AudioFormat("pcm16", rate(sample_rate, (8000, 16000, 24000), "Exotel"))
        self.started = StreamStarted(text(start, field("call_sid", "callSid"), "start."),
                                     text(start, field("stream_sid", "streamSid"), "start."), audio,
                                     string_map(start.get(field("custom_parameters", "customParameters"))))
        return self.started

    def frame_ms(self) -> int:
        """The shortest multiple of 20 ms whose PCM fills Exotel's minimum chunk."""
        per_20ms = self.audio.rate // 50 * 2
        frames = -(-MIN_CHUNK_BYTES // per_20ms)
        while (frames * per_20ms) % CHUNK_MULTIPLE_BYTES:
            frames += 1
        return 20 * frames
