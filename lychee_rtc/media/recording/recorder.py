"""One session's recording as the event loop sees it: taps that copy a little and never wait.

The caller channel is tapped where concealed uplink audio enters the session (``caller_audio``),
before any processing of it; the agent channel where a transport lets a frame go to the caller
(``agent_sent``, with the time the caller starts hearing it), and a carrier's flush takes back what
it had not played (``agent_cut``). Session events go to the JSON-lines sidecar stamped on the same
clock. Each tap puts one item on the writer's bounded queue; when it is full the item is dropped
and counted, so a slow disk costs recorded audio, never the call's timing.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from lychee_rtc.jsonio import JsonError, strict_json_dumps
from lychee_rtc.media.recording.timeline import RATE
from lychee_rtc.media.recording.writer import RecordingWriter, WriterState
from lychee_rtc.media.transit import TransitEstimate

log = logging.getLogger(__name__)

CALLER, AGENT = 0, 1
# Events the sidecar leaves out: per-window timing is noise next to the call's own events.
SKIPPED_EVENTS = frozenset({"metrics"})
# The transit compensation moves only by this much or more: each move shifts a channel (a few
# samples of silence or overlap at that point), so the estimate's small wobble is left alone.
TRANSIT_STEP_S = 0.001


class CallRecorder:
    def __init__(self, session_id: str, writer: RecordingWriter, clock: Callable[[], float] = time.monotonic,
                 started_at_wall: float | None = None) -> None:
        self.session_id = session_id
        self.writer = writer
        self.clock = clock
        self.paused = False
        self.closed = False
        self.started_at_wall = time.time() if started_at_wall is None else started_at_wall
        # The call's codec delay, each way (the transport's ``codec_delay_s``): the caller said what
        # arrives that much before it was encoded, and hears what leaves that much after. Both
        # channels keep the caller's own time by it (docs/recording.md, "One clock").
        self.codec_delay_s = 0.0
        # What the transport measures of the rest of the caller's loop (the sink's ``transit``:
        # RTCP's round trip on WebRTC, half each way; a carrier's mark echoes, on the way out): the
        # caller said what arrives ``way_in`` earlier still, and hears what leaves ``way_out``
        # later. ``applied`` is what the stamps use now.
        self.transit: TransitEstimate | None = None
        self.applied = (0.0, 0.0)
        self._warned_full = False

    @property
    def t0(self) -> float:
        return self.writer.t0

    @property
    def state(self) -> WriterState:
        return self.writer.state

    def start(self, header: dict[str, Any]) -> None:
        self.writer.start()
        self._line({"t": 0.0, "type": "recording.started", **header})

    # --- taps ----------------------------------------------------------------------------------------

    def caller_audio(self, samples: np.ndarray, rate: int) -> None:
        """Concealed caller audio as it enters the session: it ended now."""
        if self.paused or self.closed or not len(samples):
            return
        at = self.clock() - len(samples) / rate - self.codec_delay_s - self._transit()[CALLER]
        self._submit(("audio", CALLER, at, np.array(samples, dtype=np.float32), rate))

    def agent_sent(self, pcm: np.ndarray, rate: int, at: float) -> None:
        """A frame left for the caller; ``at``: when its first sample is heard (monotonic)."""
        if self.paused or self.closed:
            return
        at += self.codec_delay_s + self._transit()[AGENT]
        self._submit(("audio", AGENT, at, np.array(pcm, dtype=np.float32), rate))

    def agent_cut(self, at: float) -> None:
        """Audio sent but not yet heard was taken back (a carrier's flush): it never played."""
        # Not moved by the way out: that is mostly the carrier's buffer, which the flush empties
        # the moment it arrives; the flush's own transit is not measured.
        if not self.closed:
            self._submit(("cut", AGENT, at))

    def event(self, event: dict[str, Any]) -> None:
        """A session event (an ``EventStream`` listener): a sidecar line, stamped now."""
        if self.paused or self.closed or event.get("type") in SKIPPED_EVENTS:
            return
        self._line({"t": round(self.clock() - self.t0, 4), **event})

    # --- control -------------------------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        """Paused: nothing is captured (the audio is silence, events are left out) until resumed."""
        if paused == self.paused or self.closed:
            return
        if paused:
            self._line({"t": round(self.clock() - self.t0, 4), "type": "recording.paused"})
        self.paused = paused
        if not paused:
            self._line({"t": round(self.clock() - self.t0, 4), "type": "recording.resumed"})

    def close(self, reason: str) -> None:
        if self.closed:
            return
        now = self.clock()
        self._line({"t": round(now - self.t0, 4), "type": "recording.stopped", "reason": reason,
                    "items_dropped": self.state.counters.items_dropped})
        self.closed = True
        self._note_alignment()
        self.writer.finish(now)

    def status(self) -> dict[str, Any]:
        c = self.state.counters
        state = "paused" if self.paused and self.state.status == "recording" else self.state.status
        return {"state": state, **({"error": self.state.error} if self.state.error else {}),
                "audio_bytes": c.audio_bytes, "seconds": round(c.encoded_samples / RATE, 3),
                "items_dropped": c.items_dropped, "late_samples": c.late_samples}

    # --- internals -----------------------------------------------------------------------------------

    def _transit(self) -> tuple[float, float]:
        """(way in, way out) for the stamp being made. When the estimate has moved, the channels
        are shifted by the change first (the writer takes items in order), so each channel's stamps
        stay continuous; the sidecar and the meta say what was applied."""
        t = self.transit
        now = (t.way_in_s(), t.way_out_s()) if t is not None else (0.0, 0.0)
        moved = [now[i] - self.applied[i] for i in (CALLER, AGENT)]
        if max(abs(m) for m in moved) >= TRANSIT_STEP_S:
            self.applied = now
            for channel, sign in ((CALLER, -1.0), (AGENT, 1.0)):
                if moved[channel]:
                    self._submit(("shift", channel, sign * moved[channel]))
            self._line({"t": round(self.clock() - self.t0, 4), "type": "recording.transit",
                        "way_in_ms": round(now[CALLER] * 1000, 2), "way_out_ms": round(now[AGENT] * 1000, 2),
                        "source": t.source if t is not None else "none"})
            self.state.alignment["transit_changes"] = self.state.alignment.get("transit_changes", 0) + 1
            self._note_alignment()
        return self.applied

    def _note_alignment(self) -> None:
        """What the stamps take out to keep the caller's time, for the recording's meta."""
        a = self.state.alignment
        a.update(codec_delay_ms=round(self.codec_delay_s * 1000, 2),
                 transit_source=self.transit.source if self.transit is not None else "none")
        for channel, name in ((CALLER, "way_in_ms"), (AGENT, "way_out_ms")):
            ms = round(self.applied[channel] * 1000, 2)
            a[f"{name}_last"] = ms
            if self.transit is not None and self.transit.reports:
                a[f"{name}_min"] = min(a.get(f"{name}_min", ms), ms)
                a[f"{name}_max"] = max(a.get(f"{name}_max", ms), ms)

    def _line(self, record: dict[str, Any]) -> None:
        try:
            text = strict_json_dumps(record)
        except (JsonError, TypeError, ValueError):
            return
        self._submit(("line", text))

    def _submit(self, item: tuple) -> None:
        if not self.writer.submit(item) and not self._warned_full:
            self._warned_full = True  # counted every time; said once
            log.warning("session %s: the recording cannot keep up; dropping what it cannot take", self.session_id)
