"""Calls: one transport, one engine slot and one duplex session each.

The manager owns admission (capacity), the offer/answer exchange for WebRTC, every call's lifetime
(connect timeout, media timeout for peers that vanish without closing, maximum duration) and
clean-up, so a slot is always given back. Other ingresses (carrier WebSockets) admit and register
their calls here too, so capacity, metrics and ``/v1/sessions`` cover every call alike.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.exceptions import OperationError
from aiortc.sdp import candidate_from_sdp

from lychee_rtc.config import Settings
from lychee_rtc.engine.base import CapacityError, SessionOptions
from lychee_rtc.engine.scheduler import Engine, EngineSlot
from lychee_rtc.media.inbound import InboundCounters, consume_audio, drain
from lychee_rtc.media.jitter import install_jitter_buffer
from lychee_rtc.media.outbound import PacedAudioTrack
from lychee_rtc.media.playout import PlayoutCounters
from lychee_rtc.media.sdp import SdpError, ice_ufrag, negotiated_audio_codec, validate_offer
from lychee_rtc.server.metrics import ServerMetrics
from lychee_rtc.server.openai.dialect import OAI_EVENTS_LABEL, RealtimeTranslator
from lychee_rtc.server.openai.session_config import RealtimeProfile
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.session.sink import AudioSink

log = logging.getLogger(__name__)

EVENT_CHANNEL_LABEL = "events"  # this server's own events; "oai-events" speaks OpenAI's GA dialect
CODEC_MIME = {"opus": "audio/opus", "PCMU": "audio/PCMU", "PCMA": "audio/PCMA"}
WATCHDOG_PERIOD_S = 0.25


class ServerFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("the server is at capacity")
        self.retry_after_s = retry_after_s


class Call(Protocol):
    """What the manager needs of a call, whatever its transport."""

    session: DuplexSession
    tasks: list[asyncio.Task]
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

    def playout_counters(self) -> PlayoutCounters:
        return self.track.playout_counters()

    async def close_transport(self) -> None:
        self.track.stop()
        await self.pc.close()

    def snapshot(self) -> dict:
        snap = self.session.snapshot()
        snap["transport"] = "webrtc"
        snap["connection_state"] = self.pc.connectionState
        snap["codec"] = self.codec
        snap["counters"].update({
            "inbound_frames": self.inbound.frames,
            "inbound_gaps": self.inbound.gaps,
            "inbound_reordered_frames": self.inbound.reordered_frames,
            "outbound_frames": self.track.counters.frames,
            "outbound_stale_chunks": self.track.counters.stale_chunks,
            "playout_underrun_samples": self.track.playout_counters().underrun_samples,
            "playout_overflow_samples": self.track.playout_counters().overflow_samples,
        })
        return snap


class SessionManager:
    def __init__(self, settings: Settings, engine: Engine, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.calls: dict[str, Call] = {}
        self._reserved = 0
        self.closing = False  # set at shutdown: no new sessions
        self.realtime_profile = RealtimeProfile.build(settings, engine.capabilities)
        # Put in every session id; a cluster worker sets its worker id here so that an entry can
        # route a session's follow-up requests from the id alone.
        self.id_prefix = ""

    @property
    def capacity(self) -> int:
        return min(self.settings.session.max_sessions, self.engine.capabilities.max_sessions)

    @property
    def free(self) -> int:
        return self.capacity - len(self.calls) - self._reserved

    def rtc_configuration(self) -> RTCConfiguration:
        # Always explicit: aiortc falls back to a public STUN server when given None.
        servers = [RTCIceServer(urls=s.urls, username=s.username, credential=s.credential)
                   for s in self.settings.rtc.ice_servers]
        return RTCConfiguration(iceServers=servers)

    # --- offer / answer ----------------------------------------------------------------------------

    async def create(self, offer_sdp: str, options: SessionOptions | None = None, whip: bool = False,
                     metrics: bool = False) -> RtcCall:
        validate_offer(offer_sdp)
        async with self.admission(options or SessionOptions()) as slot:
            return await self._connect(slot, offer_sdp, options or SessionOptions(), whip, metrics)

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
                    metrics: bool = False) -> DuplexSession:
        caps = self.engine.capabilities
        return DuplexSession(f"sess_{self.id_prefix}{secrets.token_hex(8)}", self.settings.session, slot, sink,
                             engine_name=caps.name, observer=self.metrics, options=options, metrics_enabled=metrics)

    def register(self, call: Call) -> None:
        """Count the call, start its session and its watchdog; closing the session tears it down."""
        session = call.session
        self.calls[session.id] = call
        self.metrics.sessions_total.inc()
        self.metrics.active_sessions.set(len(self.calls))
        session.on_close = lambda reason: self._teardown(call, reason)
        session.start()
        call.tasks.append(asyncio.create_task(self._watchdog(call), name=f"watchdog-{session.id}"))

    async def _connect(self, slot, offer_sdp: str, options: SessionOptions, whip: bool, metrics: bool) -> RtcCall:
        caps = self.engine.capabilities
        pc = RTCPeerConnection(self.rtc_configuration())
        track = PacedAudioTrack(in_rate=caps.output_rate, max_buffer_s=self.settings.session.playout_max_s,
                                live=caps.live_passthrough)
        session = self.new_session(slot, track, options, metrics)
        session_id = session.id
        track.listener = session
        call = RtcCall(session=session, pc=pc, track=track, codec="", whip=whip)
        self._wire(call)
        # The transceiver exists before the offer is applied so that our codec preferences shape the
        # negotiation (aiortc picks the common codecs while applying the remote description).
        transceiver = pc.addTransceiver(track, direction="sendrecv")
        transceiver.setCodecPreferences(self._codec_preferences())
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            for other in pc.getTransceivers():
                if other is not transceiver:
                    other.direction = "inactive"  # video or a second audio line: not received at all
            await pc.setLocalDescription(await pc.createAnswer())
        except OperationError:
            await call.close_transport()
            offered = ", ".join(self.settings.rtc.codecs)
            raise SdpError(f"no common audio codec: this server accepts {offered}", unprocessable=True) from None
        except BaseException as exc:  # aiortc's parsers raise assorted errors on bad SDP
            await call.close_transport()
            if not isinstance(exc, Exception):
                raise
            raise SdpError(f"cannot use SDP offer: {exc}") from None
        codec = negotiated_audio_codec(pc.localDescription.sdp)
        if codec is None:
            await call.close_transport()
            offered = ", ".join(self.settings.rtc.codecs)
            raise SdpError(f"no common audio codec: this server accepts {offered}", unprocessable=True)
        call.codec = codec[0]
        track.set_output_rate(48000 if codec[0].lower() == "opus" else codec[1])
        call.etag = f'"{ice_ufrag(pc.localDescription.sdp) or session_id}"'
        self.register(call)
        return call

    def _codec_preferences(self) -> list:
        available = {c.mimeType.lower(): c for c in RTCRtpSender.getCapabilities("audio").codecs}
        return [available[CODEC_MIME[name].lower()] for name in self.settings.rtc.codecs
                if CODEC_MIME[name].lower() in available]

    def _wire(self, call: RtcCall) -> None:
        pc, session = call.pc, call.session

        @pc.on("track")
        def on_track(track) -> None:
            # aiortc queues received frames without bound until someone reads them, so every track
            # is consumed: the first audio track feeds the session, anything else is drained.
            if track.kind == "audio" and not call.has_audio:
                call.has_audio = True
                install_jitter_buffer(pc, track, self.settings.rtc)
                task = consume_audio(track, session, call.inbound)
            else:
                task = drain(track)
            call.tasks.append(asyncio.create_task(task, name=f"inbound-{session.id}-{track.kind}"))

        @pc.on("datachannel")
        def on_datachannel(channel) -> None:
            if channel.label == OAI_EVENTS_LABEL:
                translator = RealtimeTranslator(session, self.realtime_profile, channel.send,
                                                lambda: channel.bufferedAmount)
                channel.on("message", translator.handle_message)
                channel.on("close", translator.detach)
                translator.attach()
                return
            if channel.label != EVENT_CHANNEL_LABEL:
                return
            channel.on("message", session.handle_message)
            channel.on("close", lambda: session.detach_channel(channel.send))
            session.attach_channel(channel.send, lambda: channel.bufferedAmount)

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState == "connected" and call.connected_at is None:
                call.connected_at = time.monotonic()
            elif pc.connectionState in ("failed", "closed"):
                await self.close(session.id, f"connection_{pc.connectionState}")

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
        try:
            while not session.closed:
                await asyncio.sleep(WATCHDOG_PERIOD_S)
                now = time.monotonic()
                self._fold_counters(call)
                if call.connected_at is None:
                    if now - session.created_at > s.connect_timeout_s:
                        await self.close(session.id, "connect_timeout")
                    continue
                last = session.last_audio_at or call.connected_at
                if now - last > s.media_timeout_s:
                    await self.close(session.id, "media_timeout")
                elif now - session.created_at > s.max_duration_s:
                    await self.close(session.id, "max_duration")
        except asyncio.CancelledError:
            pass

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
        self.metrics.playout_depth.labels(call.session.id).set(call.session.sink.depth_ms / 1000.0)

    async def close(self, session_id: str, reason: str) -> bool:
        call = self.calls.get(session_id)
        if call is None:
            return False
        await call.session.close(reason)  # calls _teardown through session.on_close
        return True

    async def _teardown(self, call: Call, reason: str) -> None:
        if self.calls.pop(call.session.id, None) is None:
            return
        log.info("session %s closed: %s", call.session.id, reason)
        self._fold_counters(call)
        self.metrics.playout_depth.remove(call.session.id)
        self.metrics.active_sessions.set(len(self.calls))
        current = asyncio.current_task()
        for task in call.tasks:
            if task is not current:
                task.cancel()
        await call.close_transport()

    async def close_all(self, reason: str) -> None:
        self.closing = True
        while self.calls or self._reserved:
            for session_id in list(self.calls):
                await self.close(session_id, reason)
            if self._reserved or self.calls:
                # Offers still being answered, or calls already closing on their own (a carrier
                # socket draining): let them finish, then close what is left.
                await asyncio.sleep(0.05)
