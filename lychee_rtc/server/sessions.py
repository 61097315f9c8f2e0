"""Calls: one transport, one engine slot and one duplex session each.

The manager owns admission (capacity), the offer/answer exchange for WebRTC, every call's lifetime
(connect timeout, media timeout for peers that vanish without closing, maximum duration) and
clean-up, so a slot is always given back. Other ingresses (carrier WebSockets, the SIP gateway)
admit and register their calls here too, so capacity, metrics and ``/v1/sessions`` cover every
call alike. A WebRTC call whose media path breaks is suspended, not ended, for
``session.resume_window_s``: a new offer with the session's token re-attaches it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.exceptions import OperationError
from aiortc.sdp import candidate_from_sdp

from lychee_rtc.config import Settings
from lychee_rtc.engine.base import CapacityError, SessionOptions
from lychee_rtc.engine.scheduler import Engine, EngineSlot
from lychee_rtc.media.codec_threads import limit_codec_threads
from lychee_rtc.media.consent import install_consent_freshness
from lychee_rtc.media.dtmf import MIME_TYPE as TELEPHONE_EVENT, enable_telephone_event, install_dtmf_tap
from lychee_rtc.media.inbound import InboundCounters, consume_audio, drain
from lychee_rtc.media.jitter import install_jitter_buffer
from lychee_rtc.media.outbound import PacedAudioTrack
from lychee_rtc.media.peer import abandon_peer
from lychee_rtc.media.playout import PlayoutCounters
from lychee_rtc.media.sctp_guard import SctpGuard, undelivered_chunks
from lychee_rtc.media.sdp import SdpError, ice_ufrag, negotiated_audio_codec, validate_offer
from lychee_rtc.server.auth import new_session_token, new_whip_resource, secret_matches
from lychee_rtc.server.metrics import ServerMetrics
from lychee_rtc.session.dialect import DialectMap, ResumableDialect
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.protocol import MAX_MESSAGE_BYTES
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.session.sink import AudioSink

log = logging.getLogger(__name__)

CODEC_MIME = {"opus": "audio/opus", "PCMU": "audio/PCMU", "PCMA": "audio/PCMA"}
WATCHDOG_PERIOD_S = 0.25
# How long a closing call waits for its last events to be handed to the transport.
EVENT_DRAIN_S = 1.0
# A call forced closed at the end of the shutdown grace gets this long to close its transport.
FORCED_CLOSE_S = 1.0


class ResumeRefused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class ServerFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("the server is at capacity")
        self.retry_after_s = retry_after_s


class Call(Protocol):
    """What the manager needs of a call, whatever its transport."""

    session: DuplexSession
    tasks: list[asyncio.Task]  # the transport's own tasks, cancelled when the call ends
    watchdog: asyncio.Task | None  # the manager's, set by register()
    token: str | None  # the session's own secret, when its client was given one (server.auth)
    connected_at: float | None
    folded: dict[str, int]

    def snapshot(self) -> dict: ...

    def playout_counters(self) -> PlayoutCounters: ...

    async def close_transport(self) -> None: ...


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
    whip: bool = False
    has_audio: bool = False
    folded: dict[str, int] = field(default_factory=dict)  # counters already added to Prometheus
    # Called with the reason once the call is torn down (a SIP gateway hangs up its leg here).
    on_closed: list[Callable[[str], Awaitable[None] | None]] = field(default_factory=list)
    sctp_guard: SctpGuard | None = None
    # The session's own secret (server.auth). None for a connector's leg (the SIP gateway's): no client
    # holds a token for it, so it never resumes and the server key opens its resource.
    token: str | None = field(default_factory=new_session_token)
    whip_resource: str | None = None  # the WHIP resource id: a capability, like the token
    transport_failure: str | None = None  # why the media path failed, when the transport knows
    watchdog: asyncio.Task | None = None
    negotiated_at: float | None = None  # when the current peer connection was answered
    suspended_at: float | None = None  # the media path was lost then; the session waits for a resume
    suspend_reason: str | None = None
    resuming: bool = False
    resume_from: int | None = None  # last event seq the resuming client has, until its channel opens
    resumes: int = 0

    def playout_counters(self) -> PlayoutCounters:
        return self.track.playout_counters()

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
            "playout_underrun_samples": self.track.playout_counters().underrun_samples,
            "playout_overflow_samples": self.track.playout_counters().overflow_samples,
        })
        return snap


async def abandon(pc: RTCPeerConnection, track: PacedAudioTrack) -> None:
    track.stop()
    await abandon_peer(pc)


class SessionManager:
    def __init__(self, settings: Settings, engine: Engine, metrics: ServerMetrics, dialects: DialectMap) -> None:
        """``dialects``: what each data-channel label speaks (``events``, ``oai-events``), from the server."""
        self.settings = settings
        self.dialects = dialects
        self.engine = engine
        self.metrics = metrics
        self.calls: dict[str, Call] = {}
        self._whip_resources: dict[str, str] = {}  # WHIP resource id -> session id
        limit_codec_threads()
        self._reserved = 0
        self.closing = False  # set at shutdown: no new sessions
        # Put in every session id; a cluster worker sets its worker id here so that an entry can
        # route a session's follow-up requests from the id alone.
        self.id_prefix = ""
        # Offered after the voice codecs, so that callers through a SIP gateway can send keys.
        self._telephone_event = enable_telephone_event()

    @property
    def capacity(self) -> int:
        return min(self.settings.session.max_sessions, self.engine.capabilities.max_sessions)

    @property
    def free(self) -> int:
        return self.capacity - len(self.calls) - self._reserved

    def whip_call(self, resource_id: str) -> RtcCall | None:
        session_id = self._whip_resources.get(resource_id)
        call = self.calls.get(session_id) if session_id is not None else None
        return call if isinstance(call, RtcCall) else None

    def rtc_configuration(self) -> RTCConfiguration:
        # Always explicit: aiortc falls back to a public STUN server when given None.
        servers = [RTCIceServer(urls=s.urls, username=s.username, credential=s.credential)
                   for s in self.settings.rtc.ice_servers]
        return RTCConfiguration(iceServers=servers)

    # --- offer / answer ----------------------------------------------------------------------------

    async def create(self, offer_sdp: str, options: SessionOptions | None = None, whip: bool = False,
                     metrics: bool = False, origin: dict[str, Any] | None = None) -> RtcCall:
        """``origin``: where the call came from when a connector places it (a SIP gateway's caller)."""
        validate_offer(offer_sdp)
        async with self.admission(options or SessionOptions()) as slot:
            call = await self._connect(slot, offer_sdp, options or SessionOptions(), whip, metrics, origin)
        if self.closing:  # shutdown began while this offer was being answered
            await self.close(call.session.id, "server_shutdown")
            raise ServerFull(self.settings.session.retry_after_s)
        return call

    @asynccontextmanager
    async def admission(self, options: SessionOptions) -> AsyncIterator[EngineSlot]:
        """A slot for a new call, or ServerFull. If the body fails, the slot goes back.

        The body must ``register`` its call before it returns; from then on the call owns the slot.
        """
        if self.closing or self.free <= 0:
            self.metrics.sessions_refused.inc()
            raise ServerFull(self.settings.session.retry_after_s)
        self._reserved += 1
        try:
            try:
                slot = await self.engine.open(options)
            except CapacityError:
                self.metrics.sessions_refused.inc()
                raise ServerFull(self.settings.session.retry_after_s) from None
            try:
                yield slot
            except BaseException:
                # Whatever failed (bad SDP, aiortc, cancellation at shutdown), the slot goes back.
                await slot.close()
                raise
        finally:
            self._reserved -= 1

    def new_session(self, slot: EngineSlot, sink: AudioSink, options: SessionOptions,
                    metrics: bool = False, origin: dict[str, Any] | None = None) -> DuplexSession:
        caps = self.engine.capabilities
        return DuplexSession(f"sess_{self.id_prefix}{secrets.token_hex(8)}", self.settings.session, slot, sink,
                             engine_name=caps.name, observer=self.metrics, options=options, metrics_enabled=metrics,
                             origin=origin)

    def register(self, call: Call) -> None:
        """Count the call, start its session and its watchdog; closing the session tears it down."""
        session = call.session
        self.calls[session.id] = call
        self.metrics.sessions_total.inc()
        self.metrics.active_sessions.set(len(self.calls))
        session.on_close = lambda reason: self._teardown(call, reason)
        session.start()
        call.watchdog = asyncio.create_task(self._watchdog(call), name=f"watchdog-{session.id}")

    async def _connect(self, slot, offer_sdp: str, options: SessionOptions, whip: bool, metrics: bool,
                       origin: dict[str, Any] | None) -> RtcCall:
        track = self._new_track()
        session = self.new_session(slot, track, options, metrics, origin)
        call = RtcCall(session=session, pc=RTCPeerConnection(self.rtc_configuration()), track=track, codec="",
                       whip=whip, whip_resource=new_whip_resource(self.id_prefix) if whip else None,
                       token=new_session_token() if origin is None else None)
        await self._negotiate(call, offer_sdp)
        if call.whip_resource is not None:
            self._whip_resources[call.whip_resource] = session.id
        self.register(call)
        return call

    def _new_track(self) -> PacedAudioTrack:
        caps = self.engine.capabilities
        return PacedAudioTrack(in_rate=caps.output_rate, max_buffer_s=self.settings.session.playout_max_s,
                               live=caps.live_passthrough)

    async def _negotiate(self, call: RtcCall, offer_sdp: str) -> None:
        """Answer ``offer_sdp`` on ``call.pc`` with ``call.track``; on failure the peer is abandoned."""
        pc, track = call.pc, call.track
        track.listener = call.session
        self._wire(call, pc)
        # The transceiver exists before the offer is applied so that our codec preferences shape the
        # negotiation (aiortc picks the common codecs while applying the remote description).
        transceiver = pc.addTransceiver(track, direction="sendrecv")
        transceiver.setCodecPreferences(self._codec_preferences())
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            self._guard_data_channel(call)
            install_consent_freshness(pc, self.settings.rtc.ice_consent_timeout_s,
                                      lambda: self._consent_expired(call, pc))
            for other in pc.getTransceivers():
                if other is not transceiver:
                    other.direction = "inactive"  # video or a second audio line: not received at all
            await pc.setLocalDescription(await pc.createAnswer())
        except OperationError:
            await abandon(pc, track)
            offered = ", ".join(self.settings.rtc.codecs)
            raise SdpError(f"no common audio codec: this server accepts {offered}", unprocessable=True) from None
        except BaseException as exc:  # aiortc's parsers raise assorted errors on bad SDP
            await abandon(pc, track)
            if not isinstance(exc, Exception):
                raise
            raise SdpError(f"cannot use SDP offer: {exc}") from None
        codec = negotiated_audio_codec(pc.localDescription.sdp)
        if codec is None or codec[0].lower() == TELEPHONE_EVENT.split("/")[1]:
            await abandon(pc, track)
            offered = ", ".join(self.settings.rtc.codecs)
            raise SdpError(f"no common audio codec: this server accepts {offered}", unprocessable=True)
        call.codec = codec[0]
        track.set_output_rate(48000 if codec[0].lower() == "opus" else codec[1])
        call.etag = f'"{ice_ufrag(pc.localDescription.sdp) or call.session.id}"'
        call.negotiated_at = time.monotonic()

    # --- losing the media path, and resuming -------------------------------------------------------

    async def lose_path(self, call: RtcCall, reason: str) -> None:
        """The media path is gone: keep the session for ``session.resume_window_s``, or close it."""
        session = call.session
        if session.closed or call.suspended_at is not None:
            return
        if self.settings.session.resume_window_s <= 0 or self.closing or call.token is None:
            await self.close(session.id, reason)
            return
        call.suspended_at, call.suspend_reason = time.monotonic(), reason
        log.info("session %s: media path lost (%s); it may resume within %.0f s", session.id, reason,
                 self.settings.session.resume_window_s)
        session.suspend(reason)
        pc, track, tasks = call.pc, call.track, call.tasks
        call.tasks = []
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        await abandon(pc, track)

    async def resume(self, session_id: str, session_token: str, offer_sdp: str, last_seq: int) -> RtcCall:
        """Re-attach session ``session_id`` to a new peer connection answering ``offer_sdp``.

        The old connection, if the server still thinks it alive, is dropped for good first. The
        session keeps its engine slot (the model's context), its epoch counter and its event
        sequence; the new channel first gets the events after ``last_seq`` from the journal.
        """
        validate_offer(offer_sdp)
        call = self.calls.get(session_id)
        if not isinstance(call, RtcCall) or call.session.closed or self.closing:
            raise ResumeRefused(404, "session_not_found", f"no session {session_id!r} to resume")
        if not secret_matches(session_token, call.token):
            raise ResumeRefused(401, "unauthorized", "wrong session_token for this session")
        if call.resuming:
            raise ResumeRefused(409, "resume_in_progress", "this session is already being resumed")
        call.resuming = True
        try:
            await self.lose_path(call, "replaced")
            if call.session.closed:
                raise ResumeRefused(404, "session_not_found", f"no session {session_id!r} to resume")
            call.pc, call.track = RTCPeerConnection(self.rtc_configuration()), self._new_track()
            call.has_audio, call.connected_at, call.transport_failure = False, None, None
            await self._negotiate(call, offer_sdp)  # on failure the session stays suspended
            call.session.rebind_sink(call.track)
            call.resume_from = max(0, int(last_seq))
            call.suspended_at = None
            call.resumes += 1
            self.metrics.sessions_resumed.inc()
            log.info("session %s resumed (from event %d)", session_id, call.resume_from)
            return call
        finally:
            call.resuming = False

    def _consent_expired(self, call: RtcCall, pc: RTCPeerConnection) -> None:
        if call.pc is not pc:
            return
        call.transport_failure = "ice_consent_expired"
        log.warning("session %s: ICE consent expired: no consent check answered for %.0f s; closing the call",
                    call.session.id, self.settings.rtc.ice_consent_timeout_s)

    def _guard_data_channel(self, call: RtcCall) -> None:
        """Bound data-channel messages while their fragments arrive (and advertise the bound)."""
        if call.pc.sctp is None:
            return
        session = call.session

        def overflow(what: str) -> None:
            asyncio.ensure_future(self.close(session.id, "data_channel_overflow"))

        guard = SctpGuard(MAX_MESSAGE_BYTES, on_oversize=lambda _stream, size: session.reject_oversize(size),
                          on_overflow=overflow)
        if guard.install(call.pc.sctp):
            call.sctp_guard = guard

    def _codec_preferences(self) -> list:
        available = {c.mimeType.lower(): c for c in RTCRtpSender.getCapabilities("audio").codecs}
        voice = [available[CODEC_MIME[name].lower()] for name in self.settings.rtc.codecs
                 if CODEC_MIME[name].lower() in available]
        return voice + [self._telephone_event]

    def _wire(self, call: RtcCall, pc: RTCPeerConnection) -> None:
        session = call.session

        @pc.on("track")
        def on_track(track) -> None:
            if call.pc is not pc:
                return
            # aiortc queues received frames without bound until someone reads them, so every track
            # is consumed: the first audio track feeds the session, anything else is drained.
            if track.kind == "audio":
                install_dtmf_tap(pc, track, lambda digit: session.push_dtmf(digit, "rfc4733"))
            if track.kind == "audio" and not call.has_audio:
                call.has_audio = True
                install_jitter_buffer(pc, track, self.settings.rtc)
                task = consume_audio(track, session, call.inbound)
            else:
                task = drain(track)
            call.tasks.append(asyncio.create_task(task, name=f"inbound-{session.id}-{track.kind}"))

        @pc.on("datachannel")
        def on_datachannel(channel) -> None:
            factory = self.dialects.get(channel.label)
            if call.pc is not pc or factory is None:
                return
            dialect = factory(session, EventChannel(channel.send, lambda: channel.bufferedAmount))
            channel.on("message", dialect.handle_message)
            channel.on("close", dialect.detach)
            if call.resume_from is not None and isinstance(dialect, ResumableDialect):
                last_seq, call.resume_from = call.resume_from, None
                dialect.resume(last_seq)
            else:
                dialect.attach()

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if call.pc is not pc or call.suspended_at is not None:  # replaced, or already given up
                return
            if pc.connectionState == "connected" and call.connected_at is None:
                call.connected_at = time.monotonic()
            elif pc.connectionState == "closed":  # the peer closed DTLS: it hung up on purpose
                await self.close(session.id, call.transport_failure or "connection_closed")
            elif pc.connectionState == "failed":  # the path broke: the client may come back
                await self.lose_path(call, call.transport_failure or "connection_failed")

    # --- trickle ICE (WHIP PATCH) ------------------------------------------------------------------

    async def add_remote_candidates(self, call: RtcCall, fragment: str) -> None:
        """Apply an SDP fragment of remote candidates; a new ufrag (ICE restart) is not supported."""
        ufrag = ice_ufrag(fragment)
        remote = call.pc.remoteDescription
        if ufrag is not None and remote is not None and ufrag != ice_ufrag(remote.sdp):
            raise SdpError("ICE restart is not supported", unprocessable=True)
        mid = None
        count = 0
        for line in fragment.splitlines():
            if line.startswith("a=mid:"):
                mid = line[len("a=mid:"):].strip()
            elif line.startswith("a=candidate:"):
                try:
                    candidate = candidate_from_sdp(line[len("a="):])
                except Exception as exc:
                    raise SdpError(f"malformed candidate line {line[:80]!r}: {exc}") from None
                candidate.sdpMid = mid
                candidate.sdpMLineIndex = 0 if mid is None else None
                await call.pc.addIceCandidate(candidate)
                count += 1
        if count == 0 and "a=end-of-candidates" not in fragment:
            raise SdpError("trickle fragment has no a=candidate or a=end-of-candidates line")

    # --- lifetime ----------------------------------------------------------------------------------

    async def _watchdog(self, call: Call) -> None:
        s = self.settings.session
        session = call.session
        rtc = call if isinstance(call, RtcCall) else None  # only a WebRTC path can be lost and resumed
        try:
            while not session.closed:
                await asyncio.sleep(WATCHDOG_PERIOD_S)
                now = time.monotonic()
                self._fold_counters(call)
                self.metrics.playout_depth.observe(session.sink.depth_ms / 1000.0)
                if now - session.created_at > s.max_duration_s:
                    await self.close(session.id, "max_duration")
                elif rtc is not None and rtc.suspended_at is not None:
                    if now - rtc.suspended_at > s.resume_window_s and not rtc.resuming:
                        await self.close(session.id, rtc.suspend_reason or "connection_lost")
                elif call.connected_at is None:
                    started = (rtc.negotiated_at if rtc is not None else None) or session.created_at
                    if now - started > s.connect_timeout_s:
                        await self._path_lost(call, "connect_timeout")
                elif now - max(session.last_audio_at or 0.0, call.connected_at) > s.media_timeout_s:
                    await self._path_lost(call, "media_timeout")
        except asyncio.CancelledError:
            pass

    async def _path_lost(self, call: Call, reason: str) -> None:
        if isinstance(call, RtcCall):
            await self.lose_path(call, reason)
        else:
            await self.close(call.session.id, reason)

    def _fold_counters(self, call: Call) -> None:
        clock = call.session.window_clock.counters
        current = {
            "underruns": clock.underruns,
            "late": clock.late_samples,
            "gap": clock.gap_samples,
            "overload": call.session.slot.counters.windows_dropped,
            "playout_underrun": call.playout_counters().underrun_samples,
        }
        targets = {
            "underruns": self.metrics.underrun_windows,
            "late": self.metrics.late_samples,
            "gap": self.metrics.gap_samples,
            "overload": self.metrics.overload_windows,
            "playout_underrun": self.metrics.playout_underrun_samples,
        }
        for key, value in current.items():
            delta = value - call.folded.get(key, 0)
            if delta > 0:
                targets[key].inc(delta)
            call.folded[key] = value

    async def close(self, session_id: str, reason: str) -> bool:
        call = self.calls.get(session_id)
        if call is None:
            return False
        await call.session.close(reason)  # calls _teardown through session.on_close
        return True

    async def _teardown(self, call: Call, reason: str) -> None:
        if self.calls.pop(call.session.id, None) is None:
            return
        self._forget_whip_resource(call)
        log.info("session %s closed: %s", call.session.id, reason)
        self.metrics.sessions_closed.labels(reason).inc()
        self._fold_counters(call)
        self.metrics.active_sessions.set(len(self.calls))
        current = asyncio.current_task()
        for task in [*call.tasks, call.watchdog]:
            if task is not None and task is not current:
                task.cancel()
        await call.close_transport()
        for callback in getattr(call, "on_closed", ()):
            try:
                result = callback(reason)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # one listener's failure must not keep the others from hearing
                log.exception("session %s: close listener failed", call.session.id)

    def _forget_whip_resource(self, call: Call) -> None:
        if isinstance(call, RtcCall) and call.whip_resource is not None:
            self._whip_resources.pop(call.whip_resource, None)

    async def close_all(self, reason: str) -> None:
        """Close every call within ``server.shutdown_grace_s``; calls still open then are torn down."""
        self.closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.server.shutdown_grace_s
        while (self.calls or self._reserved) and loop.time() < deadline:
            remaining = deadline - loop.time()
            # Each close is awaited as a task: a call that is already closing is waited for (not
            # skipped in a loop that never yields, which would starve the teardown it waits on).
            closing = [asyncio.ensure_future(self.close(session_id, reason)) for session_id in list(self.calls)]
            if closing:
                await asyncio.wait(closing, timeout=remaining)
            else:  # offers still being answered: they are closed as soon as they finish
                await asyncio.sleep(min(0.05, remaining))
        for call in list(self.calls.values()):
            log.warning("session %s did not close within %.1f s of shutdown: forcing it",
                        call.session.id, self.settings.server.shutdown_grace_s)
            await self._force_teardown(call, reason)

    async def _force_teardown(self, call: Call, reason: str) -> None:
        self.calls.pop(call.session.id, None)
        self.metrics.sessions_closed.labels(reason).inc()
        self._forget_whip_resource(call)
        self.metrics.active_sessions.set(len(self.calls))
        for task in [*call.tasks, call.watchdog]:
            if task is not None:
                task.cancel()
        # The engine frees the slot when it stops; the transport gets a bounded chance to close.
        closing = asyncio.ensure_future(call.close_transport())
        done, _ = await asyncio.wait([closing], timeout=FORCED_CLOSE_S)
        if not done:
            closing.cancel()
        elif closing.exception() is not None:
            log.warning("session %s: transport failed to close: %r", call.session.id, closing.exception())
