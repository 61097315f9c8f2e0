"""The duplex session: epochs, response ids, turn state, engine events and the typed controls.

Transport-agnostic: the transport feeds decoded 16 kHz audio in (``push_audio`` / ``push_gap``,
and keypad digits with ``push_dtmf``), plays what the session writes into its ``AudioSink`` and
reports playout marks back. Clients reach the session through a dialect (``session/native.py``,
the OpenAI one in the server), which turns their messages into the typed controls below and writes
the session's ``events`` (``session/event_stream.py``) in its own vocabulary. Everything here runs
on one event loop, which is what makes the interrupt sequence (docs/architecture.md, "Epochs")
atomic. Three parts live in modules of their own: what the session says about itself
(``info.py``), its option changes (``options.py``) and the engine's events (``engine_events.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import numpy as np

from lychee_rtc.config import SessionSettings
from lychee_rtc.engine.base import DTMF_DIGITS, Control, ControlKind, SessionOptions, WindowTiming
from lychee_rtc.engine.scheduler import EngineSlot
from lychee_rtc.session.clock import StreamClock, Window, WindowClock
from lychee_rtc.session.engine_events import EngineEvents
from lychee_rtc.session.event_stream import EventChannel, EventStream
from lychee_rtc.session.info import SessionInfo
from lychee_rtc.session.message_rate import MessageRate
from lychee_rtc.session.observer import SessionCounters, SessionObserver
from lychee_rtc.session.options import InstructionsEffect, OptionChanges
from lychee_rtc.session.processing import UplinkProcessing
from lychee_rtc.session.protocol import MAX_MESSAGE_BYTES, ProtocolError, error_body
from lychee_rtc.session.recording import RecordingControl
from lychee_rtc.session.responses import Responses
from lychee_rtc.session.sink import AudioSink
from lychee_rtc.session.window_input import WindowInput

log = logging.getLogger(__name__)

__all__ = ["DuplexSession", "InstructionsEffect"]


class DuplexSession(SessionInfo, OptionChanges, EngineEvents):
    def __init__(
        self,
        session_id: str,
        settings: SessionSettings,
        slot: EngineSlot,
        sink: AudioSink,
        *,
        engine_name: str,
        clock: Callable[[], float] = time.monotonic,
        observer: SessionObserver | None = None,
        options: SessionOptions | None = None,
        metrics_enabled: bool = False,
        origin: dict[str, Any] | None = None,
        processing: UplinkProcessing | None = None,
        stream_input: bool = False,
    ) -> None:
        """``stream_input``: the uplink has no timestamps (a WebSocket's appended audio); its own
        samples drive the window clock (``StreamClock``) instead of wall-clock deadlines."""
        caps = slot.capabilities
        self.id = session_id
        self.settings = settings
        self.slot = slot
        self.sink = sink
        self.engine_name = engine_name
        self.capabilities = caps
        self.clock = clock
        self.observer = observer or SessionObserver()
        self.epoch = 0
        self.state = "listening"
        self.held = False
        self.options = options or SessionOptions()
        self.metrics_enabled = metrics_enabled
        # Where the call came from when a connector placed it (a phone call through the SIP
        # gateway: caller, SIP Call-ID); shown in the session's info and its session.created event.
        self.origin = dict(origin) if origin else None
        # The uplink's cleaning stage (echo cancellation, noise suppression), fed by the transport
        # with what it played; None where the engine's rate has no such stage.
        self.processing = processing
        self.created_at = clock()
        self.counters = SessionCounters()
        grace = settings.window_grace_ms / 1000.0
        # Input a transport holds back until the engine has room for it (see ``wait_input_room``).
        self.input_waiting: Callable[[], bool] = lambda: False
        self.window_clock: WindowClock = (
            StreamClock(caps.window_samples, caps.input_rate, grace,
                        busy=lambda: self.slot.pending > 0 or self.input_waiting())
            if stream_input else WindowClock(caps.window_samples, caps.input_rate, grace))
        self.uplink = WindowInput(self.window_clock, self._push_window, clock)
        self.closed = False
        self.close_reason: str | None = None
        self.on_close: Callable[[str], Any] | None = None
        self._close_task: asyncio.Task | None = None
        # Every event, once: the native channel writes it as it is, translators listen to it.
        self.events = EventStream(session_id, settings.event_buffer, settings.resume_journal_events)
        self.responses = Responses(self.emit, clock, self.observer)
        self.suspended = False  # the media path is gone; the session waits for a resume
        self._tasks: list[asyncio.Task] = []
        self._deferred_listen: tuple[str, dict[str, float] | None] | None = None
        self._message_rate = MessageRate(clock())
        # Set by a phone-call transport that can hand the caller over (the SIP gateway): called
        # with the target URI; None for calls that cannot be transferred.
        self.transfer_handler: Callable[[str], None] | None = None
        self.on_hold = False  # a phone call put on hold: the engine hears nothing and says nothing
        # The call's recording, when the server records (calls.recording); None: it never can.
        self.recording: RecordingControl | None = None
        # Told of every window the engine stepped (a dialect reporting the model's decisions by them).
        self.window_listeners: list[Callable[[WindowTiming], None]] = []

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._engine_events(), name=f"session-{self.id}-events"),
            asyncio.create_task(self.uplink.run(), name=f"session-{self.id}-clock"),
        ]
        self.emit("session.created", session=self.describe())

    async def close(self, reason: str) -> None:
        """End the session; every caller waits for the same teardown, however many there are.

        The teardown runs as a task of its own, so a caller that is cancelled (an HTTP request
        whose client went away, a watchdog being stopped) cannot leave it half done.
        """
        if self._close_task is None:
            self._begin_close(reason)
        assert self._close_task is not None
        await asyncio.shield(self._close_task)

    def _begin_close(self, reason: str) -> None:
        self.closed = True
        self.close_reason = reason
        self.state = "closed"
        if self.responses.active is not None:
            self.responses.finish(self.responses.active, "cancelled", reason)
        self.emit("session.closed", reason=reason)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._close_task = asyncio.get_running_loop().create_task(self._finish_close(reason),
                                                                  name=f"session-{self.id}-close")

    async def _finish_close(self, reason: str) -> None:
        if self.processing is not None:
            self.processing.close()
        try:
            await self.slot.close()
        except Exception:  # the transport must still be torn down, or the call would linger
            log.exception("session %s: engine slot failed to close", self.id)
        finally:
            if self.on_close is not None:
                result = self.on_close(reason)
                if asyncio.iscoroutine(result):
                    await result

    # --- losing and resuming the transport ----------------------------------------------------------

    def suspend(self, reason: str) -> None:
        """The media path is gone (the session, its engine slot and context stay): stop sending, and
        cancel what was being said, since nobody heard it."""
        if self.closed or self.suspended:
            return
        self.suspended = True
        self.events.detach()
        if self.responses.active is not None:
            self.interrupt("connection_lost")

    def rebind_sink(self, sink: AudioSink) -> None:
        """A new transport plays the audio from now on, starting at the current epoch."""
        sink.cut(self.epoch)
        self.sink = sink
        if self.recording is not None:
            self.recording.rebind(sink)
        self.uplink.resync()

    def resume_channel(self, channel: EventChannel, last_seq: int) -> None:
        """Attach a resumed client's channel: replay what it missed from the journal, then say so."""
        self.suspended = False
        replayed, lost = self.events.resume(channel, last_seq)
        self.emit("session.resumed", session=self.describe(), replayed=replayed, lost=lost)

    # --- the uplink (audio in) ------------------------------------------------------------------------

    @property
    def last_audio_at(self) -> float | None:
        return self.uplink.last_audio_at

    def has_input_room(self) -> bool:
        """Whether the engine takes another window of this session's input now, without dropping one."""
        return self.slot.has_room()

    async def wait_input_room(self) -> None:
        """Until ``has_input_room``: a transport with input to spare (audio sent faster than real
        time) feeds it at the engine's pace instead of letting the slot drop windows."""
        await self.slot.wait_room()

    def push_audio(self, samples: np.ndarray, now: float | None = None) -> None:
        if self.closed:
            return
        self.counters.input_samples += len(samples)
        self._record_caller(samples)  # what the caller sent, before the uplink's processing
        if self.processing is not None:
            samples = self.processing.process(samples)
        self.uplink.audio(samples, now)

    def push_gap(self, n: int, now: float | None = None, fill: np.ndarray | None = None) -> None:
        if self.closed:
            return
        recorded = self.recording is not None and self.recording.tap is not None
        processed = self.processing is not None and n > 0
        if recorded or processed:
            concealed = np.zeros(n, np.float32)  # the lost time keeps its place: concealment, then silence
            if fill is not None:
                concealed[:min(n, len(fill))] = fill[:n]
        if recorded:
            self._record_caller(concealed)
        if processed:
            held, fill = self.processing.process_gap(concealed)
            if len(held):
                self.uplink.audio(held, now)
        self.uplink.gap(n, now, fill)

    def _record_caller(self, samples: np.ndarray) -> None:
        """The recording's caller tap: concealed audio as it enters, before anything processes it."""
        tap = self.recording.tap if self.recording is not None else None
        if tap is not None:
            tap.caller_audio(samples, self.capabilities.input_rate)

    def _push_window(self, window: Window) -> None:
        self.slot.push(window.samples, window.seq, self.epoch)

    def push_dtmf(self, digit: str, source: str | None = None) -> None:
        """A keypad digit from the caller: reported, it interrupts the agent like a barge-in, and the
        engine hears it too (the echo engine ends the caller's turn on ``#``).

        ``source``: how it arrived (``rfc4733`` telephone-event, ``sip_info``, a carrier's frame).
        """
        if len(digit) != 1 or digit.upper() not in DTMF_DIGITS:
            raise ValueError(f"not a DTMF key: {digit!r}")
        if self.closed:
            return
        self.counters.dtmf_digits += 1
        fields: dict[str, Any] = {"epoch": self.epoch, "event": digit, "received_at": time.time()}
        if source is not None:
            fields["source"] = source
        self.emit("input_audio_buffer.dtmf_event_received", **fields)
        if self.responses.active is not None:
            self.interrupt("dtmf")
        self.slot.control(Control(ControlKind.DTMF, self.epoch, digit=digit.upper()))

    # --- events out ----------------------------------------------------------------------------------

    def emit(self, event_type: str, **fields: Any) -> dict[str, Any]:
        """Every event of the session, once: stamped, journaled and handed to every dialect."""
        return self.events.emit(event_type, **fields)

    def report_error(self, err: ProtocolError) -> None:
        """Tell the clients of an error (a refused message, the engine's): counted as ``bad_messages``."""
        self.counters.bad_messages += 1
        self.emit("error", error=error_body(err))

    # --- client messages, of any dialect -----------------------------------------------------------

    def admit_message(self) -> bool:
        """Count a client message, of any dialect, against the session's token bucket, so a
        flooding client cannot monopolise the loop; False: drop it."""
        self.counters.messages_in += 1
        now = self.clock()
        if self._message_rate.admit(now):
            return True
        self.counters.rate_limited_messages += 1
        if self._message_rate.should_report(now):
            self.report_error(ProtocolError("rate_limited", MessageRate.describe()))
        return False

    def reject_oversize(self, size: int) -> None:
        """The transport dropped a message while it arrived, at ``size`` bytes, for being too large."""
        if self.closed:
            return
        self.counters.messages_in += 1
        self.report_error(ProtocolError(
            "message_too_large", f"message of more than {size} bytes exceeds {MAX_MESSAGE_BYTES}; it was dropped"))

    # --- typed controls (every dialect ends here) ----------------------------------------------------

    def cancel_response(self, response_id: str | None = None, event_id: str | None = None) -> None:
        if self.responses.active is None:
            raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel", event_id)
        if response_id is not None and response_id != self.responses.active:
            raise ProtocolError("response_not_found",
                                f"response {response_id!r} is not the response in progress", event_id)
        self.interrupt("client_cancel")

    def clear_output_audio(self) -> bool:
        """Cut what the client is hearing (the response in progress, if any); True if one was cut."""
        if self.responses.active is None:
            return False
        return self.interrupt("client_cancel")

    def hold_listening(self) -> None:
        """Keep the model listening until ``release_listening``; cuts what it is saying."""
        # Always a fence, even with no response yet: a step already running may be about to
        # start one, and it must not be heard while the session is held.
        self.held = True
        self.interrupt("turn.listen")
        self.slot.control(Control(ControlKind.FORCE_LISTEN, self.epoch))

    def release_listening(self) -> None:
        self.held = False
        self.slot.control(Control(ControlKind.RELEASE_LISTEN, self.epoch))
        self._set_state("listening", "turn.release")

    def ack_playback(self, response_id: str, played_ms: float, event_id: str | None = None) -> None:
        """The client says how much of a response it played (kept in the response ledger)."""
        record = self.responses.ledger.get(response_id)
        if record is None:
            raise ProtocolError("response_not_found", f"unknown response {response_id!r}", event_id)
        record.client_played_ms = float(played_ms)

    def commit_input(self) -> None:
        self.slot.control(Control(ControlKind.COMMIT, self.epoch))
        self.emit("input_audio_buffer.committed", epoch=self.epoch)

    def request_transfer(self, target_uri: str, event_id: str | None = None) -> None:
        if self.transfer_handler is None:
            raise ProtocolError("not_a_phone_call", "only a phone call through the SIP gateway can be transferred",
                                event_id)
        self.transfer_handler(target_uri)

    def hold(self) -> bool:
        """Put the call on hold: cut what is being said, stop the uplink clock (no windows, so no
        underruns and nothing for the engine to answer). False if it already was."""
        if self.closed or self.on_hold:
            return False
        self.on_hold = True
        self.interrupt("on_hold")
        self.uplink.hold()
        self.emit("call.hold", held=True)
        return True

    def unhold(self) -> bool:
        if self.closed or not self.on_hold:
            return False
        self.on_hold = False
        self.interrupt("off_hold")  # what played on hold (music) stops here
        self.uplink.release()
        self.emit("call.hold", held=False)
        return True

    def request_close(self, reason: str) -> None:
        if self._close_task is None:  # one teardown, however many times the client asks
            self._begin_close(reason)

    # --- interruption ------------------------------------------------------------------------------

    def interrupt(self, reason: str, speech_sample: int | None = None) -> bool:
        """The epoch contract: bump, cut playout, cancel the engine, then tell the client.
        True if a response in progress was cut.

        ``speech_sample``: for a barge-in, the uplink sample where the user's speech began, so the
        time from speech onset to the cut can be measured.
        """
        started = time.perf_counter()
        old_epoch = self.epoch
        self.epoch += 1
        report = self.sink.cut(self.epoch)
        self.slot.control(Control(ControlKind.CANCEL, self.epoch))
        self.counters.interruptions += 1
        cut = self.responses.cut(report, old_epoch, self.epoch, reason)
        onset = self.window_clock.time_of(speech_sample) if speech_sample is not None else None
        self.observer.interruption(time.perf_counter() - started,
                                   None if onset is None else max(0.0, self.clock() - onset))
        self._deferred_listen = None
        self._set_state("held" if self.held else "listening", reason)
        return cut

    def _set_state(self, state: str, reason: str, probabilities: dict[str, float] | None = None) -> None:
        self.state = state
        fields: dict[str, Any] = {"epoch": self.epoch, "state": state, "reason": reason}
        if probabilities:
            fields["probabilities"] = probabilities
        self.emit("turn.state", **fields)

    # --- playout marks (from the sink) -------------------------------------------------------------

    def on_playout_started(self, epoch: int, response_id: str, sample_offset: int, rate: int) -> None:
        if epoch == self.epoch:
            self.responses.playout_started(epoch, response_id, sample_offset, rate)

    def on_playout_finished(self, epoch: int, response_id: str, played_samples: int, sample_offset: int,
                            rate: int) -> None:
        if epoch != self.epoch or not self.responses.playout_finished(epoch, response_id, played_samples,
                                                                      sample_offset, rate):
            return
        if self._deferred_listen is not None and self.responses.active is None:
            reason, probabilities = self._deferred_listen
            self._deferred_listen = None
            self._set_state("held" if self.held else "listening", reason, probabilities)

