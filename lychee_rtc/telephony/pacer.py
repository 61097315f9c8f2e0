"""The answer's way to the caller: paced frames in the carrier's format, heard-ness from its marks.

The session writes 24 kHz PCM with epoch tags into an ``EpochPlayout`` (the same sink as WebRTC's);
this pacer reads it in the carrier's frame length and rate, sends each frame no earlier than real
time allows (plus a small lead when a response starts, the carrier's cushion), and follows its audio
with a mark. The carrier echoes a mark when the audio before it has played, which is the only
playout receipt a phone call has: responses end, and ``played_ms`` is counted, from the echoes,
never from what was sent. Sent-but-unconfirmed audio is bounded (``max_ahead_ms``), so we are never
far ahead of the caller's ear. On a cut the carrier's flush goes out at once; marks it echoes
because of that flush (Twilio, Telnyx) are recognised and not counted as played.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from lychee_rtc.aio import wait_event
from lychee_rtc.config import TelephonySettings
from lychee_rtc.media.epoch_sink import EpochSink, SinkCounters
from lychee_rtc.media.playout import EpochPlayout, PlayoutMark
from lychee_rtc.media.transit import TransitEstimate
from lychee_rtc.session.sink import CutReport
from lychee_rtc.telephony.carriers.base import Dialect
from lychee_rtc.telephony.outbox import Outbox

log = logging.getLogger(__name__)

# What measured the lag of the carrier's playout (a recording's meta says it), and over how many
# echoes its median is taken (a mark goes with every 20 ms of audio: about the last second).
MARK_SOURCE = "carrier_mark_echo"
MARK_HISTORY = 50
# An idle carrier (nothing to play) is recorded as this much silence at most; a longer idle is a
# break the recording sees from the stamps alone.
RECORDED_IDLE_S = 1.0
# Names of marks a cut discarded, remembered so their echoes are not taken as playout.
CUT_MARKS_REMEMBERED = 1024


@dataclass
class CarrierPacerCounters(SinkCounters):
    frames: int = 0
    marks_sent: int = 0
    marks_played: int = 0  # echoes that confirmed audio as heard
    marks_after_clear: int = 0  # echoes of marks our own flush discarded: not counted as played
    marks_unknown: int = 0
    flushes: int = 0
    held_for_playout: int = 0  # times sending waited for the caller's playout to catch up
    marks_timed_out: int = 0


@dataclass
class _PendingMark:
    epoch: int
    position: int  # outbound stream offset up to which audio was sent before this mark
    due: float  # when that audio should have finished playing at the caller
    progress: dict[str, int]  # response id -> its samples sent before this mark
    finished: list[tuple[PlayoutMark, int]] = field(default_factory=list)  # ended responses, frame offsets


class CarrierPacer(EpochSink):
    """The session's sink for a phone call (``EpochSink``) and the task that paces it to the carrier."""

    counters: CarrierPacerCounters

    def __init__(self, in_rate: int, dialect: Dialect, outbox: Outbox, settings: TelephonySettings,
                 max_buffer_s: float, clock: Callable[[], float] = time.monotonic,
                 on_stalled: Callable[[], None] | None = None, live: bool = False) -> None:
        self.dialect = dialect
        self.outbox = outbox
        self.settings = settings
        super().__init__(EpochPlayout(in_rate, dialect.audio.rate, max_buffer_s), CarrierPacerCounters())
        self.transit = TransitEstimate(history=MARK_HISTORY)
        self.frame_samples = dialect.audio.rate * dialect.frame_ms() // 1000
        # The carrier holds about the lead before playing it: the echo reference stands that far ahead.
        self.reference_lead_s = settings.lead_ms / 1000.0
        self.marks_trusted = True  # False once the carrier has shown it does not echo marks
        self._clock = clock
        self._on_stalled = on_stalled
        rate = dialect.audio.rate
        self._lead_s = settings.lead_ms / 1000.0
        self._max_ahead = max(self.frame_samples * 2, settings.max_ahead_ms * rate // 1000)
        self._mark_every = max(self.frame_samples, settings.mark_interval_ms * rate // 1000)
        self._carrier_until = 0.0  # when the carrier will have played everything sent (estimate)
        self.live = live
        self._short_since: float | None = None  # when the queue was found short of a frame mid-response
        self._sent_position = 0  # outbound stream offset after the last frame sent
        self._confirmed_position = 0  # ... up to which the carrier has confirmed playout
        self._since_mark = 0
        self._mark_seq = 0
        self._pending: OrderedDict[str, _PendingMark] = OrderedDict()
        self._finished: list[tuple[PlayoutMark, int]] = []  # ended since the last mark
        self._progress: dict[str, int] = {}  # sent samples per response of this epoch
        self._confirmed: dict[str, int] = {}  # confirmed-played samples per response of this epoch
        self._last_response: str | None = None
        self._cut_marks: deque[str] = deque(maxlen=CUT_MARKS_REMEMBERED)
        self._cut_names: set[str] = set()
        self._mark_arrived = asyncio.Event()

    # --- the AudioSink the session writes into (EpochSink), and what a cut must also do -------------

    @property
    def unconfirmed_ms(self) -> float:
        return 1000.0 * (self._sent_position - self._confirmed_position) / self.dialect.audio.rate

    def cut(self, new_epoch: int) -> CutReport:
        """Drop the queue, take back unsent frames, flush the carrier; report what was heard."""
        report = super().cut(new_epoch)
        if self.reference is not None and (self._sent_position > self._confirmed_position or self._pending):
            self.reference.cut_far_end()  # the carrier's flush drops what it had not played
        response_id = report.response_id or self._last_response
        played = self._heard(response_id)
        unconfirmed = self._sent_position - self._confirmed_position
        if unconfirmed > 0 or self._pending:
            self.outbox.purge(lambda epoch: epoch < new_epoch)
            self._send(self.dialect.clear())
            self.counters.flushes += 1
        for name in self._pending:
            if len(self._cut_marks) == self._cut_marks.maxlen:
                self._cut_names.discard(self._cut_marks[0])
            self._cut_marks.append(name)
            self._cut_names.add(name)
        self._pending.clear()
        self._finished.clear()
        self._progress.clear()
        self._confirmed.clear()
        self._last_response = None
        self._since_mark = 0
        self._confirmed_position = self._sent_position
        self._carrier_until = self._clock()  # the flush empties the carrier's buffer
        if self.sent_tap is not None:
            self.sent_tap.agent_cut(self._carrier_until)
        self._mark_arrived.set()
        return CutReport(report.old_epoch, response_id, played, report.discarded_samples + max(0, unconfirmed),
                         report.sample_offset, report.rate)

    def _heard(self, response_id: str | None) -> int:
        if response_id is None:
            return 0
        if self.marks_trusted:
            return self._confirmed.get(response_id, 0)
        return self._progress.get(response_id, 0)

    # --- the carrier's side ----------------------------------------------------------------------

    def on_mark(self, name: str) -> None:
        """The carrier echoed mark ``name``: everything sent before it has played (unless we cut it)."""
        if name in self._cut_names:
            self.counters.marks_after_clear += 1
            return
        if name not in self._pending:
            self.counters.marks_unknown += 1
            return
        while self._pending:  # marks come back in order; an earlier one that did not is played too
            key, pending = self._pending.popitem(last=False)
            self._confirm(pending)
            if key == name:
                # The carrier's playout receipt: how far behind our estimate of its buffer the caller
                # heard this audio end (the carrier's own buffer and the way there and back).
                self.transit.observe(max(0.0, self._clock() - pending.due), MARK_SOURCE, out_share=1.0)
                break
        self._mark_arrived.set()

    def _confirm(self, pending: _PendingMark) -> None:
        self.counters.marks_played += 1
        self._confirmed_position = max(self._confirmed_position, pending.position)
        self._confirmed.update(pending.progress)
        for mark, offset in pending.finished:
            self.playout.notify(pending.epoch, mark, offset)

    # --- pacing ----------------------------------------------------------------------------------

    def _has_audio(self) -> bool:
        return self.playout.queued or self.playout.playing is not None

    async def run(self) -> None:
        """The pacer task: sends frames while there is audio, idles (sending nothing) otherwise.

        Pacing follows an estimate of the carrier's buffer: it plays in real time from what it
        receives, so a frame may leave once the carrier holds less than the lead. After a stall the
        carrier has played its buffer out and the lead is sent again; a burst of late audio is never
        sent faster than that, so no delay builds up at the carrier.
        """
        frame_s = self.frame_samples / self.dialect.audio.rate
        while True:
            if not self._has_audio():
                await self._wait(self._audio_arrived, self._mark_deadline())
                self._check_mark_timeout()
                continue
            if self.marks_trusted and self._sent_position - self._confirmed_position + self.frame_samples \
                    > self._max_ahead:
                self.counters.held_for_playout += 1
                await self._wait(self._mark_arrived, self._mark_deadline())
                self._check_mark_timeout()
                continue
            now = self._clock()
            due = max(self._carrier_until, now) - self._lead_s
            if due > now:
                await asyncio.sleep(due - now)
                continue  # a cut may have happened meanwhile: look again
            if self.playout.depth_samples < self.frame_samples and not self.playout.ending:
                # Mid-response and short of a frame: the engine is about to deliver (a live stream
                # arrives frame by frame). Wait for it a frame's time before sending a padded frame.
                if self._short_since is None:
                    self._short_since = now
                if now < self._short_since + frame_s:
                    await self._wait(self._audio_arrived, self._short_since + frame_s - now)
                    continue
            self._short_since = None
            if self.live:  # a passthrough engine: what queued up behind a stall is standing delay
                self.trim_standing_delay(self.frame_samples)
            idle_s = now - self._carrier_until  # > 0: the carrier ran dry that long ago
            plays_at = max(self._carrier_until, now)
            self._carrier_until = plays_at + frame_s
            self._send_frame(plays_at, idle_s)

    async def _wait(self, event: asyncio.Event, timeout: float | None) -> None:
        event.clear()
        await wait_event(event, timeout)

    def _send_frame(self, plays_at: float, idle_s: float = 0.0) -> None:
        epoch = self.playout.epoch
        pcm, marks, offset = self.playout.read(self.frame_samples)
        if self.sent_tap is not None:  # heard when the carrier plays it, by our estimate of its buffer
            rate = self.dialect.audio.rate
            if 0.0 < idle_s <= RECORDED_IDLE_S:
                # The carrier played nothing meanwhile: that silence goes on the agent channel too,
                # which keeps a stream continuous in samples (a later stamp within its tolerance is
                # taken as jitter), so without it the audio after a short idle would land early.
                self.sent_tap.agent_sent(np.zeros(round(idle_s * rate), np.float32), rate, plays_at - idle_s)
            self.sent_tap.agent_sent(pcm, rate, plays_at)
        self._send(self.dialect.media(self.dialect.audio.encode(pcm)), epoch)
        self.played(pcm)
        self.counters.frames += 1
        self._sent_position = offset + self.frame_samples
        self._since_mark += self.frame_samples
        finished = []
        for mark in marks:
            if mark.kind == "started":  # it has left the server: audible from now on
                self.playout.notify(epoch, mark, offset)
            else:
                finished.append((mark, offset))
                self._progress[mark.response_id] = mark.played_samples
                self._last_response = mark.response_id
        playing = self.playout.playing
        if playing is not None:
            self._progress[playing[0]] = playing[1]
            self._last_response = playing[0]
        if not self.marks_trusted:
            self._confirmed_position = self._sent_position
            for mark, frame_offset in finished:
                self.playout.notify(epoch, mark, frame_offset)
            return
        self._finished.extend(finished)
        if self._since_mark >= self._mark_every or finished or not self._has_audio():
            self._send_mark(epoch)

    def _send_mark(self, epoch: int) -> None:
        self._mark_seq += 1
        name = f"lychee-{self._mark_seq}"
        due = self._carrier_until  # when the audio before this mark should have played
        self._pending[name] = _PendingMark(epoch, self._sent_position, due, dict(self._progress), self._finished)
        self._finished = []
        self._since_mark = 0
        self.counters.marks_sent += 1
        self._send(self.dialect.mark(name), epoch)

    def _send(self, message: str | bytes, epoch: int | None = None) -> None:
        if not self.outbox.put(message, epoch) and not self.outbox.closing and self._on_stalled is not None:
            self._on_stalled()

    # --- carriers that do not echo marks ---------------------------------------------------------

    def _mark_deadline(self) -> float | None:
        if not self._pending or not self.marks_trusted:
            return None
        oldest = next(iter(self._pending.values()))
        return max(0.0, oldest.due + self.settings.mark_timeout_s - self._clock())

    def _check_mark_timeout(self) -> None:
        if not self._pending or not self.marks_trusted:
            return
        oldest = next(iter(self._pending.values()))
        if self._clock() < oldest.due + self.settings.mark_timeout_s:
            return
        self.marks_trusted = False
        self.counters.marks_timed_out += 1
        log.warning("%s echoed no mark within %.1f s of its audio: counting sent audio as heard from now on",
                    self.dialect.name, self.settings.mark_timeout_s)
        while self._pending:
            self._confirm(self._pending.popitem(last=False)[1])
