"""RFC 4733 telephone-events (DTMF keys) on the WebRTC audio leg.

aiortc knows no ``telephone-event`` codec, so without help it can neither negotiate one nor survive
receiving one (its decoder thread has no decoder for it and stops). Two small additions make it
work, and nothing else in aiortc changes:

* ``telephone-event/8000`` joins aiortc's audio capabilities, so our codec preferences can put it
  after the voice codecs: answers then carry it when the offer does (a SIP gateway such as Janus
  mirrors our answer to the caller, who then sends RFC 4733 packets instead of in-band tones);
* each receiver gets a tap in front of its RTP handler that takes telephone-event packets out of
  the media stream and decodes them here; everything else goes on to aiortc untouched.

We never send telephone-events: the voice codec stays first, and aiortc encodes only the first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from aiortc import RTCRtpCodecCapability, RTCRtpCodecParameters, RTCRtpSender
from aiortc import codecs as aiortc_codecs

from lychee_rtc.engine.base import DTMF_DIGITS

log = logging.getLogger(__name__)

MIME_TYPE = "audio/telephone-event"
CLOCK_RATE = 8000
DEFAULT_PAYLOAD_TYPE = 101  # what most SIP gear uses; the offer's own number wins in an answer


@dataclass(frozen=True)
class TelephoneEvent:
    """One RFC 4733 payload (section 2.3): the key, the end flag, volume (-dBm0) and duration (ticks)."""

    event: int
    end: bool
    volume: int
    duration: int

    @property
    def digit(self) -> str | None:
        return DTMF_DIGITS[self.event] if self.event < len(DTMF_DIGITS) else None


def parse_telephone_event(payload: bytes) -> TelephoneEvent:
    if len(payload) < 4:
        raise ValueError(f"telephone-event payload of {len(payload)} bytes, expected at least 4")
    return TelephoneEvent(event=payload[0], end=bool(payload[1] & 0x80), volume=payload[1] & 0x3F,
                          duration=int.from_bytes(payload[2:4], "big"))


def enable_telephone_event() -> RTCRtpCodecCapability:
    """Add telephone-event/8000 to aiortc's audio capabilities (once); return its capability."""
    audio = aiortc_codecs.CODECS["audio"]
    if not any(c.mimeType.lower() == MIME_TYPE for c in audio):
        audio.append(RTCRtpCodecParameters(mimeType=MIME_TYPE, clockRate=CLOCK_RATE, channels=1,
                                           payloadType=DEFAULT_PAYLOAD_TYPE))
    for capability in RTCRtpSender.getCapabilities("audio").codecs:
        if capability.mimeType.lower() == MIME_TYPE:
            return capability
    raise RuntimeError("aiortc did not take the telephone-event codec")  # pragma: no cover


class DtmfDecoder:
    """Turns a stream of telephone-event packets into key presses, each reported once.

    A key press is one event: every packet of it carries the same RTP timestamp (its start), and
    the final packet is sent three times; a new timestamp (or a new key) is a new press.
    """

    def __init__(self, on_digit: Callable[[str], None]) -> None:
        self._on_digit = on_digit
        self._current: tuple[int, int] | None = None  # (ssrc, timestamp) of the press being heard
        self.events = 0
        self.bad_packets = 0

    def feed(self, ssrc: int, timestamp: int, payload: bytes) -> None:
        try:
            event = parse_telephone_event(payload)
        except ValueError:
            self.bad_packets += 1
            return
        digit = event.digit
        if digit is None:  # tones beyond the keypad (RFC 4734 line events): not keys
            return
        key = (ssrc, timestamp)
        if key == self._current:
            return
        self._current = key
        self.events += 1
        self._on_digit(digit)


def install_dtmf_tap(pc, track, on_digit: Callable[[str], None]) -> DtmfDecoder | None:
    """Divert telephone-event packets of ``track``'s receiver to a decoder calling ``on_digit``."""
    for transceiver in pc.getTransceivers():
        receiver = transceiver.receiver
        if receiver is None or receiver.track is not track:
            continue
        codecs = getattr(receiver, "_RTCRtpReceiver__codecs", None)
        handle = getattr(receiver, "_handle_rtp_packet", None)
        if codecs is None or handle is None:
            log.warning("aiortc's receiver lacks the fields the DTMF tap needs; telephone-events are ignored")
            return None
        decoder = DtmfDecoder(on_digit)

        async def handle_rtp_packet(packet, arrival_time_ms: int) -> None:
            # The payload map is filled when the transport starts, so it is read per packet.
            codec = codecs.get(packet.payload_type)
            if codec is not None and codec.mimeType.lower() == MIME_TYPE:
                decoder.feed(packet.ssrc, packet.timestamp, packet.payload)
                return
            await handle(packet, arrival_time_ms)

        receiver._handle_rtp_packet = handle_rtp_packet
        return decoder
    return None
