"""The call registry: every call, whatever its transport, with one engine slot and one duplex session.

The registry owns admission (capacity), every call's lifetime (connect timeout, media timeout for
peers that vanish without closing, maximum duration) and clean-up, so a slot is always given back.
Every ingress (WebRTC offers, carrier WebSockets, the SIP gateway) admits and registers its calls
here, so capacity, metrics and ``/v1/sessions`` cover every call alike. A call whose transport can
be re-attached (``Call.resumable``) is held, not ended, for ``session.resume_window_s`` when its
media path breaks; the transport that re-attaches it lives with that transport (``rtc.negotiator``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from lychee_rtc.calls.call import Call, ServerFull
from lychee_rtc.calls.metrics import CallMetrics
from lychee_rtc.calls.recording import CallRecording
from lychee_rtc.config import AudioProcessing, Settings
from lychee_rtc.engine.base import CapacityError, SessionOptions
from lychee_rtc.engine.scheduler import Engine, EngineSlot
from lychee_rtc.media.audio_processing import SUPPORTED_RATES, AudioProcessingStage
from lychee_rtc.media.epoch_sink import EpochSink
from lychee_rtc.media.recording.store import RecordingStore
from lychee_rtc.session.processing import ProcessingUnavailable
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.session.sink import AudioSink

log = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.25
# A call forced closed at the end of the shutdown grace gets this long to close its transport.
FORCED_CLOSE_S = 1.0


class CallRegistry:
    def __init__(self, settings: Settings, engine: Engine, metrics: CallMetrics,
                 recordings: RecordingStore | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.recordings = recordings  # None: this server records no call
        self.calls: dict[str, Call] = {}
        self.recording_of: dict[str, CallRecording] = {}
        self._reserved = 0
        self.closing = False  # set at shutdown: no new sessions
        # Put in every session id; a cluster worker sets its worker id here so that an entry can
        # route a session's follow-up requests from the id alone.
        self.id_prefix = ""
        # Told of every call that leaves the registry, however it left (a transport forgets its own maps).
        self.on_removed: list[Callable[[Call], None]] = []
        self._warned_processing = False  # the optional processing library is missing: said once

    @property
    def capacity(self) -> int:
        return min(self.settings.session.max_sessions, self.engine.capabilities.max_sessions)

    @property
    def free(self) -> int:
        return self.capacity - len(self.calls) - self._reserved

    # --- admission ---------------------------------------------------------------------------------

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

    def new_session_id(self) -> str:
        return f"sess_{self.id_prefix}{secrets.token_hex(8)}"

    def new_session(self, slot: EngineSlot, sink: AudioSink, options: SessionOptions,
                    metrics: bool = False, origin: dict[str, Any] | None = None,
                    session_id: str | None = None, ingress: str = "webrtc",
                    processing: dict[str, bool] | None = None, stream_input: bool = False) -> DuplexSession:
        """``session_id``: one promised before the call existed (``new_session_id``), else a new one.
        ``ingress``: ``webrtc`` (a browser's offer), ``whip``, ``sip`` (the gateway), ``carrier`` or
        ``websocket`` (audio in events: ``stream_input``, its samples are its clock);
        it picks the uplink processing the session starts with (``audio_processing`` settings), and
        ``processing`` changes it (ProcessingUnavailable if it asks for a stage that cannot run)."""
        caps = self.engine.capabilities
        stage = self._processing(ingress, processing or {})
        if stage is not None and isinstance(sink, EpochSink):
            sink.attach_reference(stage)  # the transport tells it what the caller's loudspeaker played
        return DuplexSession(session_id or self.new_session_id(), self.settings.session, slot, sink,
                             engine_name=caps.name, observer=self.metrics, options=options, metrics_enabled=metrics,
                             origin=origin, processing=stage, stream_input=stream_input)

    @staticmethod
    def processing_of(session: DuplexSession) -> AudioProcessingStage | None:
        """The stage ``new_session`` gave the session, for a new transport to feed."""
        stage = session.processing
        return stage if isinstance(stage, AudioProcessingStage) else None

    def _processing(self, ingress: str, changes: dict[str, bool]) -> AudioProcessingStage | None:
        rate = self.engine.capabilities.input_rate
        if rate not in SUPPORTED_RATES:
            if any(changes.values()):
                raise ProcessingUnavailable(f"the engine's input rate {rate} Hz has no audio processing")
            return None
        wanted = AudioProcessing(**{**self.settings.audio_processing.for_ingress(ingress).model_dump(), **changes})
        try:
            return AudioProcessingStage(rate, wanted)
        except ProcessingUnavailable as exc:
            if any(changes.values()):
                raise  # asked for by this call, not only by the profile's default
            if not self._warned_processing:
                self._warned_processing = True
                log.warning("%s calls start without echo cancellation and noise suppression: %s", ingress, exc)
            stage = AudioProcessingStage(rate, AudioProcessing())
            stage.unavailable = str(exc)
            return stage

    def register(self, call: Call, record: bool = False) -> None:
        """Count the call, start its session and its watchdog; closing the session tears it down.

        ``record``: the client asked for a recording from the start (the route checked that it may)."""
        session = call.session
        self.calls[session.id] = call
        self.metrics.sessions_total.inc()
        self.metrics.active_sessions.set(len(self.calls))
        session.on_close = lambda reason: self._teardown(call, reason)
        if self.recordings is not None:
            # A WHIP client holds no session token: its resource id is its secret, and opens its recording.
            secret = getattr(call, "whip_resource", None) or call.token
            recording = CallRecording(self.recordings, self.settings.recording, session, secret,
                                      call.snapshot().get("transport", "unknown"))
            session.recording = self.recording_of[session.id] = recording
            if self.settings.recording.enabled or record:
                recording.start()  # before the session starts: its first event is in the sidecar
        session.start()
        call.watchdog = asyncio.create_task(self._watchdog(call), name=f"watchdog-{session.id}")

    # --- lifetime ----------------------------------------------------------------------------------

    async def _watchdog(self, call: Call) -> None:
        s = self.settings.session
        session = call.session
        try:
            while not session.closed:
                await asyncio.sleep(WATCHDOG_PERIOD_S)
                now = time.monotonic()
                self._fold_counters(call)
                self.metrics.playout_depth.observe(session.sink.depth_ms / 1000.0)
                if now - session.created_at > s.max_duration_s:
                    await self.close(session.id, "max_duration")
                elif call.suspended_at is not None:
                    if now - call.suspended_at > s.resume_window_s and not call.resuming:
                        await self.close(session.id, call.suspend_reason or "connection_lost")
                elif call.connected_at is None:
                    if now - call.connect_started_at() > s.connect_timeout_s:
                        await self.lose_path(call, "connect_timeout")
                elif session.on_hold:  # a held caller's phone may send nothing at all
                    continue
                elif now - max(session.last_audio_at or 0.0, call.connected_at) > s.media_timeout_s:
                    await self.lose_path(call, "media_timeout")
        except asyncio.CancelledError:
            pass

    async def lose_path(self, call: Call, reason: str) -> None:
        """The media path is gone: hold the session for ``session.resume_window_s``, or close it."""
        session = call.session
        if not call.resumable:
            await self.close(session.id, reason)
            return
        if session.closed or call.suspended_at is not None:
            return
        if self.settings.session.resume_window_s <= 0 or self.closing or call.token is None:
            await self.close(session.id, reason)
            return
        call.suspended_at, call.suspend_reason = time.monotonic(), reason
        log.info("session %s: media path lost (%s); it may resume within %.0f s", session.id, reason,
                 self.settings.session.resume_window_s)
        session.suspend(reason)
        await call.drop_path()

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

    # --- the end -----------------------------------------------------------------------------------

    async def close(self, session_id: str, reason: str) -> bool:
        call = self.calls.get(session_id)
        if call is None:
            return False
        await call.session.close(reason)  # calls _teardown through session.on_close
        return True

    def _remove(self, call: Call, reason: str) -> bool:
        """Take the call out of the registry and count it; False when it was already gone."""
        if self.calls.pop(call.session.id, None) is None:
            return False
        for forget in self.on_removed:
            forget(call)
        recording = self.recording_of.pop(call.session.id, None)
        if recording is not None:
            recording.close(reason)
        self.metrics.sessions_closed.labels(reason).inc()
        return True

    async def _teardown(self, call: Call, reason: str) -> None:
        if not self._remove(call, reason):
            return
        log.info("session %s closed: %s", call.session.id, reason)
        self._fold_counters(call)
        self.metrics.active_sessions.set(len(self.calls))
        current = asyncio.current_task()
        for task in [*call.tasks, call.watchdog]:
            if task is not None and task is not current:
                task.cancel()
        await call.close_transport()
        for callback in call.on_closed:
            try:
                result = callback(reason)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # one listener's failure must not keep the others from hearing
                log.exception("session %s: close listener failed", call.session.id)

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
        self._remove(call, reason)
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
