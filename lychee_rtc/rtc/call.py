"""One WebRTC call: its peer connection, paced outbound track and counters (a ``calls.Call``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiortc import RTCPeerConnection

from lychee_rtc.aio import cancel_and_wait
from lychee_rtc.calls.tokens import ClientKey, Opener
from lychee_rtc.media.playout import PlayoutCounters
from lychee_rtc.media.uplink import InboundCounters
from lychee_rtc.rtc.outbound import PacedAudioTrack
from lychee_rtc.rtc.peer import abandon_peer
from lychee_rtc.rtc.sctp_guard import SctpGuard, undelivered_chunks
from lychee_rtc.session.session import DuplexSession

# How long a closing call waits for its last events to be handed to the transport.
EVENT_DRAIN_S = 1.0
# A dropped path's readers get this long to end.
TASK_END_S = 1.0


@dataclass
class RtcCall:
    session: DuplexSession
    pc: RTCPeerConnection
    track: PacedAudioTrack
    codec: str
    inbound: InboundCounters = field(default_factory=InboundCounters)
    tasks: list[asyncio.Task] = field(default_factory=list)
    connected_at: float | None = None
    etag: str = ""
    answer_sdp: str = ""  # what the peer is given (our answer, or our offer for a placed call), with a=ptime
    has_audio: bool = False
    folded: dict[str, int] = field(default_factory=dict)  # counters already added to Prometheus
    # Called with the reason once the call is torn down (a SIP gateway hangs up its leg here).
    on_closed: list[Callable[[str], Awaitable[None] | None]] = field(default_factory=list)
    sctp_guard: SctpGuard | None = None
    # The session's own secret (calls.tokens), handed to its client. None for a call nobody was given
    # one (a WHIP call holds its resource URL instead; the SIP gateway's inbound legs): then only
    # the server key opens its resources.
    token: str | None = None
    whip_resource: str | None = None  # the WHIP resource id: a capability, like the token
    client_key: ClientKey | None = None  # the ek_ key the call was opened with: it opens it too
    # A client that holds the token and speaks the resume protocol (a JSON offer's): a lost path is
    # held for the resume window. Any other call ends when its path is lost.
    resumable: bool = False
    transport_failure: str | None = None  # why the media path failed, when the transport knows
    watchdog: asyncio.Task | None = None
    negotiated_at: float | None = None  # when the current peer connection was answered
    suspended_at: float | None = None  # the media path was lost then; the session waits for a resume
    path_lost_at: float | None = None  # the first loss not yet followed by a connected path
    suspend_reason: str | None = None
    resuming: bool = False
    resume_from: int | None = None  # last event seq the resuming client has, until its channel opens
    resumes: int = 0

    def opener(self) -> Opener:
        secrets = tuple(s for s in (self.whip_resource, self.token) if s)
        return Opener(secrets=secrets, client_key=self.client_key)

    def connect_started_at(self) -> float:
        return self.negotiated_at or self.session.created_at

    def playout_counters(self) -> PlayoutCounters:
        return self.track.playout_counters()

    async def drop_path(self) -> None:
        """The peer connection is lost: stop reading it and drop it; the session stays for a resume."""
        pc, track, tasks = self.pc, self.track, self.tasks
        self.tasks = []
        await cancel_and_wait(tasks, TASK_END_S)
        await abandon(pc, track)

    async def close_transport(self) -> None:
        """Give the last events (session.closed above all) a moment to be delivered, then drop the peer."""
        deadline = time.monotonic() + EVENT_DRAIN_S
        while (self.session.events.buffered() > 0 or undelivered_chunks(self.pc.sctp) > 0) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await abandon(self.pc, self.track)

    def snapshot(self) -> dict:
        snap = self.session.snapshot()
        snap["transport"] = "webrtc"
        snap["connection_state"] = "suspended" if self.suspended_at is not None else self.pc.connectionState
        snap["codec"] = self.codec
        snap["counters"].update({
            "inbound_frames": self.inbound.frames,
            "inbound_gaps": self.inbound.gaps,
            "inbound_reordered_frames": self.inbound.reordered_frames,
            "resumes": self.resumes,
            "outbound_frames": self.track.counters.frames,
            "outbound_stale_chunks": self.track.counters.stale_chunks,
            "outbound_skipped_frames": self.track.counters.skipped_frames,  # slots a sender stall took
            "playout_underrun_samples": self.track.playout_counters().underrun_samples,
            "playout_overflow_samples": self.track.playout_counters().overflow_samples,
        })
        return snap


async def abandon(pc: RTCPeerConnection, track: PacedAudioTrack) -> None:
    track.stop()
    await abandon_peer(pc)
