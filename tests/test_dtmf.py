"""RFC 4733 telephone-events: payload parsing, one key per press, and the codec in our answers."""

import struct

import pytest
from aiortc import RTCPeerConnection, RTCRtpSender

from lychee_rtc.rtc.dtmf import DtmfDecoder, enable_telephone_event, parse_telephone_event


def payload(event: int, end: bool, duration: int, volume: int = 10) -> bytes:
    return bytes([event, (0x80 if end else 0) | volume]) + struct.pack("!H", duration)


def test_payload_fields():
    ev = parse_telephone_event(payload(11, True, 800, volume=7))
    assert (ev.digit, ev.end, ev.volume, ev.duration) == ("#", True, 7, 800)
    assert parse_telephone_event(payload(16, False, 160)).digit is None  # beyond the keypad
    with pytest.raises(ValueError):
        parse_telephone_event(b"\x01\x02")


def test_each_press_is_reported_once_whatever_its_packets():
    keys: list[str] = []
    decoder = DtmfDecoder(keys.append)
    for ts, key in ((1000, 5), (1800, 11), (2600, 5)):  # "5", "#", then "5" again
        for duration, end in ((160, False), (320, False), (480, True), (480, True), (480, True)):
            decoder.feed(0xABC, ts, payload(key, end, duration))
    decoder.feed(0xABC, 3400, b"\x00")
    assert keys == ["5", "#", "5"] and decoder.bad_packets == 1


async def test_answers_carry_telephone_event_after_the_voice_codec_when_offered():
    capability = enable_telephone_event()
    offerer, answerer = RTCPeerConnection(), RTCPeerConnection()
    try:
        offerer.addTransceiver("audio", direction="sendrecv")
        await offerer.setLocalDescription(await offerer.createOffer())
        assert "telephone-event/8000" in offerer.localDescription.sdp
        transceiver = answerer.addTransceiver("audio", direction="sendrecv")
        pcmu = next(c for c in RTCRtpSender.getCapabilities("audio").codecs if c.mimeType == "audio/PCMU")
        transceiver.setCodecPreferences([pcmu, capability])
        await answerer.setRemoteDescription(offerer.localDescription)
        await answerer.setLocalDescription(await answerer.createAnswer())
        media = next(l for l in answerer.localDescription.sdp.splitlines() if l.startswith("m=audio"))
        payload_types = media.split()[3:]
        assert payload_types[0] == "0" and len(payload_types) == 2  # PCMU first, then telephone-event
        assert f"a=rtpmap:{payload_types[1]} telephone-event/8000" in answerer.localDescription.sdp
    finally:
        await offerer.close()
        await answerer.close()
