"""The duplex session: epochs, response ids, turn state, the event protocol and the window clock.

Transport-agnostic: the transport feeds decoded 16 kHz audio in (``push_audio`` / ``push_gap``,
and keypad digits with ``push_dtmf``),
hands client messages to ``handle_message``, plays what the session writes into its ``AudioSink``
and reports playout marks back. Everything here runs on one event loop, which is what makes the
interrupt sequence of ARCHITECTURE section 4 atomic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Literal

import numpy as np

from lychee_rtc.aio import wait_event
from lychee_rtc.config import SessionSettings
from lychee_rtc.engine.base import (
    AudioChunk,
    BargeIn,
    CodecTokens,
    DTMF_DIGITS,
    Control,
    ControlKind,
    EngineError,
    EngineEvent,
    ResponseDone,
    ResponseStarted,
    SessionOptions,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    TurnState,
    WindowTiming,
)
from lychee_rtc.engine.scheduler import EngineSlot
from lychee_rtc.jsonio import strict_json_dumps
from lychee_rtc.session.clock import WindowClock
from lychee_rtc.session.ledger import ResponseLedger, ResponseRecord
from lychee_rtc.session.protocol import (
    MAX_MESSAGE_BYTES,
    ClientEvent,
    EventStamper,
    ProtocolError,
    error_body,
    parse_client_event,
)
from lychee_rtc.session.sink import AudioSink

log = logging.getLogger(__name__)

# Above this much unsent data on the channel, optional events (metrics) are dropped.
CHANNEL_HIGH_WATER = 1 << 20
# Above this, the peer is not reading the channel at all: every event is dropped (and counted).
CHANNEL_HARD_LIMIT = 8 << 20
# Client messages: a burst of this many, refilled at this rate; beyond it messages are dropped.
MESSAGE_BURST = 200
MESSAGES_PER_SECOND = 100.0
RESPONSE_SCOPED = (ResponseStarted, TextDelta, CodecTokens, AudioChunk, ResponseDone, BargeIn, TurnState)


# What a change of instructions did: nothing new; prefilled as the system prompt before the model
# first spoke; kept for the model's next context reset (mid-conversation); or not used by this engine.
InstructionsEffect = Literal["unchanged", "applied", "next_context_reset", "unused"]
EventListener = Callable[[dict[str, Any]], None]


@dataclass
class SessionCounters:
    messages_in: int = 0
    bad_messages: int = 0
    rate_limited_messages: int = 0
    events_out: int = 0
    events_dropped: int = 0
    stale_engine_events: int = 0
    stale_audio_chunks: int = 0
    interruptions: int = 0
    input_samples: int = 0
    dtmf_digits: int = 0


class SessionObserver:
    """Hooks for metrics; the server installs one, tests may ignore it."""

    def window_timing(self, timing: WindowTiming) -> None: ...
    def interruption(self, handling_s: float, since_speech_s: float | None) -> None: ...
    def stale_chunk(self) -> None: ...
    def first_audio(self, seconds: float) -> None: ...


class DuplexSession:
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
    ) -> None:
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
        self.created_at = clock()
        self.last_audio_at: float | None = None
        self.counters = SessionCounters()
        self.ledger = ResponseLedger()
        self.active_response: str | None = None
        self.window_clock = WindowClock(caps.window_samples, caps.input_rate, settings.window_grace_ms / 1000.0)
        self.closed = False
        self.close_reason: str | None = None
        self.on_close: Callable[[str], Any] | None = None
        self._close_task: asyncio.Task | None = None
        self._stamper = EventStamper()
        self._outbox: deque[str] = deque()
        # The latest events, as sent, for a client that resumes after losing its connection.
        self._journal: deque[tuple[int, str]] = deque(maxlen=settings.resume_journal_events)
        self.suspended = False  # the media path is gone; the session waits for a resume
        self._resync_uplink = False
        self._send: Callable[[str], None] | None = None
        self._listeners: list[EventListener] = []  # translators of other dialects (oai-events, sideband)
        self._buffered: Callable[[], int] = lambda: 0
        self._tasks: list[asyncio.Task] = []
        self._clock_wake = asyncio.Event()
        self._first_audio_ms: float | None = None  # reported with the next metrics event
        self._deferred_listen: tuple[str, dict[str, float] | None] | None = None
        self._message_tokens = float(MESSAGE_BURST)
        self._message_refill_at = clock()
        self._rate_error_at = -1.0

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._engine_events(), name=f"session-{self.id}-events"),
            asyncio.create_task(self._clock_loop(), name=f"session-{self.id}-clock"),
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
        if self.active_response is not None:
            self._finish_response(self.active_response, "cancelled", reason)
        self.emit("session.closed", reason=reason)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._close_task = asyncio.get_running_loop().create_task(self._finish_close(reason),
                                                                  name=f"session-{self.id}-close")

    async def _finish_close(self, reason: str) -> None:
        try:
            await self.slot.close()
        except Exception:  # the transport must still be torn down, or the call would linger
            log.exception("session %s: engine slot failed to close", self.id)
        finally:
            if self.on_close is not None:
                result = self.on_close(reason)
                if asyncio.iscoroutine(result):
                    await result

    def describe(self) -> dict[str, Any]:
        caps = self.capabilities
        return {
            "id": self.id,
            "epoch": self.epoch,
            "engine": self.engine_name,
            "voice": self.options.voice,
            "temperature": self.options.temperature,
            "seed": self.options.seed,
            "instructions": self.options.instructions,
            "metrics": self.metrics_enabled,
            "input_audio_format": {"encoding": "pcm_f32le", "sample_rate": caps.input_rate,
                                   "window_samples": caps.window_samples},
            "output_audio_format": {"encoding": "pcm_f32le", "sample_rate": caps.output_rate},
            "capabilities": {k: v for k, v in asdict(caps).items() if k != "name"},
            **({"origin": self.origin} if self.origin else {}),
        }

    def snapshot(self) -> dict[str, Any]:
        """State and counters for GET /v1/sessions."""
        clock = self.window_clock.counters
        slot = self.slot.counters
        return {
            "session_id": self.id,
            **({"origin": self.origin} if self.origin else {}),
            "state": self.state,
            "epoch": self.epoch,
            "engine": self.engine_name,
            "active_response": self.active_response,
            "age_s": round(self.clock() - self.created_at, 3),
            "counters": {
                **asdict(self.counters),
                **{f"window_{k}": v for k, v in asdict(clock).items()},
                "engine_windows_in": slot.windows_in,
                "engine_windows_stepped": slot.windows_stepped,
                "engine_windows_dropped": slot.windows_dropped,
                "responses": self.ledger.total,
                "playout_depth_ms": round(self.sink.depth_ms, 1),
            },
        }

    # --- the transport's side ----------------------------------------------------------------------

    def attach_channel(self, send: Callable[[str], None], buffered: Callable[[], int] = lambda: 0) -> None:
        self._send, self._buffered = send, buffered
        while self._outbox:
            self._transmit(self._outbox.popleft())

    def add_listener(self, listener: EventListener) -> None:
        """Receive every event this session emits from now on (a dialect translates them)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: EventListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def buffered_events(self) -> int:
        """Bytes of events handed to the channel and not yet sent (0 without a channel)."""
        if self._send is None:
            return 0
        try:
            return int(self._buffered())
        except Exception:
            return 0

    def detach_channel(self, send: Callable[[str], None] | None = None) -> None:
        """Stop sending on the channel whose ``send`` this is (or on any channel if None)."""
        if send is None or self._send == send:
            self._send = None

    # --- losing and resuming the transport ----------------------------------------------------------

    def suspend(self, reason: str) -> None:
        """The media path is gone (the session, its engine slot and context stay): stop sending, and
        cancel what was being said, since nobody heard it."""
        if self.closed or self.suspended:
            return
        self.suspended = True
        self._send = None
        if self.active_response is not None:
            self.interrupt("connection_lost")

    def rebind_sink(self, sink: AudioSink) -> None:
        """A new transport plays the audio from now on, starting at the current epoch."""
        sink.cut(self.epoch)
        self.sink = sink
        self._resync_uplink = True

    def resume_channel(self, send: Callable[[str], None], buffered: Callable[[], int], last_seq: int) -> None:
        """Attach a resumed client's channel: replay what it missed from the journal, then say so."""
        self.suspended = False
        self._send, self._buffered = send, buffered
        self._outbox.clear()  # the journal holds all of it
        first = self._journal[0][0] if self._journal else last_seq + 1
        lost = max(0, first - last_seq - 1)
        replay = [text for seq, text in self._journal if seq > last_seq]
        for text in replay:
            self._transmit(text)
        self.emit("session.resumed", session=self.describe(), replayed=len(replay), lost=lost)

    def push_audio(self, samples: np.ndarray, now: float | None = None) -> None:
        if self.closed:
            return
        now = self.clock() if now is None else now
        self._resync(now)
        self.last_audio_at = now
        self.counters.input_samples += len(samples)
        self._forward_windows(self.window_clock.write(samples, now))

    def push_gap(self, n: int, now: float | None = None, fill: np.ndarray | None = None) -> None:
        if self.closed:
            return
        now = self.clock() if now is None else now
        self._resync(now)
        self.last_audio_at = now
        self._forward_windows(self.window_clock.gap(n, now, fill))

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
        if self.active_response is not None:
            self.interrupt("dtmf")
        self.slot.control(Control(ControlKind.DTMF, self.epoch, digit=digit.upper()))

    def _resync(self, now: float) -> None:
        if self._resync_uplink:
            self._resync_uplink = False
            self._forward_windows(self.window_clock.resync(now))

    def poll_clock(self, now: float | None = None) -> None:
        self._forward_windows(self.window_clock.poll(self.clock() if now is None else now))

    def _forward_windows(self, windows) -> None:
        for window in windows:
            self.slot.push(window.samples, window.seq, self.epoch)
        self._clock_wake.set()

    async def _clock_loop(self) -> None:
        while True:
            deadline = self.window_clock.deadline()
            if deadline is None:
                await self._clock_wake.wait()
                self._clock_wake.clear()
                continue
            delay = deadline - self.clock()
            if delay > 0:
                self._clock_wake.clear()
                if await wait_event(self._clock_wake, delay):
                    continue  # windows moved on; recompute the deadline
            self.poll_clock()

    # --- events out --------------------------------------------------------------------------------

    def emit(self, event_type: str, **fields: Any) -> dict[str, Any]:
        event = self._stamper.stamp(event_type, **fields)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # one broken consumer must not starve the others
                log.exception("session %s: event listener failed on %s", self.id, event_type)
        text = strict_json_dumps(event)
        self._journal.append((event["seq"], text))
        if self._send is None:
            self._outbox.append(text)
            while len(self._outbox) > self.settings.event_buffer:
                self._outbox.popleft()
                self.counters.events_dropped += 1
        elif (event_type == "metrics" and self._buffered() > CHANNEL_HIGH_WATER) \
                or self._buffered() > CHANNEL_HARD_LIMIT:
            self.counters.events_dropped += 1
        else:
            self._transmit(text)
        return event

    def _transmit(self, text: str) -> None:
        try:
            assert self._send is not None
            self._send(text)
            self.counters.events_out += 1
        except Exception:  # the channel closed under us; the peer's close path ends the session
            self.counters.events_dropped += 1

    def _error(self, err: ProtocolError) -> None:
        self.counters.bad_messages += 1
        self.emit("error", error=error_body(err))

    # --- client messages ---------------------------------------------------------------------------

    def handle_message(self, raw: str | bytes) -> None:
        if self.closed or not self.admit_message():
            return
        try:
            event = parse_client_event(raw)
            self._dispatch(event)
        except ProtocolError as err:
            self._error(err)
        except Exception:  # never let a message take the transport down with it
            log.exception("session %s: failed to handle a client message", self.id)
            self._error(ProtocolError("internal_error", "the server failed to handle this message",
                                      error_type="server_error"))

    def reject_oversize(self, size: int) -> None:
        """The transport dropped a message while it arrived, at ``size`` bytes, for being too large."""
        if self.closed:
            return
        self.counters.messages_in += 1
        self._error(ProtocolError("message_too_large",
                                  f"message of more than {size} bytes exceeds {MAX_MESSAGE_BYTES}; it was dropped"))

    def admit_message(self) -> bool:
        """Count a client message, of any dialect, against the session's token bucket, so a
        flooding client cannot monopolise the loop; False: drop it."""
        self.counters.messages_in += 1
        now = self.clock()
        self._message_tokens = min(float(MESSAGE_BURST),
                                   self._message_tokens + (now - self._message_refill_at) * MESSAGES_PER_SECOND)
        self._message_refill_at = now
        if self._message_tokens >= 1.0:
            self._message_tokens -= 1.0
            return True
        self.counters.rate_limited_messages += 1
        if now - self._rate_error_at >= 1.0:  # one error a second, not one per dropped message
            self._rate_error_at = now
            self._error(ProtocolError("rate_limited", f"more than {MESSAGES_PER_SECOND:.0f} messages per second; "
                                      "messages are being dropped"))
        return False

    def _dispatch(self, ev: ClientEvent) -> None:
        p = ev.payload
        if ev.type == "response.cancel":
            self.cancel_response(p.get("response_id"), ev.event_id)
        elif ev.type == "input_audio_buffer.commit":
            self.commit_input()
        elif ev.type == "turn.listen":
            # Always a fence, even with no response yet: a step already running may be about to
            # start one, and it must not be heard while the session is held.
            self.held = True
            self.interrupt("turn.listen")
            self.slot.control(Control(ControlKind.FORCE_LISTEN, self.epoch))
        elif ev.type == "turn.release":
            self.held = False
            self.slot.control(Control(ControlKind.RELEASE_LISTEN, self.epoch))
            self._set_state("listening", "turn.release")
        elif ev.type == "session.update":
            self.update(p["session"], ev.event_id)
        elif ev.type == "playback.ack":
            record = self.ledger.get(p["response_id"])
            if record is None:
                raise ProtocolError("response_not_found", f"unknown response {p['response_id']!r}", ev.event_id)
            record.client_played_ms = float(p["played_ms"])
        elif ev.type == "ping":
            fields: dict[str, Any] = {"server_time": time.time(), "epoch": self.epoch}
            if "client_time" in p:
                fields["client_time"] = p["client_time"]
            self.emit("pong", **fields)
        elif ev.type == "session.close":
            self.request_close("client_closed")
        else:  # the schema and this dispatcher disagree: a server bug, said plainly
            raise ProtocolError("not_implemented", f"event type {ev.type!r} is not handled", ev.event_id, "server_error")

    # --- typed controls (every dialect ends here) ----------------------------------------------------

    def cancel_response(self, response_id: str | None = None, event_id: str | None = None) -> None:
        if self.active_response is None:
            raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel", event_id)
        if response_id is not None and response_id != self.active_response:
            raise ProtocolError("response_not_found",
                                f"response {response_id!r} is not the response in progress", event_id)
        self.interrupt("client_cancel")

    def clear_output_audio(self) -> bool:
        """Cut what the client is hearing (the response in progress, if any); True if one was cut."""
        if self.active_response is None:
            return False
        return self.interrupt("client_cancel")

    def commit_input(self) -> None:
        self.slot.control(Control(ControlKind.COMMIT, self.epoch))
        self.emit("input_audio_buffer.committed", epoch=self.epoch)

    def request_close(self, reason: str) -> None:
        if self._close_task is None:  # one teardown, however many times the client asks
            self._begin_close(reason)

    def update(self, fields: dict[str, Any], event_id: str | None = None) -> InstructionsEffect:
        """Apply validated option changes (keys of the ``session_config`` schema) and answer with
        ``session.updated``."""
        voice = fields.get("voice", self.options.voice)
        voices = self.capabilities.voices
        if voice is not None and voices and voice not in voices:
            raise ProtocolError("invalid_voice", f"voice {voice!r} is not one of {list(voices)}", event_id)
        if voice is not None and not voices:
            raise ProtocolError("invalid_voice", f"engine {self.engine_name!r} has no selectable voices", event_id)
        effect: InstructionsEffect = "unchanged"
        changes = {k: fields[k] for k in ("voice", "temperature", "seed", "instructions") if k in fields}
        if "instructions" in changes and changes["instructions"] != self.options.instructions:
            if not self.capabilities.instructions:
                effect = "unused"
            elif self.ledger.total == 0:
                effect = "applied"
            else:
                effect = "next_context_reset"
        self.options = replace(self.options, **changes)
        if "metrics" in fields:
            self.metrics_enabled = bool(fields["metrics"])
        if effect == "applied":
            # Before the model first spoke: a fresh conversation under the new system prompt. The
            # epoch fences any response the engine may have begun before it sees the restart.
            self.epoch += 1
            self.sink.cut(self.epoch)
            self.slot.control(Control(ControlKind.CANCEL, self.epoch))
            self.slot.control(Control(ControlKind.RESTART, self.epoch, self.options))
        self.slot.control(Control(ControlKind.UPDATE, self.epoch, self.options))
        self.emit("session.updated", session=self.describe(), instructions_effect=effect)
        return effect

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
        response_id = self.active_response or report.response_id
        record = self.ledger.get(response_id)
        cut = record is not None and record.status == "in_progress"
        if cut:
            if report.response_id == response_id:
                record.played_samples, record.rate = report.played_samples, report.rate
            rate = report.rate
            self.emit(
                "output_audio_buffer.cleared",
                epoch=old_epoch,
                response_id=response_id,
                new_epoch=self.epoch,
                sample_offset=report.sample_offset,
                sample_rate=rate,
                audio_ms=1000.0 * report.sample_offset / rate,
                played_ms=record.played_ms,
                discarded_ms=1000.0 * report.discarded_samples / rate,
            )
            self._finish_response(response_id, "cancelled", reason)
        onset = self.window_clock.time_of(speech_sample) if speech_sample is not None else None
        self.observer.interruption(time.perf_counter() - started,
                                   None if onset is None else max(0.0, self.clock() - onset))
        self._deferred_listen = None
        self._set_state("held" if self.held else "listening", reason)
        return cut

    def _finish_response(self, response_id: str, status: str, reason: str) -> None:
        record = self.ledger.get(response_id)
        if record is None or record.status != "in_progress":
            return
        record.status, record.reason = status, reason
        if self.active_response == response_id:
            self.active_response = None
        self.emit(
            "response.done",
            epoch=record.epoch,
            response_id=response_id,
            response={
                "id": response_id,
                "epoch": record.epoch,
                "status": status,
                "status_details": {"reason": reason} if reason else None,
                "played_ms": record.played_ms,
            },
        )

    def _set_state(self, state: str, reason: str, probabilities: dict[str, float] | None = None) -> None:
        self.state = state
        fields: dict[str, Any] = {"epoch": self.epoch, "state": state, "reason": reason}
        if probabilities:
            fields["probabilities"] = probabilities
        self.emit("turn.state", **fields)

    # --- playout marks (from the sink) -------------------------------------------------------------

    def on_playout_started(self, epoch: int, response_id: str, sample_offset: int, rate: int) -> None:
        record = self.ledger.get(response_id)
        if record is None or epoch != self.epoch:
            return
        record.audible, record.rate = True, rate
        self.emit("output_audio_buffer.started", epoch=epoch, response_id=response_id,
                  sample_offset=sample_offset, sample_rate=rate, audio_ms=1000.0 * sample_offset / rate)

    def on_playout_finished(self, epoch: int, response_id: str, played_samples: int, sample_offset: int,
                            rate: int) -> None:
        record = self.ledger.get(response_id)
        if record is None or epoch != self.epoch or record.status != "in_progress":
            return
        record.played_samples, record.rate = played_samples, rate
        if record.audible:
            self.emit("output_audio_buffer.stopped", epoch=epoch, response_id=response_id,
                      sample_offset=sample_offset, sample_rate=rate, audio_ms=1000.0 * sample_offset / rate,
                      played_ms=record.played_ms)
        self._finish_response(response_id, record.final_status, record.reason)
        if self._deferred_listen is not None and self.active_response is None:
            reason, probabilities = self._deferred_listen
            self._deferred_listen = None
            self._set_state("held" if self.held else "listening", reason, probabilities)

    # --- engine events -----------------------------------------------------------------------------

    async def _engine_events(self) -> None:
        while True:
            event = await self.slot.events.get()
            if event is None:
                return
            try:
                self._on_engine_event(event)
            except Exception:
                log.exception("session %s: failed to handle %s", self.id, type(event).__name__)

    def _on_engine_event(self, ev: EngineEvent) -> None:
        if isinstance(ev, RESPONSE_SCOPED) and ev.epoch < self.epoch:
            self.counters.stale_engine_events += 1
            if isinstance(ev, AudioChunk):
                self.counters.stale_audio_chunks += 1
                self.observer.stale_chunk()
            return
        if isinstance(ev, AudioChunk):
            record = self.ledger.get(ev.response_id)
            if record is not None and record.first_audio_at is None:
                record.first_audio_at = self.clock()
                self._first_audio_ms = 1000.0 * (record.first_audio_at - record.created_at)
                self.observer.first_audio(record.first_audio_at - record.created_at)
            if not self.sink.write(ev.epoch, ev.response_id, ev.pcm):
                self.counters.stale_audio_chunks += 1
                self.observer.stale_chunk()
        elif isinstance(ev, ResponseStarted):
            if self.active_response is not None:  # the engine moved on without closing the last one
                self._finish_response(self.active_response, "incomplete", "superseded")
            self.ledger.add(ResponseRecord(ev.response_id, ev.epoch, created_at=self.clock()))
            self.active_response = ev.response_id
            self.emit("response.created", epoch=ev.epoch, response_id=ev.response_id,
                      response={"id": ev.response_id, "epoch": ev.epoch, "status": "in_progress"})
        elif isinstance(ev, TextDelta):
            self.emit("response.output_audio_transcript.delta", epoch=ev.epoch, response_id=ev.response_id,
                      delta=ev.text, token_ids=list(ev.token_ids))
        elif isinstance(ev, CodecTokens):
            self.emit("response.output_audio_codes.delta", epoch=ev.epoch, response_id=ev.response_id,
                      codes=list(ev.codes), vocoder=False,
                      note="this engine runs without a vocoder: speech codes only, no audio is sent")
        elif isinstance(ev, ResponseDone):
            record = self.ledger.get(ev.response_id)
            if record is None or record.status != "in_progress":
                return
            record.generation_done = True
            record.final_status, record.reason = ev.status, ev.reason
            # The response is done for the client when its last sample has played (sink reports it).
            self.sink.end_response(ev.epoch, ev.response_id)
        elif isinstance(ev, BargeIn):
            if ev.response_id == self.active_response:
                self.interrupt(ev.reason)
        elif isinstance(ev, TurnState):
            if self.held:
                return
            if ev.state == "listening" and self.active_response is not None:
                # The engine is done generating but its audio is still playing: the client hears the
                # agent speak until the last sample, so "listening" waits for the playout to end.
                self._deferred_listen = (ev.reason, ev.probabilities)
                return
            self._deferred_listen = None
            self._set_state(ev.state, ev.reason, ev.probabilities)
        elif isinstance(ev, SpeechStarted):
            self.emit("input_audio_buffer.speech_started", epoch=self.epoch,
                      audio_start_ms=1000.0 * ev.sample / self.capabilities.input_rate)
            if self.settings.vad_barge_in and self.active_response is not None:
                self.interrupt("barge_in", speech_sample=ev.sample)
        elif isinstance(ev, SpeechStopped):
            self.emit("input_audio_buffer.speech_stopped", epoch=self.epoch,
                      audio_end_ms=1000.0 * ev.sample / self.capabilities.input_rate)
        elif isinstance(ev, WindowTiming):
            self.observer.window_timing(ev)
            if self.metrics_enabled:
                extra = {}
                if self._first_audio_ms is not None:
                    extra["time_to_first_audio_ms"] = round(self._first_audio_ms, 3)
                    self._first_audio_ms = None
                self.emit("metrics", window_seq=ev.window_seq, queue_wait_ms=round(ev.queue_wait_ms, 3),
                          step_ms=round(ev.step_ms, 3), vocoder_ms=round(ev.vocoder_ms, 3),
                          batch_size=ev.batch_size,
                          deadline_ms=1000.0 * self.capabilities.window_samples / self.capabilities.input_rate,
                          playout_depth_ms=round(self.sink.depth_ms, 1), **extra)
        elif isinstance(ev, EngineError):
            self._error(ProtocolError(ev.code, ev.message, None,
                                      "invalid_request_error" if ev.code.startswith("input_") else "server_error"))
