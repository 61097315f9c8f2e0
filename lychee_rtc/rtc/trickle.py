"""Trickle ICE (a WHIP PATCH): remote candidates from an SDP fragment, applied to a peer connection."""

from __future__ import annotations

from aiortc import RTCPeerConnection
from aiortc.sdp import candidate_from_sdp

from lychee_rtc.rtc.sdp import SdpError, ice_ufrag, sdp_lines


async def add_remote_candidates(pc: RTCPeerConnection, fragment: str) -> None:
    """Apply an SDP fragment of remote candidates; a new ufrag (ICE restart) is not supported."""
    ufrag = ice_ufrag(fragment)
    remote = pc.remoteDescription
    if ufrag is not None and remote is not None and ufrag != ice_ufrag(remote.sdp):
        raise SdpError("ICE restart is not supported", unprocessable=True)
    mid = None
    count = 0
    for line in sdp_lines(fragment, "trickle fragment"):
        if line.startswith("a=mid:"):
            mid = line[len("a=mid:"):].strip()
        elif line.startswith("a=candidate:"):
            try:
                candidate = candidate_from_sdp(line[len("a="):])
            except Exception as exc:
                raise SdpError(f"malformed candidate line {line[:80]!r}: {exc}") from None
            candidate.sdpMid = mid
            candidate.sdpMLineIndex = 0 if mid is None else None
            await pc.addIceCandidate(candidate)
            count += 1
    if count == 0 and "a=end-of-candidates" not in fragment:
        raise SdpError("trickle fragment has no a=candidate or a=end-of-candidates line")
