"""Typed carrier events, the audio formats carriers use, and the error a malformed frame raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

import numpy as np

from lychee_rtc.telephony.g711 import g711_decode, g711_encode, pcm16_decode, pcm16_encode

# WebSocket close codes (RFC 6455 section 7.4.1) used towards carriers.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_INVALID_PAYLOAD = 1007
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN_LATER = 1013


class FrameError(ValueError):
    """A frame we cannot use; ``close_code`` is what the connection closes with if it is fatal."""

    def __init__(self, message: str, close_code: int = CLOSE_INVALID_PAYLOAD) -> None:
        super().__init__(message)
        self.close_code = close_code


@dataclass(frozen=True)
class AudioFormat:
    encoding: Literal["mulaw", "alaw", "pcm16"]
    rate: int

    @property
    def label(self) -> str:
        name = {"mulaw": "PCMU", "alaw": "PCMA", "pcm16": "L16"}[self.encoding]
        return f"{name}/{self.rate}"

    def decode(self, payload: bytes) -> np.ndarray:
        if self.encoding == "pcm16":
            try:
                return pcm16_decode(payload)
            except ValueError as exc:
                raise FrameError(str(exc)) from None
        return g711_decode(payload, self.encoding)

    def encode(self, samples: np.ndarray) -> bytes:
        if self.encoding == "pcm16":
            return pcm16_encode(samples)
        return g711_encode(samples, self.encoding)


@dataclass(frozen=True)
class StreamStarted:
    call_id: str
    stream_id: str
    audio: AudioFormat
    # Custom parameters (Twilio <Parameter>, Plivo extraHeaders, Vonage headers): strings only.
    parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AudioIn:
    payload: bytes
    timestamp_ms: float | None = None  # stream time of the first sample, when the carrier says


@dataclass(frozen=True)
class DigitPressed:
    digit: str


@dataclass(frozen=True)
class MarkPlayed:
    name: str


@dataclass(frozen=True)
class PlaybackCleared:
    """The carrier confirms that our flush emptied its buffer."""


@dataclass(frozen=True)
class StreamStopped:
    reason: str


@dataclass(frozen=True)
class CarrierReported:
    """The carrier reports an error on its side."""

    message: str


@dataclass(frozen=True)
class Unhandled:
    """A well-formed frame that needs nothing from us (``connected``, the other track, ...)."""

    what: str


CarrierEvent = Union[StreamStarted, AudioIn, DigitPressed, MarkPlayed, PlaybackCleared, StreamStopped,
                     CarrierReported, Unhandled]
