"""One phone call: a carrier's WebSocket, its dialect, and the duplex session it feeds.

The call translates carrier events into the session's inputs (audio, digits, hang-up) and plays the
session's answer through a ``CarrierPacer``. Bad frames are reported as ``error`` events on the
call's event stream; past ``telephony.max_bad_frames`` the call is closed with a close code that
says why. The server registers the call with the call registry like any other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from lychee_rtc.calls.tokens import Opener
from lychee_rtc.config import TelephonySettings
from lychee_rtc.media.playout import PlayoutCounters
from lychee_rtc.session.protocol import ProtocolError, error_body
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.telephony.carriers.base import Dialect
from lychee_rtc.telephony.frames import (
    CLOSE_GOING_AWAY,
    CLOSE_INVALID_PAYLOAD,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    AudioIn,
    CarrierReported,
    DigitPressed,
    FrameError,
    MarkPlayed,
    PlaybackCleared,
    StreamStarted,
    StreamStopped,
    Unhandled,
)
from lychee_rtc.telephony.outbox import Outbox, Socket
from lychee_rtc.telephony.pacer import CarrierPacer
from lychee_rtc.telephony.uplink import CarrierUplink

log = logging.getLogger(__name__)

# Frames queued towards a carrier (about 20 s of 20 ms audio plus marks) before it counts as not reading.
OUTBOX_LIMIT = 2000
WRITER_CLOSE_TIMEOUT_S = 5.0
# Why a session ended -> the close code the carrier gets.
CLOSE_CODES = {"malformed_frames": CLOSE_INVALID_PAYLOAD, "server_shutdown": CLOSE_GOING_AWAY,
               "carrier_not_reading": CLOSE_POLICY}


@dataclass
class CallCounters:
    bad_frames: int = 0
    digits: int = 0
    clears_acknowledged: int = 0
    carrier_errors: int = 0
    ignored_frames: int = 0


@dataclass
class CarrierCall:
    session: DuplexSession
    dialect: Dialect
    started: StreamStarted
    pacer: CarrierPacer
    uplink: CarrierUplink
    outbox: Outbox
    settings: TelephonySettings
    tasks: list[asyncio.Task] = field(default_factory=list)
    watchdog: asyncio.Task | None = None  # the registry's
    token: str | None = None  # carriers get no session token; the server key opens the call's resources
    connected_at: float | None = field(default_factory=time.monotonic)
    folded: dict[str, int] = field(default_factory=dict)
    on_closed: list[Callable[[str], Awaitable[None] | None]] = field(default_factory=list)
    # A carrier stream cannot be re-attached: it is never suspended (calls.Call).
    suspended_at: float | None = None
    suspend_reason: str | None = None
    resuming: bool = False
    path_lost_at: float | None = None
    counters: CallCounters = field(default_factory=CallCounters)
    companion: Outbox | None = None  # the call's event stream, when an application watches it
    _own_tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    def create(cls, session_factory, dialect: Dialect, started: StreamStarted, settings: TelephonySettings,
               in_rate: int, max_buffer_s: float, live: bool = False) -> "CarrierCall":
        """``session_factory(sink)`` makes the session that will play into the call's playout."""
        outbox = Outbox(OUTBOX_LIMIT)
        holder: dict[str, CarrierCall] = {}
        pacer = CarrierPacer(in_rate, dialect, outbox, settings, max_buffer_s,
                             on_stalled=lambda: holder["call"].end("carrier_not_reading"), live=live)
        session = session_factory(pacer)
        pacer.listener = session
        call = cls(session, dialect, started, pacer, CarrierUplink(session, started.audio), outbox, settings)
        holder["call"] = call
        return call

    def start(self, socket: Socket) -> None:
        """Start writing to the carrier and pacing the answer (after the registry registered the call)."""
        self._own_tasks = [
            asyncio.create_task(self.outbox.run(socket), name=f"carrier-writer-{self.session.id}"),
            asyncio.create_task(self.pacer.run(), name=f"carrier-pacer-{self.session.id}"),
        ]

    # --- carrier frames --------------------------------------------------------------------------

    def handle(self, raw: str | bytes) -> str | None:
        """One frame from the carrier; the reason to end the call when it is over (hang-up, bad frames)."""
        if self.session.closed:
            return self.session.close_reason or "closed"
        try:
            event = self.dialect.parse(raw)
            if isinstance(event, AudioIn):
                self.uplink.push(event.payload, event.timestamp_ms)
            elif isinstance(event, MarkPlayed):
                self.pacer.on_mark(event.name)
            elif isinstance(event, DigitPressed):
                self.counters.digits += 1
                self.session.push_dtmf(event.digit, "carrier")
            elif isinstance(event, StreamStopped):
                return "hangup"
            elif isinstance(event, PlaybackCleared):
                self.counters.clears_acknowledged += 1
            elif isinstance(event, CarrierReported):
                self.counters.carrier_errors += 1
                self._report("carrier_error", event.message, "server_error")
            elif isinstance(event, StreamStarted):
                raise FrameError("a second start frame on a stream that has started")
            elif isinstance(event, Unhandled):
                self.counters.ignored_frames += 1
        except FrameError as exc:
            self.counters.bad_frames += 1
            self._report("invalid_carrier_frame", f"{self.dialect.name}: {exc}")
            if self.counters.bad_frames >= self.settings.max_bad_frames:
                return "malformed_frames"
        return None

    def _report(self, code: str, message: str, error_type: str = "invalid_request_error") -> None:
        self.session.emit("error", error=error_body(ProtocolError(code, message, error_type=error_type)))

    def end(self, reason: str) -> None:
        """Close the session (and through it this call) from outside the carrier's frames."""
        if not self.session.closed:
            self.tasks.append(asyncio.get_running_loop().create_task(self.session.close(reason)))

    # --- the registry's Call protocol ------------------------------------------------------------

    @property
    def resumable(self) -> bool:
        return False  # the carrier's socket is the call: when it goes, the call ends

    def opener(self) -> Opener:
        return Opener()  # no client holds a secret for it: the server key opens its resources

    def connect_started_at(self) -> float:
        return self.session.created_at

    async def drop_path(self) -> None:
        raise NotImplementedError("a carrier call is never suspended")

    def playout_counters(self) -> PlayoutCounters:
        return self.pacer.playout_counters()

    async def close_transport(self) -> None:
        reason = self.session.close_reason or "closed"
        code = CLOSE_CODES.get(reason, CLOSE_NORMAL)
        for task in self._own_tasks[1:]:
            task.cancel()
        self.pacer.playout.close()
        self.uplink.close()
        self.outbox.close(code, reason)
        if self.companion is not None:
            self.companion.close(CLOSE_NORMAL, f"call ended: {reason}")
        try:
            await asyncio.wait_for(self.outbox.done.wait(), WRITER_CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("session %s: carrier socket did not close in time", self.session.id)
            for task in self._own_tasks:
                task.cancel()

    def snapshot(self) -> dict[str, Any]:
        snap = self.session.snapshot()
        snap["transport"] = "telephony"
        snap["connection_state"] = "closing" if self.outbox.closing else "open"
        snap["codec"] = self.started.audio.label
        snap["telephony"] = {"provider": self.dialect.name, "call_id": self.started.call_id,
                             "stream_id": self.started.stream_id, "marks_trusted": self.pacer.marks_trusted,
                             "event_stream": self.companion is not None}
        playout = self.pacer.playout_counters()
        c = self.pacer.counters
        snap["counters"].update({
            "inbound_frames": self.uplink.counters.frames,
            "inbound_gaps": self.uplink.counters.gaps,
            "inbound_reordered_frames": self.uplink.counters.reordered_frames,
            "carrier_bad_frames": self.counters.bad_frames,
            "carrier_digits": self.counters.digits,
            "outbound_frames": c.frames,
            "outbound_stale_chunks": c.stale_chunks,
            "outbound_purged_frames": self.outbox.purged,
            "marks_sent": c.marks_sent,
            "marks_played": c.marks_played,
            "marks_after_clear": c.marks_after_clear,
            "flushes": c.flushes,
            "held_for_playout": c.held_for_playout,
            "unconfirmed_ms": round(self.pacer.unconfirmed_ms, 1),
            "playout_underrun_samples": playout.underrun_samples,
            "playout_overflow_samples": playout.overflow_samples,
        })
        return snap

    def matches(self, key: str) -> bool:
        return key in (self.session.id, self.started.call_id, self.started.stream_id)
