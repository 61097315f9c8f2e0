"""The ``lychee`` engine: Lychee-FD behind the ``StepBackend`` protocol.

``build_lychee_backend(options, max_sessions)`` is what ``engine/factory.py`` calls with the
profile's ``engine.lychee`` mapping. The backend owns the model, the tokenizer and a
:class:`~lychee_rtc.engine.lychee.runner.LycheeRunner`; the scheduler calls ``step`` on its worker
thread with every slot that has a window due.

Speech leaves as :class:`CodecTokens` (25 Hz S3 codes) unless a vocoder factory is attached: then
each slot gets its own streaming vocoder object (the seam below) and the codes become
:class:`AudioChunk` PCM at 24 kHz, flushed on natural end and dropped on cancel.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
import torch

from ..base import (
    AudioChunk,
    CodecTokens,
    Control,
    ControlKind,
    EngineCapabilities,
    EngineError,
    EngineEvent,
    ResponseDone,
    SessionOptions,
    SlotWindow,
    TurnState,
    WindowTiming,
)
from .audio import SAMPLE_RATE, WINDOW_SAMPLES
from .checkpoint import load_model, parse_dtype
from .context import ContextSettingsError
from .graphs import GRAPH_MODES
from .hub import HubReferenceError, resolve_folder
from .runner import LycheeRunner, RunnerSettings
from .slot import SlotResult
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

OUTPUT_RATE = 24000


class SettingsError(ValueError):
    """A profile value under ``engine.lychee`` is wrong; the message names the key."""


@dataclass(frozen=True)
class LycheeEngineSettings:
    """Profile keys under ``engine.lychee`` (see configs/lychee-c1.yaml)."""

    model_root: str = ""  # a folder, or hf://OWNER/NAME[@REVISION]/FOLDER in the Hugging Face cache
    dtype: str = "bf16"
    device: str = "auto"  # "auto": cuda if available, else cpu
    max_seq: int = 8192
    start_speak_factor: float = 1.2
    start_listen_factor: float = 1.2
    end_speak_factor: float = 1.0
    temperature: float = 0.7
    no_repeat_ngram: int = 4
    max_text_tokens: int = 128
    max_speech_tokens: int = 1000
    stoken_delay_num: int | None = None
    strict_codec_range: bool = False
    seed: int = 0
    # Rolling context (docs/lychee_fd.md, "Long conversations"): recent conversation kept by a
    # slide, positions dropped per slide (None: derived from max_seq; context_window 0: no
    # sliding, the conversation resets when full) and positions re-prefilled per window step by
    # all sessions together (None: derived from the slide geometry and session.max_sessions).
    context_window: int | None = None
    context_slide_step: int | None = None
    context_prefill_budget: int | None = None
    context_reserve_windows: int = 25
    # auto: the window step runs as captured CUDA graphs on a GPU, eagerly on a CPU; on: graphs
    # required (start-up fails without CUDA); off: eager everywhere (graphs.py).
    cuda_graphs: str = "auto"
    torch_threads: int | None = None  # CPU: 1 is fastest for the tiny model on a shared machine
    progress: bool = True
    # The Token2Wav vocoder (shape and checks in lychee_rtc/engine/lychee/token2wav_settings.py); absent or null:
    # no vocoder, speech leaves as codes.
    token2wav: dict | None = None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "LycheeEngineSettings":
        known = {f.name: f for f in fields(cls)}
        for key in options:
            if key not in known:
                raise SettingsError(f"engine.lychee.{key}: unknown setting (known: {', '.join(sorted(known))})")
        values = dict(options)
        if isinstance(values.get("cuda_graphs"), bool):  # YAML reads an unquoted on/off as a boolean
            values["cuda_graphs"] = "on" if values["cuda_graphs"] else "off"
        for key, value in values.items():
            f = known[key]
            want = str(f.type)
            ok = True
            if want.startswith("int"):
                ok = value is None and "None" in want or (isinstance(value, int) and not isinstance(value, bool))
            elif want.startswith("float"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                values[key] = float(value) if ok else value
            elif want.startswith("bool"):
                ok = isinstance(value, bool)
            elif want.startswith("str"):
                ok = isinstance(value, str)
            elif want.startswith("dict"):
                ok = value is None or isinstance(value, Mapping)
            if not ok:
                raise SettingsError(f"engine.lychee.{key}: expected {want}, got {value!r}")
        s = cls(**values)
        if not s.model_root:
            raise SettingsError("engine.lychee.model_root: required (folder with config.json)")
        try:  # a folder, or an hf:// reference found in the Hugging Face cache (hub.py)
            root = resolve_folder(s.model_root, "engine.lychee.model_root", "model")
        except HubReferenceError as exc:
            raise SettingsError(str(exc)) from None
        if not (root / "config.json").is_file():
            raise SettingsError(f"engine.lychee.model_root: {s.model_root} has no config.json")
        s = replace(s, model_root=str(root))
        try:
            parse_dtype(s.dtype)
        except ValueError as exc:
            raise SettingsError(f"engine.lychee.dtype: {exc}") from None
        if s.device not in ("auto", "cpu") and not s.device.startswith("cuda"):
            raise SettingsError(f"engine.lychee.device: expected auto, cpu or cuda[:N], got {s.device!r}")
        if s.cuda_graphs not in GRAPH_MODES:
            raise SettingsError(f"engine.lychee.cuda_graphs: expected one of {', '.join(GRAPH_MODES)}, "
                                f"got {s.cuda_graphs!r}")
        if s.cuda_graphs == "on" and s.device == "cpu":
            raise SettingsError("engine.lychee.cuda_graphs: on needs a CUDA device (device is cpu)")
        for key in ("max_text_tokens", "max_speech_tokens"):
            if getattr(s, key) <= 0:
                raise SettingsError(f"engine.lychee.{key}: must be > 0")
        if s.max_seq < 512:
            raise SettingsError("engine.lychee.max_seq: must be >= 512")
        if s.context_reserve_windows < 0 or s.context_reserve_windows * 10 > s.max_seq // 2:
            raise SettingsError("engine.lychee.context_reserve_windows: must be >= 0 and leave half the context")
        # Checked again against the system prefix's length once the tokenizer is loaded.
        for key in ("context_window", "context_slide_step"):
            value = getattr(s, key)
            if value is not None and (value < 0 or value % 10 or (value == 0 and key == "context_slide_step")):
                raise SettingsError(f"engine.lychee.{key}: must be a multiple of 10 positions (400 ms), got {value}")
        if s.context_prefill_budget is not None and s.context_prefill_budget < 10:
            raise SettingsError("engine.lychee.context_prefill_budget: must be at least 10 positions (a window) "
                                f"per window step, or null to derive it, got {s.context_prefill_budget}")
        if s.no_repeat_ngram < 0:
            raise SettingsError("engine.lychee.no_repeat_ngram: must be >= 0")
        if s.temperature < 0:
            raise SettingsError("engine.lychee.temperature: must be >= 0")
        if s.token2wav:
            from lychee_rtc.engine.lychee.token2wav_settings import Token2WavSettings, VocoderSettingsError

            try:  # fail at start-up, naming the key, before any model is loaded
                Token2WavSettings.from_mapping(s.token2wav, prefix="engine.lychee.token2wav")
            except VocoderSettingsError as exc:
                raise SettingsError(str(exc)) from None
        return s

    def runner_settings(self) -> RunnerSettings:
        return RunnerSettings(
            max_seq=self.max_seq, start_speak_factor=self.start_speak_factor,
            start_listen_factor=self.start_listen_factor, end_speak_factor=self.end_speak_factor,
            temperature=self.temperature, no_repeat_ngram=self.no_repeat_ngram,
            max_text_tokens=self.max_text_tokens, max_speech_tokens=self.max_speech_tokens,
            stoken_delay_num=self.stoken_delay_num, strict_codec_range=self.strict_codec_range,
            seed=self.seed, context_window=self.context_window, context_slide_step=self.context_slide_step,
            context_prefill_budget=self.context_prefill_budget,
            context_reserve_windows=self.context_reserve_windows, cuda_graphs=self.cuda_graphs,
        )

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


class SlotVocoder(Protocol):
    """The seam for a streaming Token2Wav: one object per slot, fed codes, giving 24 kHz PCM."""

    def push(self, response_id: str, codes: Sequence[int], final: bool) -> list[np.ndarray]:
        """Add codes of ``response_id``; return the float32 PCM chunks now ready (all if final)."""

    def cancel(self) -> None:
        """Drop the current stream at once (barge-in / client cancel); nothing more may come out."""

    # Optional, used when present: ``update(options)`` (session.update: voice for the next
    # response) and ``take_errors() -> list[EngineError]`` (failures the PCM seam cannot carry).
    # A factory may offer ``voice_names`` (-> capabilities.voices) and
    # ``push_many([(vocoder, response_id, codes, final), ...])`` to vocode every slot of a step
    # as one batch.


VocoderFactory = Callable[[int, SessionOptions], SlotVocoder]


class LycheeBackend:
    def __init__(self, settings: LycheeEngineSettings, max_sessions: int, *,
                 vocoder_factory: VocoderFactory | None = None) -> None:
        if settings.torch_threads is not None:
            torch.set_num_threads(settings.torch_threads)
        device = settings.resolved_device()
        t0 = time.monotonic()
        self.model = load_model(settings.model_root, dtype=settings.dtype, device=device, progress=settings.progress)
        self.tokenizer = Tokenizer.from_dir(settings.model_root)
        try:
            self.runner = LycheeRunner(self.model, self.tokenizer, max_sessions, settings.runner_settings())
        except ContextSettingsError as exc:  # names its key; it depends on the tokenizer's prefix length
            raise SettingsError(f"engine.lychee.{exc}") from None
        except ValueError as exc:  # e.g. cuda_graphs: on where torch sees no CUDA device
            raise SettingsError(f"engine.lychee: {exc}") from None
        log.info("lychee engine ready in %.1fs: %s on %s, %d slots, %d positions each, %s",
                 time.monotonic() - t0, settings.dtype, device, max_sessions, settings.max_seq,
                 "CUDA graphs" if self.runner.graphs_captured else "eager")
        self.settings = settings
        self.vocoder_factory = vocoder_factory
        self.vocoders: dict[int, SlotVocoder] = {}
        self._audio_seq: dict[int, int] = {}
        self.capabilities = EngineCapabilities(
            name="lychee",
            input_rate=SAMPLE_RATE,
            output_rate=OUTPUT_RATE,
            window_samples=WINDOW_SAMPLES,
            max_sessions=max_sessions,
            barge_in=True,
            client_cancel=True,
            forced_listen=True,
            commit_hint=True,
            text_output=True,
            instructions=True,
            audio_output="pcm" if vocoder_factory is not None else "codes",
            voices=tuple(getattr(vocoder_factory, "voice_names", ()) or ()),
            context=self.runner.context_policy(),
        )

    # -- StepBackend --------------------------------------------------------------------------

    def open_slot(self, slot: int, options: SessionOptions) -> None:
        self.runner.open(slot, options)
        if self.vocoder_factory is not None:
            self.vocoders[slot] = self.vocoder_factory(slot, options)

    def close_slot(self, slot: int) -> None:
        voc = self.vocoders.pop(slot, None)
        if voc is not None:
            voc.cancel()
        self._audio_seq.pop(slot, None)
        self.runner.close(slot)

    def apply_controls(self, slot: int, controls: Sequence[Control]) -> list[EngineEvent]:
        # The runner first: a CANCEL must take effect even if a vocoder update below fails.
        events = self.runner.apply_controls(slot, controls)
        voc = self.vocoders.get(slot)
        if voc is not None:
            for c in controls:
                try:
                    if c.kind is ControlKind.CANCEL or c.kind is ControlKind.FORCE_LISTEN:
                        voc.cancel()
                    elif c.kind is ControlKind.UPDATE and c.options is not None and hasattr(voc, "update"):
                        voc.update(c.options)
                except Exception as exc:  # one slot's bad voice must not stop the engine
                    log.warning("slot %d: vocoder control %s failed: %s", slot, c.kind.value, exc)
                    events.append(EngineError(c.epoch, "vocoder_control_failed",
                                              f"{c.kind.value} could not be applied to the vocoder: {exc}"))
        return events

    def step(self, windows: Sequence[SlotWindow]) -> list[list[EngineEvent]]:
        pre: list[list[EngineEvent]] = []
        for w in windows:
            pre.append(self.apply_controls(w.slot, w.controls) if w.controls else [])
        # A slot closed while its window waited has nothing to step (the scheduler filters these
        # too); skipping it here keeps the other slots' windows.
        live = [i for i, w in enumerate(windows) if self.runner.slots[w.slot] is not None]
        if len(live) < len(windows):
            results_live = self.step([SlotWindow(w.slot, w.window, w.window_seq, w.epoch) for w in
                                      (windows[i] for i in live)]) if live else []
            merged: list[list[EngineEvent]] = [[] for _ in windows]
            for i, events in zip(live, results_live):
                merged[i] = events
            return [p + m for p, m in zip(pre, merged)]
        results = self.runner.step([(w.slot, w.window, w.epoch) for w in windows])
        vocoded = self._vocode([w.slot for w in windows], results)
        return [events + out for events, out in zip(pre, vocoded)]

    # -- vocoder seam ---------------------------------------------------------------------------

    def _next_audio_seq(self, slot: int) -> int:
        self._audio_seq[slot] = self._audio_seq.get(slot, -1) + 1
        return self._audio_seq[slot]

    def _vocode(self, slots: list[int], results: list[SlotResult]) -> list[list[EngineEvent]]:
        """Turn each slot's codes into PCM, all slots of the step in one batch when the factory
        can (``push_many``). Codes of a response that was cancelled in this window are dropped,
        never vocoded; a natural end flushes the held tail before ``ResponseDone``."""
        jobs: list[tuple[int, SlotVocoder, str, tuple[int, ...], bool]] = []
        for i, (slot, res) in enumerate(zip(slots, results)):
            voc = self.vocoders.get(slot)
            if voc is None:
                continue
            if res.cancelled:
                voc.cancel()
                continue
            codes = next((e.codes for e in res.events if isinstance(e, CodecTokens)), ())
            if res.response_id is not None and (codes or res.finished):
                jobs.append((i, voc, res.response_id, tuple(codes), res.finished))
        t0 = time.monotonic()
        failed: dict[int, str] = {}
        pcm = self._push_jobs(jobs, failed)
        vocoder_ms = (time.monotonic() - t0) * 1000.0
        audio = {i: chunks for (i, *_), chunks in zip(jobs, pcm)}

        out: list[list[EngineEvent]] = []
        for i, (slot, res) in enumerate(zip(slots, results)):
            voc = self.vocoders.get(slot)
            if voc is None:
                out.append(res.events)
                continue
            chunks = audio.get(i, [])
            events: list[EngineEvent] = []
            placed = False
            for ev in res.events:
                if isinstance(ev, CodecTokens) or (isinstance(ev, ResponseDone) and not placed):
                    if not placed and res.response_id is not None and not res.cancelled:
                        epoch = ev.epoch
                        events += [AudioChunk(epoch, res.response_id, self._next_audio_seq(slot), c) for c in chunks]
                        placed = True
                    if isinstance(ev, CodecTokens):
                        continue
                events.append(ev)
            take_errors = getattr(voc, "take_errors", None)
            errors = take_errors() if take_errors is not None else []
            if i in failed:
                errors.append(EngineError(-1, "vocoder_failed", failed[i], res.response_id))
            if errors and res.response_id is not None and not res.cancelled:
                events += self._fail_response(slot, res, errors)
            else:
                events += errors
            events.append(WindowTiming(window_seq=-1, queue_wait_ms=0.0, step_ms=0.0, vocoder_ms=vocoder_ms))
            out.append(events)
        return out

    def _push_jobs(self, jobs, failed: dict[int, str]) -> list[list]:
        """Vocode the step's jobs, batched; if the batch fails, each job alone, so one slot's failure
        is that slot's alone."""
        push_many = getattr(self.vocoder_factory, "push_many", None)
        if jobs and push_many is not None:
            try:
                return push_many([(v, r, c, f) for _, v, r, c, f in jobs])
            except Exception:
                log.exception("batched vocoding failed; retrying slot by slot")
        pcm = []
        for i, voc, rid, codes, final in jobs:
            try:
                pcm.append(voc.push(rid, codes, final))
            except Exception as exc:
                log.warning("vocoding failed for %s: %s", rid, exc)
                failed[i] = f"the vocoder failed on this response: {exc}"
                pcm.append([])
        return pcm

    def _fail_response(self, slot: int, res: SlotResult, errors: list[EngineEvent]) -> list[EngineEvent]:
        """A response whose audio cannot be made ends now, as failed, under its own epoch."""
        state = self.runner.slots[slot]
        epoch = state.epoch if state is not None else 0
        events: list[EngineEvent] = [EngineError(epoch, e.code, e.message, e.response_id)
                                     if isinstance(e, EngineError) else e for e in errors]
        voc = self.vocoders.get(slot)
        if voc is not None:
            voc.cancel()
        if state is not None and state.response_id == res.response_id:
            self.runner.stop_response(slot)
            events.append(TurnState(epoch, "listening", "vocoder_failed"))
        if not any(isinstance(e, ResponseDone) for e in res.events):
            events.append(ResponseDone(epoch, res.response_id, "failed", "vocoder_failed"))
        return events


def build_lychee_backend(options: Mapping[str, Any], max_sessions: int, *,
                         vocoder_factory: VocoderFactory | None = None) -> LycheeBackend:
    """Entry point for engine/factory.py: validate ``engine.lychee`` and load the model.

    With a ``token2wav`` section and no explicit ``vocoder_factory``, the Token2Wav pool is built
    here, so the factory needs nothing vocoder-specific.
    """
    settings = LycheeEngineSettings.from_mapping(options)
    if vocoder_factory is None and settings.token2wav:
        from lychee_rtc.engine.lychee.token2wav_settings import build_token2wav_pool

        vocoder_factory = build_token2wav_pool(settings.token2wav)
    return LycheeBackend(settings, max_sessions, vocoder_factory=vocoder_factory)
