"""The dialect interface and the parsing helpers every carrier's dialect uses."""

from __future__ import annotations

import base64
import binascii
import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from lychee_rtc.engine.base import DTMF_DIGITS
from lychee_rtc.jsonio import JsonError, strict_json_loads
from lychee_rtc.telephony.frames import (
    CLOSE_UNSUPPORTED_DATA,
    AudioFormat,
    AudioIn,
    CarrierEvent,
    DigitPressed,
    FrameError,
    MarkPlayed,
    StreamStarted,
    Unhandled,
)

MAX_FRAME_BYTES = 64 * 1024  # a 20-100 ms audio frame is a few kB; anything far larger is not a carrier


class Dialect(ABC):
    """One carrier's frames: parses what it sends, writes what it accepts.

    A dialect is per connection: it learns the stream's ids and audio format from the start frame.
    """

    name: ClassVar[str]
    # Whether the carrier sends a confirmation for each of our flushes.
    acknowledges_clear: ClassVar[bool] = False

    def __init__(self) -> None:
        self.started: StreamStarted | None = None

    @classmethod
    @abstractmethod
    def detect(cls, first: dict[str, Any]) -> bool:
        """Whether this first JSON frame (a start or handshake frame) is this carrier's."""

    @abstractmethod
    def parse(self, raw: str | bytes) -> CarrierEvent:
        """One frame from the carrier as a typed event; FrameError if malformed."""

    @abstractmethod
    def media(self, payload: bytes) -> str | bytes:
        """An outbound audio frame (already in ``audio`` format)."""

    @abstractmethod
    def mark(self, name: str) -> str:
        """A playout receipt request: the carrier echoes ``name`` when the audio before it has played."""

    @abstractmethod
    def clear(self) -> str:
        """The flush message: the carrier drops everything it has buffered."""

    @property
    def audio(self) -> AudioFormat:
        if self.started is None:
            raise FrameError("the stream has not started")
        return self.started.audio

    @property
    def stream_id(self) -> str:
        return self.started.stream_id if self.started else ""

    def frame_ms(self) -> int:
        """Outbound frame length this carrier wants."""
        return 20


class TwilioLikeDialect(Dialect):
    """Carriers whose frames copy Twilio's: JSON ``event`` frames, of which ``media``, ``mark``,
    ``dtmf`` and ``connected`` have Twilio's bodies, and outbound ``media``/``mark``/``clear``.

    A subclass names itself in errors (``label``), says which field carries the stream id on
    outbound frames (``stream_key``; None: none), and parses its own ``start``, ``stop`` and extras.
    """

    label: ClassVar[str]
    stream_key: ClassVar[str | None]

    def parse(self, raw: str | bytes) -> CarrierEvent:
        data = load_json(raw, self.label)
        event = data.get("event")
        if event == "media":
            return inbound_media(obj(data, "media"))
        if event == "mark":
            return MarkPlayed(text(obj(data, "mark"), "name", "mark."))
        if event == "dtmf":
            return digit(obj(data, "dtmf").get("digit"))
        if event == "connected":
            return Unhandled("connected")
        parsed = self.parse_other(event, data)
        if parsed is None:
            raise FrameError(f"unknown {self.label} event {event!r}")
        return parsed

    @abstractmethod
    def parse_other(self, event: Any, data: dict[str, Any]) -> CarrierEvent | None:
        """The carrier's own events (``start``, ``stop``, errors); None for an unknown event."""

    def _frame(self, event: str, **body: Any) -> str:
        head: dict[str, Any] = {"event": event}
        if self.stream_key is not None:
            head[self.stream_key] = self.stream_id
        return json.dumps({**head, **body})

    def media(self, data: bytes) -> str:
        return self._frame("media", media={"payload": b64(data)})

    def mark(self, name: str) -> str:
        return self._frame("mark", mark={"name": name})

    def clear(self) -> str:
        return self._frame("clear")


# --- helpers -------------------------------------------------------------------------------------


def load_json(raw: str | bytes, carrier: str) -> dict[str, Any]:
    if isinstance(raw, bytes):
        raise FrameError(f"{carrier} sends JSON text frames; got a binary frame of {len(raw)} bytes")
    if len(raw) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(raw)} characters exceeds {MAX_FRAME_BYTES}")
    return json_object(raw)


def json_object(raw: str) -> dict[str, Any]:
    """A frame's JSON object; strict: NaN, Infinity and overflowing numbers are refused too."""
    try:
        data = strict_json_loads(raw)
    except JsonError as exc:
        raise FrameError(f"frame is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FrameError("frame must be a JSON object")
    return data


def obj(data: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise FrameError(f"field '{where}{key}' (object) is missing or not an object")
    return value


def text(data: dict[str, Any], key: str, where: str = "") -> str:
    value = data.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise FrameError(f"field '{where}{key}' (string) is missing or empty")
    return value


def number(value: Any, what: str) -> float | None:
    """Carriers send numbers as numbers or as strings; absent is None."""
    if value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise FrameError(f"field '{what}' is not a number: {value!r}") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise FrameError(f"field '{what}' is not a finite number")
    return out


def payload(media: dict[str, Any], where: str = "media.") -> bytes:
    value = media.get("payload")
    if not isinstance(value, str):
        raise FrameError(f"field '{where}payload' (base64 string) is missing")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise FrameError(f"field '{where}payload' is not valid base64") from None


def inbound_media(media: dict[str, Any]) -> CarrierEvent:
    """A ``media`` body: the caller's audio, or nothing to act on for another track."""
    if media.get("track", "inbound") != "inbound":
        return Unhandled(f"media of track {media.get('track')!r}")
    return AudioIn(payload(media), number(media.get("timestamp"), "media.timestamp"))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def digit(value: Any) -> DigitPressed:
    """One key, in either case (carriers send ``a``-``d`` as well as ``A``-``D``)."""
    if not isinstance(value, str) or len(value) != 1 or value.upper() not in DTMF_DIGITS:
        raise FrameError(f"DTMF digit {value!r} is not one of 0-9, *, #, A-D")
    return DigitPressed(value.upper())


def string_map(value: Any) -> dict[str, str]:
    """Custom parameters as a flat string map (other shapes are dropped, not an error)."""
    if not isinstance(value, dict):
        return {}
    return {str(k): str(v) for k, v in value.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}


def rate(value: Any, allowed: tuple[int, ...], carrier: str) -> int:
    r = number(value, "sample rate")
    if r is None or int(r) not in allowed:
        raise FrameError(f"{carrier} sample rate {value!r} is not supported (one of {list(allowed)})",
                         CLOSE_UNSUPPORTED_DATA)
    return int(r)


def unsupported(what: str) -> FrameError:
    return FrameError(what, CLOSE_UNSUPPORTED_DATA)
