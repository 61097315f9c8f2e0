"""Checks on offered SDP before it reaches aiortc, which accepts some garbage silently."""

from __future__ import annotations

import re
from dataclasses import dataclass

from lychee_rtc.strict_text import control_characters


# RFC 5888 / RFC 4566 token characters: what a media id may be.
MID_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`{|}~]{1,32}")


class SdpError(ValueError):
    """The offer is malformed (HTTP 400) or acceptable SDP we cannot serve (``unprocessable``, 422)."""

    def __init__(self, message: str, unprocessable: bool = False) -> None:
        super().__init__(message)
        self.unprocessable = unprocessable


@dataclass(frozen=True)
class MediaSection:
    kind: str
    port: int
    payload_types: tuple[str, ...]
    rtpmap: dict[str, str]  # payload type -> "opus/48000/2"
    direction: str
    mid: str | None = None


def parse_media_sections(sdp: str) -> list[MediaSection]:
    sections: list[MediaSection] = []
    current: dict | None = None
    for line in sdp.replace("\r\n", "\n").split("\n"):
        if line.startswith("m="):
            if current is not None:
                sections.append(MediaSection(**current))
            parts = line[2:].split()
            if len(parts) < 3 or not re.fullmatch(r"[0-9]{1,5}", parts[1].split("/")[0]):
                raise SdpError(f"malformed media line {line!r}")
            current = {"kind": parts[0], "port": int(parts[1].split("/")[0]), "payload_types": tuple(parts[3:]),
                       "rtpmap": {}, "direction": "sendrecv"}
        elif current is not None and line.startswith("a=rtpmap:"):
            pt, _, codec = line[len("a=rtpmap:"):].partition(" ")
            current["rtpmap"][pt] = codec.strip()
        elif current is not None and line.startswith("a=mid:"):
            current["mid"] = line[len("a=mid:"):]  # as aiortc reads it: no trimming
        elif current is not None and line[2:] in ("sendrecv", "sendonly", "recvonly", "inactive") and line.startswith("a="):
            current["direction"] = line[2:]
    if current is not None:
        sections.append(MediaSection(**current))
    return sections


def sdp_lines(sdp: str, what: str = "SDP offer") -> list[str]:
    """The lines of ``sdp`` (CRLF or LF ends a line, RFC 8866 section 5), none of which may hold
    another control character: a lone CR, a NUL or a vertical tab inside a value is refused, not
    read one way here and another by aiortc or Janus."""
    lines = sdp.replace("\r\n", "\n").split("\n")
    while lines and not lines[-1]:
        lines.pop()
    for number, line in enumerate(lines, 1):
        bad = control_characters(line)
        if bad:
            raise SdpError(f"{what}: line {number} contains control characters ({', '.join(bad)})")
    return lines


def validate_offer(sdp: str) -> list[MediaSection]:
    if not sdp.strip():
        raise SdpError("SDP offer is empty")
    lines = sdp_lines(sdp)
    while not lines[0].strip():
        lines.pop(0)
    if lines[0].strip() != "v=0":
        raise SdpError("SDP offer must start with 'v=0'")
    for line in lines:
        if not re.match(r"^[a-z]=", line):
            raise SdpError(f"malformed SDP line {line[:60]!r}: expected '<letter>=<value>'")
    for field in ("o=", "s=", "t="):
        if not any(line.startswith(field) for line in lines):
            raise SdpError(f"SDP offer has no '{field}' line")
    sections = parse_media_sections(sdp)
    if not sections:
        raise SdpError("SDP offer has no media sections")
    if not any(s.kind == "audio" and s.port != 0 for s in sections):
        raise SdpError("SDP offer has no active audio media section (m=audio)", unprocessable=True)
    if "a=ice-ufrag:" not in sdp or "a=ice-pwd:" not in sdp:
        raise SdpError("SDP offer lacks ICE credentials (a=ice-ufrag / a=ice-pwd)")
    if "a=fingerprint:" not in sdp:
        raise SdpError("SDP offer lacks a DTLS fingerprint (a=fingerprint)")
    _check_bundle(lines, sections)
    return sections


def _check_bundle(lines: list[str], sections: list[MediaSection]) -> None:
    """Every mid a BUNDLE group names must be a media section of this offer (RFC 9143)."""
    mids = [s.mid for s in sections if s.mid is not None]
    for mid in mids:
        if not MID_TOKEN.fullmatch(mid):
            raise SdpError(f"a=mid:{mid[:40]!r} is not a valid media id (RFC 5888: 1 to 32 token characters)")
    duplicates = sorted({m for m in mids if mids.count(m) > 1})
    if duplicates:
        raise SdpError(f"SDP offer uses a=mid:{duplicates[0]} for more than one media section")
    for line in lines:
        if not line.startswith("a=group:"):
            continue
        semantic, *items = line[len("a=group:"):].split()
        if semantic != "BUNDLE":
            continue
        if not items:
            raise SdpError("a=group:BUNDLE names no media section")
        for item in items:
            if item not in mids:
                raise SdpError(f"a=group:BUNDLE names mid {item!r}, but no media section has a=mid:{item}")


def negotiated_audio_codec(answer_sdp: str) -> tuple[str, int] | None:
    """(codec name, clock rate) of the first payload of the first active audio section."""
    for section in parse_media_sections(answer_sdp):
        if section.kind == "audio" and section.port != 0 and section.payload_types:
            codec = section.rtpmap.get(section.payload_types[0], "")
            name, _, rest = codec.partition("/")
            rate = int(rest.split("/")[0]) if rest else 8000
            return name, rate
    return None


def ice_ufrag(sdp: str) -> str | None:
    m = re.search(r"^a=ice-ufrag:(\S+)", sdp, re.MULTILINE)
    return m.group(1) if m else None
