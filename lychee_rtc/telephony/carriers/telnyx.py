"""Telnyx media streaming (Call Control ``streaming_start`` with ``stream_bidirectional_mode: rtp``).

Like Twilio's, with snake_case ids (top-level ``stream_id``, ``start.call_control_id``), the codec
named in ``start.media_format`` (PCMU or PCMA here), outbound frames without a stream id, ``mark``
echoes (queued marks come back on ``clear``) and ``error`` events.
"""

from __future__ import annotations

from typing import Any

from lychee_rtc.telephony.carriers.base import (
    TwilioLikeDialect,
    obj,
    rate,
    text,
    unsupported,
)
from lychee_rtc.telephony.frames import (
    AudioFormat,
    CarrierEvent,
    CarrierReported,
    StreamStarted,
    StreamStopped,
)

ENCODINGS = {"PCMU": "mulaw", "PCMA": "alaw"}


class TelnyxDialect(TwilioLikeDialect):
    name = "telnyx"
    label = "Telnyx"
    stream_key = None

    @classmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        start = first.get("start")
        return "stream_id" in first and isinstance(start, dict) and "call_control_id" in start

    def parse_other(self, event: Any, data: dict[str, Any]) -> CarrierEvent | None:
        if event == "start":
            return self._start(data)
        if event == "stop":
            return StreamStopped("stop")
        if event == "error":
            detail = data.get("payload") if isinstance(data.get("payload"), dict) else {}
            return CarrierReported(f"Telnyx error {detail.get('code', '?')}: "
                                   f"{detail.get('title', '')} {detail.get('detail', '')}".strip())
        return None

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
