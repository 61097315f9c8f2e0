"""The echo engine: the CPU default that exercises the whole media path without a model.

``echo`` mode listens with a real VAD, and when the user's utterance ends it answers by replaying
that utterance at 24 kHz in 400 ms chunks, the same way a vocoder delivers speech. ``loopback`` mode
returns every input window at once, for mouth-to-ear latency measurement.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lychee_rtc.config import EchoSettings
from lychee_rtc.engine.base import (
    AudioChunk,
    Control,
    ControlKind,
    EngineCapabilities,
    EngineError,
    EngineEvent,
    ResponseDone,
    ResponseStarted,
    SessionOptions,
    SlotWindow,
    SpeechStarted,
    SpeechStopped,
    TurnState,
)
from lychee_rtc.engine.vad import CHUNK, SileroVad, VadStream
from lychee_rtc.pcm import PcmResampler

INPUT_RATE = 16000
OUTPUT_RATE = 24000
WINDOW_SAMPLES = 6400  # 400 ms, the Lychee-FD window
OUTPUT_CHUNK = OUTPUT_RATE * 400 // 1000
# Hysteresis: speech ends when the probability falls this far below the start threshold.
VAD_HYSTERESIS = 0.15


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(8)


@dataclass
class _Response:
    response_id: str
    epoch: int  # every chunk of a response carries the epoch it started in
    chunks: deque[np.ndarray]
    seq: int = 0
    replays: list[np.ndarray] = field(default_factory=list)  # the answer's chunks, to play again
    replays_left: int = 0


@dataclass
class _EchoSlot:
    epoch: int = 0
    vad: VadStream = field(default_factory=VadStream)
    position: int = 0  # input samples analysed by the VAD
    recent: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # speech pre-roll
    in_speech: bool = False
    speech_run: int = 0  # samples of consecutive speech while not yet in speech
    silence_run: int = 0  # samples of consecutive non-speech while in speech
    utterance: list[np.ndarray] = field(default_factory=list)
    utterance_samples: int = 0
    held: bool = False
    waiting_answer: np.ndarray | None = None  # an utterance that ended while held
    response: _Response | None = None


class EchoBackend:
    def __init__(self, settings: EchoSettings, max_sessions: int) -> None:
        self.settings = settings
        self.capabilities = EngineCapabilities(
            name="echo",
            input_rate=INPUT_RATE,
            output_rate=OUTPUT_RATE,
            window_samples=WINDOW_SAMPLES,
            max_sessions=max_sessions,
        )
        self._vad = SileroVad()
        self._slots: dict[int, _EchoSlot] = {}
        ms = INPUT_RATE // 1000
        self._min_speech = settings.min_speech_ms * ms
        self._min_silence = settings.min_silence_ms * ms
        self._pad = settings.speech_pad_ms * ms
        self._max_utterance = int(settings.max_utterance_s * INPUT_RATE)
        self._history_limit = self._min_speech + self._pad + CHUNK * 2

    # --- StepBackend -----------------------------------------------------------------------------

    def open_slot(self, slot: int, options: SessionOptions) -> None:
        self._slots[slot] = _EchoSlot()

    def close_slot(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def apply_controls(self, slot: int, controls: Sequence[Control]) -> list[EngineEvent]:
        state = self._slots.get(slot)
        if state is None:
            return []
        events: list[EngineEvent] = []
        for control in controls:
            events += self._control(state, control)
        return events

    def step(self, windows: Sequence[SlotWindow]) -> list[list[EngineEvent]]:
        return [self._step_slot(w) for w in windows]

    # --- per slot ---------------------------------------------------------------------------------

    def _step_slot(self, w: SlotWindow) -> list[EngineEvent]:
        state = self._slots.get(w.slot)
        if state is None:
            return []
        events = self.apply_controls(w.slot, w.controls)
        if w.epoch > state.epoch:  # the session moved on without our seeing its CANCEL: catch up
            events += self._control(state, Control(ControlKind.CANCEL, w.epoch))
        events += self._listen(state, w.window)
        events += self._speak(state, first=False)
        return events

    def _control(self, s: _EchoSlot, c: Control) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        if c.kind is ControlKind.CANCEL:
            if s.response is not None:  # owned by the old epoch: the session drops it as stale
                events.append(ResponseDone(s.epoch, s.response.response_id, "cancelled", "cancelled"))
                s.response = None
            s.epoch = max(s.epoch, c.epoch)
        elif c.kind is ControlKind.FORCE_LISTEN:
            if s.response is not None:
                events.append(ResponseDone(s.response.epoch, s.response.response_id, "cancelled", "turn.listen"))
                s.response = None
            s.epoch = max(s.epoch, c.epoch)
            s.held = True
        elif c.kind is ControlKind.RELEASE_LISTEN:
            s.held = False
            if s.waiting_answer is not None:
                audio, s.waiting_answer = s.waiting_answer, None
                events += self._start_response(s, audio)
        elif c.kind is ControlKind.DTMF:
            # "#" ends the caller's turn, as on a voicemail prompt; other keys are only events.
            if c.digit == "#" and s.utterance_samples:
                audio = self._take_utterance(s, trailing_silence=0)
                events.append(SpeechStopped(s.epoch, s.position))
                events += self._answer(s, audio)
        elif c.kind is ControlKind.COMMIT:
            if not s.utterance_samples:
                events.append(EngineError(s.epoch, "input_audio_buffer_commit_empty",
                                          "no user speech is buffered to answer"))
            else:
                audio = self._take_utterance(s, trailing_silence=0)
                events.append(SpeechStopped(s.epoch, s.position))
                events += self._answer(s, audio)
        return events

    def _listen(self, s: _EchoSlot, window: np.ndarray) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        audio = np.concatenate([s.vad.pending, window])
        probs = self._vad.process(s.vad, window)  # one probability per whole 512-sample chunk
        # Recent audio plus what the VAD consumed now, so a detected start can reach back in time.
        context = np.concatenate([s.recent, audio[:len(probs) * CHUNK]])
        context_base = s.position - len(s.recent)  # stream position of context[0]
        threshold = self.settings.vad_threshold
        for i, p in enumerate(probs):
            chunk = audio[i * CHUNK:(i + 1) * CHUNK]
            s.position += CHUNK
            if not s.in_speech:
                s.speech_run = s.speech_run + CHUNK if p >= threshold else 0
                if s.speech_run >= max(self._min_speech, CHUNK):
                    start = max(s.position - s.speech_run - self._pad, context_base)
                    s.in_speech, s.silence_run = True, 0
                    s.utterance = [context[start - context_base:s.position - context_base].copy()]
                    s.utterance_samples = len(s.utterance[0])
                    events.append(SpeechStarted(s.epoch, start))
                continue
            s.utterance.append(chunk.copy())
            s.utterance_samples += len(chunk)
            s.silence_run = s.silence_run + CHUNK if p < threshold - VAD_HYSTERESIS else 0
            if s.silence_run >= self._min_silence or s.utterance_samples >= self._max_utterance:
                events.append(SpeechStopped(s.epoch, s.position - s.silence_run))
                utterance = self._take_utterance(s, trailing_silence=s.silence_run)
                events += self._answer(s, utterance)
        s.recent = context[-self._history_limit:].copy()
        return events

    def _take_utterance(self, s: _EchoSlot, trailing_silence: int) -> np.ndarray:
        audio = np.concatenate(s.utterance) if s.utterance else np.zeros(0, np.float32)
        cut = max(trailing_silence - self._pad, 0)
        if cut:
            audio = audio[:len(audio) - cut]
        s.utterance, s.utterance_samples = [], 0
        s.in_speech, s.speech_run, s.silence_run = False, 0, 0
        return audio

    def _answer(self, s: _EchoSlot, audio: np.ndarray) -> list[EngineEvent]:
        if s.held:
            s.waiting_answer = audio
            return []
        return self._start_response(s, audio)

    def _start_response(self, s: _EchoSlot, audio: np.ndarray) -> list[EngineEvent]:
        resampler = PcmResampler(INPUT_RATE, OUTPUT_RATE)
        pcm = np.concatenate([resampler.process(audio), resampler.flush()])
        chunks = deque(pcm[i:i + OUTPUT_CHUNK] for i in range(0, len(pcm), OUTPUT_CHUNK))
        s.response = _Response(new_response_id(), s.epoch, chunks, replays=list(chunks),
                               replays_left=self.settings.answer_repeats - 1)
        events: list[EngineEvent] = [
            ResponseStarted(s.epoch, s.response.response_id),
            TurnState(s.epoch, "speaking", "end_of_utterance"),
        ]
        return events + self._speak(s, first=True)

    def _speak(self, s: _EchoSlot, first: bool) -> list[EngineEvent]:
        r = s.response
        if r is None:
            return []
        events: list[EngineEvent] = []
        for _ in range(self.settings.prebuffer_chunks if first else 1):
            if not r.chunks and r.replays_left and r.replays:
                r.replays_left -= 1
                r.chunks.extend(r.replays)
            if not r.chunks:
                break
            events.append(AudioChunk(r.epoch, r.response_id, r.seq, r.chunks.popleft()))
            r.seq += 1
        if not r.chunks and not (r.replays_left and r.replays) and not first:
            events.append(ResponseDone(r.epoch, r.response_id, "completed", "end_of_audio"))
            events.append(TurnState(s.epoch, "listening", "response_done"))
            s.response = None
        return events


class LoopbackBackend:
    """Returns each input window immediately as output audio, for latency measurement."""

    steps_inline = True  # a step is a copy: the scheduler runs it on the event loop (engine/scheduler.py)

    def __init__(self, settings: EchoSettings, max_sessions: int) -> None:
        self.capabilities = EngineCapabilities(
            name="loopback",
            input_rate=INPUT_RATE,
            output_rate=INPUT_RATE,
            window_samples=INPUT_RATE * settings.loopback_window_ms // 1000,
            max_sessions=max_sessions,
            barge_in=False,
            forced_listen=False,
            commit_hint=False,
            live_passthrough=True,
        )
        self._slots: dict[int, list] = {}

    def open_slot(self, slot: int, options: SessionOptions) -> None:
        self._slots[slot] = [0, None, 0]  # epoch, response id, seq

    def close_slot(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def apply_controls(self, slot: int, controls: Sequence[Control]) -> list[EngineEvent]:
        state = self._slots.get(slot)
        events: list[EngineEvent] = []
        if state is None:
            return events
        for c in controls:
            if c.kind is ControlKind.CANCEL:
                if state[1] is not None:
                    events.append(ResponseDone(c.epoch, state[1], "cancelled", "client_cancel"))
                state[:] = [max(state[0], c.epoch), None, 0]
        return events

    def step(self, windows: Sequence[SlotWindow]) -> list[list[EngineEvent]]:
        out = []
        for w in windows:
            state = self._slots.get(w.slot)
            if state is None:
                out.append([])
                continue
            events = self.apply_controls(w.slot, w.controls)
            if state[1] is None:
                state[1] = new_response_id()
                events += [ResponseStarted(state[0], state[1]), TurnState(state[0], "speaking", "loopback")]
            events.append(AudioChunk(state[0], state[1], state[2], w.window.copy()))
            state[2] += 1
            out.append(events)
        return out
