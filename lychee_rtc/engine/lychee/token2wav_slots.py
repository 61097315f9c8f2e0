"""Token2Wav behind the lychee backend's per-slot vocoder seam.

``Token2WavPool`` is created once per engine (model + voices) and is the ``vocoder_factory`` the
lychee backend takes: ``pool(slot, options)`` returns a ``SlotTokenVocoder`` for that slot, which
implements the backend's ``SlotVocoder`` protocol (``push(response_id, codes, final)`` ->
float32 PCM chunks, ``cancel()``).

The seam carries no epoch or packet numbers, so the adapter supplies them: every response gets its
own ``VocoderStream`` with consecutive packet numbers, and ``cancel()`` advances the slot's private
epoch fence, so a hop computed for a cancelled response can never come out. Voices are chosen per
session (``SessionOptions.voice``) and may change with ``update`` (``session.update``); a change
applies from the next response.

``push_many`` runs the ready hops of several slots as one batch (``synthesize_hops``).
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from ...vocoder.token2wav.model import Token2Wav
from ...vocoder.token2wav.voices import VoiceBank
from ..base import AudioChunk, EngineError, EngineEvent, SessionOptions
from .token2wav_stream import EpochFence, StreamRules, VocoderStream, synthesize_hops

log = logging.getLogger(__name__)


class SlotTokenVocoder:
    def __init__(self, pool: "Token2WavPool", slot: int, options: SessionOptions):
        self.pool = pool
        self.slot = slot
        self.voice_name = pool.voices.resolve(options.voice)
        self.seed = options.seed
        # Prepared now, not on the first hop, and held by the slot: the shared bank's bound can
        # evict it without any response start having to prepare it again on the engine thread.
        self._voice = pool.voices.get(self.voice_name)
        self._fence = EpochFence(0)
        self._epoch = 0
        self._stream: VocoderStream | None = None
        self._packet = 0
        self._ended: deque[str] = deque(maxlen=16)  # responses that may not start again
        self.errors: list[EngineError] = []

    # -- the backend's SlotVocoder protocol ------------------------------------------------------

    def push(self, response_id: str, codes: Sequence[int], final: bool) -> list[np.ndarray]:
        stream = self._prepare(response_id, codes, final)
        if stream is None:
            return []
        return self._collect(synthesize_hops([stream])[0])

    def cancel(self) -> None:
        self._epoch += 1
        self._fence.advance(self._epoch)
        if self._stream is not None:
            self._stream.cancel()
            self._ended.append(self._stream.response_id)
        self._stream = None

    # -- extras ----------------------------------------------------------------------------------

    def update(self, options: SessionOptions) -> None:
        """``session.update``: a new voice applies from the next response."""
        if options.voice:
            name = self.pool.voices.resolve(options.voice)
            if name != self.voice_name:
                self._voice = self.pool.voices.get(name)  # may raise; the backend reports it
                self.voice_name = name
        if options.seed is not None:
            self.seed = options.seed

    def take_errors(self) -> list[EngineError]:
        errors, self.errors = self.errors, []
        return errors

    def close(self) -> None:
        self.cancel()

    # -- internals -------------------------------------------------------------------------------

    def _prepare(self, response_id: str, codes: Sequence[int], final: bool) -> VocoderStream | None:
        if response_id in self._ended:
            return None  # late codes of a cancelled, finished or failed response
        s = self._stream
        if s is not None and not s.active:
            self._ended.append(s.response_id)
            if s.response_id == response_id:
                return None
            s = None
        if s is None or s.response_id != response_id:
            if s is not None:  # a new response without a cancel: the old one is over
                s.cancel()
                self._ended.append(s.response_id)
            voice = self._voice
            # stable across processes (str hashes are salted), distinct per response
            seed = None if self.seed is None else zlib.crc32(f"{self.seed}:{response_id}".encode())
            s = VocoderStream(self.pool.model, voice, self._epoch, response_id, rules=self.pool.rules,
                              fence=self._fence, seed=seed)
            self._stream = s
            self._packet = 0
        if codes:
            errors = s.feed(list(codes), self._epoch, response_id, self._packet)
            self._packet += 1
            self._record(errors)
        if final and s.state == "open":
            s.state = "finishing"
        return s

    def _record(self, events: list[EngineEvent]) -> None:
        for e in events:
            if isinstance(e, EngineError):
                log.warning("slot %d vocoder: %s: %s", self.slot, e.code, e.message)
                self.errors.append(e)

    def _collect(self, events: list[EngineEvent]) -> list[np.ndarray]:
        self._record(events)
        return [e.pcm for e in events if isinstance(e, AudioChunk)]


class Token2WavPool:
    """One Token2Wav model and voice bank shared by all slots of an engine (read-only sharing)."""

    def __init__(self, model: Token2Wav, voices: VoiceBank, rules: StreamRules = StreamRules()):
        self.model = model
        self.voices = voices
        self.rules = rules

    @classmethod
    def load(cls, folder: str | Path, voices: Mapping[str, str | Path], default_voice: str | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
             max_cached_voices: int = 4, hop: int = 10, long_stream: str = "extend",
             cuda_graphs: str = "auto") -> "Token2WavPool":
        if isinstance(dtype, str):
            dtype = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
                     "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}[dtype]
        model = Token2Wav.load(folder, device=device, dtype=dtype, cuda_graphs=cuda_graphs)
        bank = VoiceBank(model, voices, default_voice, max_cached=max_cached_voices)
        return cls(model, bank, StreamRules(hop=hop, long_stream=long_stream))  # type: ignore[arg-type]

    @property
    def voice_names(self) -> tuple[str, ...]:
        return self.voices.names

    def __call__(self, slot: int, options: SessionOptions) -> SlotTokenVocoder:
        return SlotTokenVocoder(self, slot, options)

    def push_many(self, requests: Sequence[tuple[SlotTokenVocoder, str, Sequence[int], bool]]) -> list[list[np.ndarray]]:
        """Batched form of ``push`` for several slots: [(vocoder, response_id, codes, final)]."""
        streams = [v._prepare(r, c, f) for v, r, c, f in requests]
        live = [s for s in streams if s is not None]
        results = dict(zip((id(s) for s in live), synthesize_hops(live)))
        return [[] if s is None else v._collect(results[id(s)]) for (v, *_), s in zip(requests, streams)]
