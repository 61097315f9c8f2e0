"""WebRTC calls: the offer/answer exchange, resume and the WHIP resource map (trickle ICE: ``trickle``).

Every call is admitted and registered through the ``CallRegistry`` like any other. A call whose
media path breaks is held by the registry for ``session.resume_window_s``: a new offer with the
session's token re-attaches it here (``resume``) to a new peer connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.exceptions import OperationError

from lychee_rtc.aio import cancel_and_wait, spawn_kept
from lychee_rtc.calls.call import Call, ServerFull
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.calls.tokens import ClientKey, digest, new_session_token, new_whip_resource, secret_matches
from lychee_rtc.config import Settings
from lychee_rtc.engine.base import SessionOptions
from lychee_rtc.engine.scheduler import EngineSlot
from lychee_rtc.rtc.call import TASK_END_S, RtcCall, abandon
from lychee_rtc.rtc.codec_threads import limit_codec_threads
from lychee_rtc.rtc.consent import install_consent_freshness
from lychee_rtc.rtc.dtmf import MIME_TYPE as TELEPHONE_EVENT, enable_telephone_event, install_dtmf_tap
from lychee_rtc.rtc.inbound import InboundAudio, InlineDecoder, consume_audio, drain
from lychee_rtc.rtc.inline_encoder import install_inline_encoding
from lychee_rtc.rtc.jitter import install_jitter_buffer
from lychee_rtc.rtc.outbound import PacedAudioTrack
from lychee_rtc.rtc.packet_time import EncoderHints, with_ptime
from lychee_rtc.rtc.peer import quiet_connects_of_closed_peers, quiet_sends_after_close
from lychee_rtc.rtc.round_trip import watch_round_trip
from lychee_rtc.rtc.sctp_guard import SctpGuard
from lychee_rtc.rtc.sdp import SdpError, ice_ufrag, negotiated_audio_codec, validate_offer
from lychee_rtc.session.dialect import DialectMap, ResumableDialect
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.protocol import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

CODEC_MIME = {"opus": "audio/opus", "PCMU": "audio/PCMU", "PCMA": "audio/PCMA"}


class ResumeRefused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class RtcNegotiator:
    def __init__(self, settings: Settings, registry: CallRegistry, dialects: DialectMap) -> None:
        self.settings = settings
        self.registry = registry
        self.dialects = dialects  # data-channel label -> the dialect spoken on it
        self._calls: dict[str, RtcCall] = {}  # session id -> this transport's registered calls
        self._whip_resources: dict[str, str] = {}  # WHIP resource id -> session id
        self._resumable: dict[str, str] = {}  # hash of a resumable call's token -> session id
        self._overflow_closes: set[asyncio.Task] = set()  # calls closing for a data channel overflow
        registry.on_removed.append(self._forget)
        limit_codec_threads()
        # Offered after the voice codecs, so that callers through a SIP gateway can send keys.
        self._telephone_event = enable_telephone_event()

    def whip_call(self, resource_id: str) -> RtcCall | None:
        session_id = self._whip_resources.get(resource_id)
        return self._calls.get(session_id) if session_id is not None else None

    def call_by_token(self, token: str | None) -> RtcCall | None:
        """The resumable call whose session token ``token`` is (a resume's bearer), if any."""
        session_id = self._resumable.get(digest(token)) if token else None
        call = self._calls.get(session_id) if session_id is not None else None
        return call if call is not None and secret_matches(token, call.token) else None

    def _forget(self, call: Call) -> None:
        mine = self._calls.pop(call.session.id, None)
        if mine is not None and mine.whip_resource is not None:
            self._whip_resources.pop(mine.whip_resource, None)
        if mine is not None and mine.token is not None:
            self._resumable.pop(digest(mine.token), None)

    def rtc_configuration(self) -> RTCConfiguration:
        # Always explicit: aiortc falls back to a public STUN server when given None.
        servers = [RTCIceServer(urls=s.urls, username=s.username, credential=s.credential)
                   for s in self.settings.rtc.ice_servers]
        return RTCConfiguration(iceServers=servers)

    # --- offer / answer ----------------------------------------------------------------------------

    async def create(self, offer_sdp: str, options: SessionOptions | None = None, whip: bool = False,
                     metrics: bool = False, origin: dict[str, Any] | None = None, record: bool = False,
                     session_id: str | None = None, processing: dict[str, bool] | None = None,
                     resumable: bool = False, client_key: ClientKey | None = None) -> RtcCall:
        """``origin``: where the call came from when a connector places it (a SIP gateway's caller);
        ``record``: the client asked for a recording from the start (its route checked that it may);
        ``session_id``: the id the call was announced under before it was answered (a webhook's);
        ``processing``: uplink processing asked for on top of the ingress's defaults (``audio_processing``);
        ``resumable``: its client is handed the token and speaks the resume protocol (a JSON offer);
        ``client_key``: the ek_ key the call was opened with, which opens its resources too.

        The call's secret: a token for a client's call (its answer hands it over), the resource URL
        for WHIP, none for a connector's leg (the server key opens those)."""
        quiet_connects_of_closed_peers(asyncio.get_running_loop())
        validate_offer(offer_sdp)
        async with self.registry.admission(options or SessionOptions()) as slot:
            call = await self._connect(slot, offer_sdp, options or SessionOptions(), whip, metrics, origin,
                                       session_id, processing)
            call.client_key = client_key
            if origin is None and not whip:
                call.token = new_session_token(self.registry.id_prefix)
                call.resumable = resumable
                if resumable:
                    self._resumable[digest(call.token)] = call.session.id
            self.registry.register(call, record=record)
        if self.registry.closing:  # shutdown began while this offer was being answered
            await self.registry.close(call.session.id, "server_shutdown")
            raise ServerFull(self.settings.session.retry_after_s)
        return call

    async def _connect(self, slot: EngineSlot, offer_sdp: str, options: SessionOptions, whip: bool, metrics: bool,
                       origin: dict[str, Any] | None, session_id: str | None = None,
                       processing: dict[str, bool] | None = None) -> RtcCall:
        track = self._new_track()
        ingress = "sip" if origin is not None else "whip" if whip else "webrtc"
        session = self.registry.new_session(slot, track, options, metrics, origin, session_id, ingress=ingress,
                                            processing=processing)
        call = RtcCall(session=session, pc=RTCPeerConnection(self.rtc_configuration()), track=track, codec="",
                       whip_resource=new_whip_resource(self.registry.id_prefix) if whip else None)
        await self._negotiate(call, offer_sdp)
        self._calls[session.id] = call
        if call.whip_resource is not None:
            self._whip_resources[call.whip_resource] = session.id
        return call

    def _new_track(self) -> PacedAudioTrack:
        caps = self.registry.engine.capabilities
        return PacedAudioTrack(in_rate=caps.output_rate, max_buffer_s=self.settings.session.playout_max_s,
                               live=caps.live_passthrough, frame_ms=self.settings.rtc.send_frame_ms,
                               live_lead_s=self.settings.rtc.passthrough_lead_ms / 1000,
                               encoder_hints=EncoderHints(opus_application=self.settings.rtc.opus_application),
                               steady=self.settings.rtc.passthrough_pacing == "steady")

    async def _negotiate(self, call: RtcCall, offer_sdp: str) -> None:
        """Answer ``offer_sdp`` on ``call.pc`` with ``call.track``; on failure the peer is abandoned."""
        pc, track = call.pc, call.track
        track.listener = call.session
        self._wire(call, pc)
        # The transceiver exists before the offer is applied so that our codec preferences shape the
        # negotiation (aiortc picks the common codecs while applying the remote description).
        transceiver = pc.addTransceiver(track, direction="sendrecv")
        transceiver.setCodecPreferences(self._codec_preferences())
        install_inline_encoding(transceiver.sender, track)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            self._guard_data_channel(call)
            quiet_sends_after_close(pc)
            install_consent_freshness(pc, self.settings.rtc.ice_consent_timeout_s,
                                      lambda: self._consent_expired(call, pc))
            for other in pc.getTransceivers():
                if other is not transceiver:
                    other.direction = "inactive"  # video or a second audio line: not received at all
            await pc.setLocalDescription(await pc.createAnswer())
        except OperationError:
            await self._abandon_attempt(call)
            offered = ", ".join(self.settings.rtc.codecs)
            raise SdpError(f"no common audio codec: this server accepts {offered}", unprocessable=True) from None
        except BaseException as exc:  # aiortc's parsers raise assorted errors on bad SDP
            await self._abandon_attempt(call)
            if not isinstance(exc, Exception):
                raise
            raise SdpError(f"cannot use SDP offer: {exc}") from None
        codec = negotiated_audio_codec(pc.localDescription.sdp)
        if codec is None or codec[0].lower() == TELEPHONE_EVENT.split("/")[1]:
            await self._abandon_attempt(call)
            offered = ", ".join(self.settings.rtc.codecs)
            raise SdpError(f"no common audio codec: this server accepts {offered}", unprocessable=True)
        call.codec = codec[0]
        track.use_codec(codec[0], codec[1])
        call.etag = f'"{ice_ufrag(pc.localDescription.sdp) or call.session.id}"'
        ptime = self.settings.rtc.receive_ptime_ms
        call.answer_sdp = with_ptime(pc.localDescription.sdp, ptime) if ptime else pc.localDescription.sdp
        call.negotiated_at = time.monotonic()
        self._watch_round_trip(call, transceiver.sender)

    # --- our own offer (a call the server places) ----------------------------------------------------

    async def prepare_offer(self, slot: EngineSlot, options: SessionOptions, origin: dict[str, Any],
                            token: str | None = None) -> RtcCall:
        """A call the server places: a session and a peer connection holding our offer (``token``:
        the secret its requester was given, which opens the call's resources).

        Nothing is registered yet: the far end may never answer. ``complete_offer`` registers the
        call once the answer comes; ``discard_offer`` lets it go otherwise.
        """
        quiet_connects_of_closed_peers(asyncio.get_running_loop())
        track = self._new_track()
        # A phone call like those the gateway answers: the phone legs' processing (audio_processing.sip).
        session = self.registry.new_session(slot, track, options, False, origin, ingress="sip")
        call = RtcCall(session=session, pc=RTCPeerConnection(self.rtc_configuration()), track=track, codec="",
                       token=token)
        track.listener = session
        self._wire(call, call.pc)
        transceiver = call.pc.addTransceiver(track, direction="sendrecv")
        transceiver.setCodecPreferences(self._codec_preferences())
        install_inline_encoding(transceiver.sender, track)
        try:
            await call.pc.setLocalDescription(await call.pc.createOffer())
        except BaseException:
            await abandon(call.pc, track)
            raise
        ptime = self.settings.rtc.receive_ptime_ms
        # What the far end is given (here an offer), with our a=ptime as in an answer.
        call.answer_sdp = with_ptime(call.pc.localDescription.sdp, ptime) if ptime else call.pc.localDescription.sdp
        self._watch_round_trip(call, transceiver.sender)
        return call

    async def complete_offer(self, call: RtcCall, answer_sdp: str) -> None:
        """Apply the far end's answer and register the call (its session starts here)."""
        pc = call.pc
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=answer_sdp, type="answer"))
        except Exception as exc:  # aiortc's parsers raise assorted errors on bad SDP
            raise SdpError(f"cannot use SDP answer: {exc}") from None
        quiet_sends_after_close(pc)
        install_consent_freshness(pc, self.settings.rtc.ice_consent_timeout_s,
                                  lambda: self._consent_expired(call, pc))
        codec = negotiated_audio_codec(answer_sdp)
        if codec is None or codec[0].lower() == TELEPHONE_EVENT.split("/")[1]:
            raise SdpError("the answer holds no audio codec we offered", unprocessable=True)
        call.codec = codec[0]
        call.track.use_codec(codec[0], codec[1])
        call.etag = f'"{ice_ufrag(pc.localDescription.sdp) or call.session.id}"'
        call.negotiated_at = time.monotonic()
        self._calls[call.session.id] = call
        self.registry.register(call)

    async def discard_offer(self, call: RtcCall) -> None:
        """An offer nobody answered: drop its peer connection (the caller closes the session)."""
        await self._abandon_attempt(call)

    @staticmethod
    def _watch_round_trip(call: RtcCall, sender: RTCRtpSender) -> None:
        """RTCP's round trip goes to the track's transit estimate (a recording keeps the caller's
        time by it) until the path is dropped with the call's other tasks."""
        call.tasks.append(asyncio.create_task(watch_round_trip(sender, call.track.transit),
                                              name=f"round-trip-{call.session.id}"))

    @staticmethod
    async def _abandon_attempt(call: RtcCall) -> None:
        """A negotiation that failed: the readers its tracks started end first (a track whose
        receiver never started never ends by itself), then the peer connection is dropped."""
        tasks, call.tasks = call.tasks, []
        await cancel_and_wait(tasks, TASK_END_S)
        await abandon(call.pc, call.track)

    # --- resuming ----------------------------------------------------------------------------------

    async def resume(self, session_id: str, session_token: str, offer_sdp: str, last_seq: int) -> RtcCall:
        """Re-attach session ``session_id`` to a new peer connection answering ``offer_sdp``.

        The old connection, if the server still thinks it alive, is dropped for good first. The
        session keeps its engine slot (the model's context), its epoch counter and its event
        sequence; the new channel first gets the events after ``last_seq`` from the journal.
        """
        validate_offer(offer_sdp)
        call = self._calls.get(session_id)
        if call is None or call.session.closed or self.registry.closing or not call.resumable:
            raise ResumeRefused(404, "session_not_found", f"no session {session_id!r} to resume")
        if not secret_matches(session_token, call.token):
            raise ResumeRefused(401, "unauthorized", "wrong session_token for this session")
        if call.resuming:
            raise ResumeRefused(409, "resume_in_progress", "this session is already being resumed")
        call.resuming = True
        try:
            await self.registry.lose_path(call, "replaced")
            if call.session.closed:
                raise ResumeRefused(404, "session_not_found", f"no session {session_id!r} to resume")
            call.pc, call.track = RTCPeerConnection(self.rtc_configuration()), self._new_track()
            call.has_audio, call.connected_at, call.transport_failure = False, None, None
            await self._negotiate(call, offer_sdp)  # on failure the session stays suspended
            call.track.attach_reference(self.registry.processing_of(call.session))  # it feeds the echo reference
            call.session.rebind_sink(call.track)
            call.resume_from = max(0, int(last_seq))
            call.suspended_at = None
            call.resumes += 1
            self.registry.metrics.sessions_resumed.inc()
            log.info("session %s resumed (from event %d)", session_id, call.resume_from)
            return call
        finally:
            call.resuming = False

    # --- the peer connection's events --------------------------------------------------------------

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
            spawn_kept(self.registry.close(session.id, "data_channel_overflow"), self._overflow_closes,
                       f"closing session {session.id} after a data channel overflow")

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
            if call.pc is not pc or session.closed:  # replaced, or ended while this path was negotiated:
                return  # no reader that nothing would ever cancel
            # aiortc queues received frames without bound until someone reads them, so every track
            # is consumed: the first audio track feeds the session, anything else is drained.
            if track.kind == "audio":
                install_dtmf_tap(pc, track, lambda digit: session.push_dtmf(digit, "rfc4733"))
            if track.kind == "audio" and not call.has_audio:
                call.has_audio = True
                inbound = InboundAudio(session, call.inbound)
                install_jitter_buffer(pc, track, self.settings.rtc, InlineDecoder(inbound))
                task = consume_audio(track, session, call.inbound, inbound)
            else:
                task = drain(track)
            call.tasks.append(asyncio.create_task(task, name=f"inbound-{session.id}-{track.kind}"))

        @pc.on("datachannel")
        def on_datachannel(channel) -> None:
            if call.pc is not pc:
                return
            factory = self.dialects.get(channel.label)
            if factory is None:
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
                call.path_lost_at = None  # a path again: a later loss starts a new resume window
            elif pc.connectionState == "closed":  # the peer closed DTLS: it hung up on purpose
                await self.registry.close(session.id, call.transport_failure or "connection_closed")
            elif pc.connectionState == "failed":  # the path broke: the client may come back
                await self.registry.lose_path(call, call.transport_failure or "connection_failed")
