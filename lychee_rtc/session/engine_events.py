"""The engine's events, as the session's: audio into the sink, responses, turn state, timing.

A part of ``DuplexSession`` (``session.py``), kept apart. Everything response-scoped from an epoch
older than the session's is dropped here, the first of the three fences of docs/architecture.md
("Epochs"); a response is done for the client when its last sample has played, not when the
engine finished it.
"""

from __future__ import annotations

import logging

from lychee_rtc.engine.base import (AudioChunk, BargeIn, CodecTokens, EngineError, EngineEvent, ResponseDone,
                                    ResponseStarted, SpeechStarted, SpeechStopped, TextDelta, TurnState,
                                    WindowTiming)
from lychee_rtc.session.protocol import ProtocolError

log = logging.getLogger(__name__)

RESPONSE_SCOPED = (ResponseStarted, TextDelta, CodecTokens, AudioChunk, ResponseDone, BargeIn, TurnState)


class EngineEvents:
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
            self.responses.audio_arrived(ev.response_id)
            if not self.sink.write(ev.epoch, ev.response_id, ev.pcm):
                self.counters.stale_audio_chunks += 1
                self.observer.stale_chunk()
        elif isinstance(ev, ResponseStarted):
            self.responses.start(ev.response_id, ev.epoch)
        elif isinstance(ev, TextDelta):
            self.emit("response.output_audio_transcript.delta", epoch=ev.epoch, response_id=ev.response_id,
                      delta=ev.text, token_ids=list(ev.token_ids))
        elif isinstance(ev, CodecTokens):
            self.emit("response.output_audio_codes.delta", epoch=ev.epoch, response_id=ev.response_id,
                      codes=list(ev.codes), vocoder=False,
                      note="this engine runs without a vocoder: speech codes only, no audio is sent")
        elif isinstance(ev, ResponseDone):
            # The response is done for the client when its last sample has played (sink reports it).
            if self.responses.generation_done(ev.response_id, ev.status, ev.reason):
                self.sink.end_response(ev.epoch, ev.response_id)
        elif isinstance(ev, BargeIn):
            if ev.response_id == self.responses.active:
                self.interrupt(ev.reason)
        elif isinstance(ev, TurnState):
            if self.held:
                return
            if ev.state == "listening" and self.responses.active is not None:
                # The engine is done generating but its audio is still playing: the client hears the
                # agent speak until the last sample, so "listening" waits for the playout to end.
                self._deferred_listen = (ev.reason, ev.probabilities)
                return
            self._deferred_listen = None
            self._set_state(ev.state, ev.reason, ev.probabilities)
        elif isinstance(ev, SpeechStarted):
            self.emit("input_audio_buffer.speech_started", epoch=self.epoch,
                      audio_start_ms=1000.0 * ev.sample / self.capabilities.input_rate)
            if self.settings.vad_barge_in and self.responses.active is not None:
                self.interrupt("barge_in", speech_sample=ev.sample)
        elif isinstance(ev, SpeechStopped):
            self.emit("input_audio_buffer.speech_stopped", epoch=self.epoch,
                      audio_end_ms=1000.0 * ev.sample / self.capabilities.input_rate)
        elif isinstance(ev, WindowTiming):
            self.observer.window_timing(ev)
            for listener in list(self.window_listeners):
                listener(ev)
            if self.metrics_enabled:
                extra = {}
                if self.responses.first_audio_ms is not None:
                    extra["time_to_first_audio_ms"] = round(self.responses.first_audio_ms, 3)
                    self.responses.first_audio_ms = None
                self.emit("metrics", window_seq=ev.window_seq, queue_wait_ms=round(ev.queue_wait_ms, 3),
                          step_ms=round(ev.step_ms, 3), vocoder_ms=round(ev.vocoder_ms, 3),
                          batch_size=ev.batch_size,
                          deadline_ms=1000.0 * self.capabilities.window_samples / self.capabilities.input_rate,
                          playout_depth_ms=round(self.sink.depth_ms, 1), **extra)
        elif isinstance(ev, EngineError):
            self.report_error(ProtocolError(ev.code, ev.message, None,
                                      "invalid_request_error" if ev.code.startswith("input_") else "server_error"))
