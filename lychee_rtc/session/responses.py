"""The responses of one session: which one is in progress, what each one played, and their events.

A response begins when the engine says so, and ends for the client only when its last sample has
played (the sink's playout marks), when it is cut (``cut``, part of an interruption) or when the
engine moves on without closing it. Every end says ``response.done`` exactly once, with the
milliseconds actually played; the records stay in a bounded ledger.
"""

from __future__ import annotations

from typing import Any, Callable

from lychee_rtc.session.ledger import ResponseLedger, ResponseRecord
from lychee_rtc.session.observer import SessionObserver
from lychee_rtc.session.sink import CutReport


class Responses:
    def __init__(self, emit: Callable[..., Any], clock: Callable[[], float], observer: SessionObserver) -> None:
        self.ledger = ResponseLedger()
        self.active: str | None = None  # the response in progress, if any
        self.first_audio_ms: float | None = None  # of the latest response, until a metrics event reports it
        self._emit = emit
        self._clock = clock
        self._observer = observer

    def start(self, response_id: str, epoch: int) -> None:
        if self.active is not None:  # the engine moved on without closing the last one
            self.finish(self.active, "incomplete", "superseded")
        self.ledger.add(ResponseRecord(response_id, epoch, created_at=self._clock()))
        self.active = response_id
        self._emit("response.created", epoch=epoch, response_id=response_id,
                   response={"id": response_id, "epoch": epoch, "status": "in_progress"})

    def audio_arrived(self, response_id: str) -> None:
        """A chunk of the response reached the sink: the first one times the response's first audio."""
        record = self.ledger.get(response_id)
        if record is not None and record.first_audio_at is None:
            record.first_audio_at = self._clock()
            self.first_audio_ms = 1000.0 * (record.first_audio_at - record.created_at)
            self._observer.first_audio(record.first_audio_at - record.created_at)

    def generation_done(self, response_id: str, status: str, reason: str) -> bool:
        """The engine finished generating; the response ends when its audio has played. False if it
        is not in progress (already cut or forgotten)."""
        record = self.ledger.get(response_id)
        if record is None or record.status != "in_progress":
            return False
        record.generation_done = True
        record.final_status, record.reason = status, reason
        return True

    def finish(self, response_id: str, status: str, reason: str) -> None:
        record = self.ledger.get(response_id)
        if record is None or record.status != "in_progress":
            return
        record.status, record.reason = status, reason
        if self.active == response_id:
            self.active = None
        self._emit(
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

    def cut(self, report: CutReport, old_epoch: int, new_epoch: int, reason: str) -> bool:
        """The playout was cut from ``old_epoch`` to ``new_epoch``: the response in progress (or the
        one still audible) ends as cancelled, with what was played. True if one was cut."""
        response_id = self.active or report.response_id
        record = self.ledger.get(response_id)
        if record is None or record.status != "in_progress":
            return False
        if report.response_id == response_id:
            record.played_samples, record.rate = report.played_samples, report.rate
        rate = report.rate
        self._emit(
            "output_audio_buffer.cleared",
            epoch=old_epoch,
            response_id=response_id,
            new_epoch=new_epoch,
            sample_offset=report.sample_offset,
            sample_rate=rate,
            audio_ms=1000.0 * report.sample_offset / rate,
            played_ms=record.played_ms,
            discarded_ms=1000.0 * report.discarded_samples / rate,
        )
        self.finish(response_id, "cancelled", reason)
        return True

    # --- playout marks of the current epoch (from the sink) ------------------------------------------

    def playout_started(self, epoch: int, response_id: str, sample_offset: int, rate: int) -> None:
        record = self.ledger.get(response_id)
        if record is None:
            return
        record.audible, record.rate = True, rate
        self._emit("output_audio_buffer.started", epoch=epoch, response_id=response_id,
                   sample_offset=sample_offset, sample_rate=rate, audio_ms=1000.0 * sample_offset / rate)

    def playout_finished(self, epoch: int, response_id: str, played_samples: int, sample_offset: int,
                         rate: int) -> bool:
        """The response's last sample has played: it ends as the engine said. False if it was not in
        progress."""
        record = self.ledger.get(response_id)
        if record is None or record.status != "in_progress":
            return False
        record.played_samples, record.rate = played_samples, rate
        if record.audible:
            self._emit("output_audio_buffer.stopped", epoch=epoch, response_id=response_id,
                       sample_offset=sample_offset, sample_rate=rate, audio_ms=1000.0 * sample_offset / rate,
                       played_ms=record.played_ms)
        self.finish(response_id, record.final_status, record.reason)
        return True
