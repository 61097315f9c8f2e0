"""Streaming Token2Wav: hop / look-ahead / final rules, HiFT overlap, epoch fencing.

Rules (Step-Audio-2 / Lychee-FD, hop 10, look-ahead 3):

* A hop is synthesised when *more than* ``hop + lookahead`` (13) codes are pending, the rule of the
  Lychee-FD reference. The call carries 13; the encoder uses the last 3 only as look-ahead and
  returns mel for 10 (20 frames). The stream then advances by ``hop`` - the 3 look-ahead codes start
  the next call. Waiting for the 14th code is not a formality: the chunking changes the audio
  (chunk-causal DiT), and with exactly 13 pending at the end the reference renders all 13 in one
  final call, not a hop plus a 3-code final.
* HiFT re-vocodes the previous 8 mel frames with the new ones (excitation head overwritten by the
  cached one), cross-fades the first 3840 samples with the held tail (Hamming 7680), and holds
  the last 3840 samples back for the next cross-fade.
* Output per call: first hop 960*hop - 3840 samples (5760 = 240 ms), later hops 960*hop (9600),
  natural final ``3840 + 960*n`` for the n codes still pending (the encoder zero-pads the
  look-ahead). A final with nothing pending emits the held tail as is.
* Cancel drops everything, no tail.

Fencing: a stream belongs to one (epoch, response_id). Packets tagged otherwise are stale and
dropped; a sequence gap or an out-of-range code fails the response (``EngineError`` +
``ResponseDone(failed)``) without touching other streams. A shared per-slot ``EpochFence`` is
checked again before any PCM leaves, so work finishing after an interruption is discarded.

Several streams are synthesised together by ``synthesize_hops``: the flow runs one batch per
(code count, final) group with padded, masked caches; HiFT one batch per mel length. Every stream
owns its caches and noise generator; the only shared tensors (model weights, the CFM noise buffer,
a voice's primed prompt state) are never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from ...vocoder.token2wav.flow import FlowState
from ...vocoder.token2wav.model import MEL_CACHE_FRAMES, Token2Wav, Voice
from ..base import AudioChunk, EngineError, EngineEvent, ResponseDone

ERR_SEQUENCE_GAP = "vocoder_sequence_gap"
ERR_INVALID_CODE = "vocoder_invalid_code"
ERR_TOO_LONG = "vocoder_stream_too_long"
ERR_INTERNAL = "vocoder_failed"


@dataclass(frozen=True)
class StreamRules:
    hop: int = 10
    lookahead: int = 3
    # Conformer rel-pos table of the reference: |r| <= 4999 frames, i.e. prompt + generated codes
    # <= 2500. Past it the reference silently mis-indexes. "extend" computes the same sinusoid
    # for any distance (what the reference's offline path does); "error" fails the response.
    position_limit_tokens: int = 2500
    long_stream: Literal["extend", "error"] = "extend"

    def __post_init__(self):
        if self.hop < 4:  # below 4 codes the 8-frame HiFT overlap exceeds a hop
            raise ValueError("hop must be >= 4")
        if self.lookahead != 3:
            raise ValueError("look-ahead must equal the flow's pre_lookahead_len (3)")

    @property
    def tokens_per_call(self) -> int:
        """Codes one hop call carries (hop + look-ahead); a hop waits until more than this are pending."""
        return self.hop + self.lookahead


class EpochFence:
    """The session's epoch high-water mark as the vocoder sees it (one per engine slot)."""

    def __init__(self, epoch: int = 0):
        self.epoch = epoch

    def advance(self, epoch: int) -> None:
        self.epoch = max(self.epoch, epoch)

    def admits(self, epoch: int) -> bool:
        return epoch >= self.epoch


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """The reference's wire conversion: clip to [-1, 1], x32767, truncate toward zero."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")


@dataclass
class HiftCache:
    mel: torch.Tensor  # [1, 80, <=8]
    source: torch.Tensor  # [1, 1, <=3840]
    speech: torch.Tensor  # [1, <=3840]


@dataclass
class _Job:
    stream: "VocoderStream"
    tokens: list[int]
    last: bool
    advance: int
    mel: torch.Tensor | None = None
    flow_state: FlowState | None = None


@dataclass
class StreamStats:
    stale_dropped: int = 0
    duplicate_dropped: int = 0
    hops: int = 0
    samples: int = 0
    fenced_dropped: int = 0


class VocoderStream:
    """Token2Wav stream of one response: push codes, get 24 kHz float32 chunks."""

    def __init__(self, model: Token2Wav, voice: Voice, epoch: int, response_id: str,
                 rules: StreamRules = StreamRules(), fence: EpochFence | None = None,
                 seed: int | None = None, first_seq: int = 0):
        self.model = model
        self.voice = voice
        self.epoch = epoch
        self.response_id = response_id
        self.rules = rules
        self.fence = fence or EpochFence(epoch)
        self.state: Literal["open", "finishing", "finished", "cancelled", "failed"] = "open"
        self.stats = StreamStats()
        self._flow: FlowState | None = None
        self._hift = HiftCache(
            mel=torch.zeros(1, model.config.output_size, 0, device=model.device),
            source=torch.zeros(1, 1, 0, device=model.device),
            speech=torch.zeros(1, 0, device=model.device))
        self._pending: list[int] = []
        self._next_in_seq = first_seq
        self._next_out_seq = 0
        self._consumed_tokens = 0
        self._generator = torch.Generator(device=model.device)
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()
        self.noise_override = None  # tests: callable(n_samples_shape) -> noise tensor

    # -- input -----------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.state in ("open", "finishing")

    @property
    def pending(self) -> int:
        return len(self._pending)

    def feed(self, codes: Sequence[int], epoch: int, response_id: str, seq: int) -> list[EngineEvent]:
        """Validate and buffer one code packet; returns error events (if it failed the response)."""
        if epoch != self.epoch or response_id != self.response_id or not self.fence.admits(epoch):
            self.stats.stale_dropped += 1
            return []
        if self.state != "open":
            self.stats.stale_dropped += 1
            return []
        if seq < self._next_in_seq:
            self.stats.duplicate_dropped += 1
            return []
        if seq != self._next_in_seq:
            return self._fail(ERR_SEQUENCE_GAP, f"code packet seq {seq} received, expected {self._next_in_seq}")
        vocab = self.model.config.vocab_size
        for c in codes:
            if not isinstance(c, (int, np.integer)) or not 0 <= int(c) < vocab:
                return self._fail(ERR_INVALID_CODE, f"speech code {c!r} outside [0, {vocab})")
        self._next_in_seq = seq + 1
        self._pending.extend(int(c) for c in codes)
        return []

    def push(self, codes: Sequence[int], epoch: int, response_id: str, seq: int) -> list[EngineEvent]:
        events = self.feed(codes, epoch, response_id, seq)
        return events + synthesize_hops([self])[0]

    def finish(self) -> list[EngineEvent]:
        """Natural end of speech (``<tts_end>``): flush every pending code and the held tail."""
        if self.state != "open":
            return []
        self.state = "finishing"
        return synthesize_hops([self])[0]

    def cancel(self) -> None:
        """Interruption: drop caches and pending codes; nothing more is emitted."""
        if self.active:
            self.state = "cancelled"
        self._release()

    # -- internals -------------------------------------------------------------------------------

    def _release(self) -> None:
        self._pending = []
        self._flow = None
        self._hift = None  # type: ignore[assignment]

    def _fail(self, code: str, message: str) -> list[EngineEvent]:
        self.state = "failed"
        self._release()
        return [EngineError(self.epoch, code, message, self.response_id),
                ResponseDone(self.epoch, self.response_id, "failed", code)]

    def _next_job(self) -> _Job | None:
        # hops first, also when finishing: the final call only takes what is left after them
        if self.active and len(self._pending) > self.rules.tokens_per_call:
            return _Job(self, self._pending[: self.rules.tokens_per_call], False, self.rules.hop)
        if self.state == "finishing":
            return _Job(self, list(self._pending), True, len(self._pending))
        return None

    def _check_length(self, job: _Job) -> list[EngineEvent]:
        total = self.voice.features.n_tokens + self._consumed_tokens + len(job.tokens)
        if self.rules.long_stream == "error" and total > self.rules.position_limit_tokens:
            return self._fail(ERR_TOO_LONG, f"prompt + generated speech codes would reach {total}, "
                                            f"over the limit of {self.rules.position_limit_tokens}")
        return []

    def _hift_noise(self, mel_frames: int) -> torch.Tensor:
        if self.noise_override is not None:
            return self.noise_override(self.model.hift.noise_shape(1, mel_frames)).to(self.model.device)
        return self.model.hift.draw_noise(1, mel_frames, self._generator, self.model.device)

    def _emit(self, speech: torch.Tensor) -> list[EngineEvent]:
        if not self.fence.admits(self.epoch):
            self.stats.fenced_dropped += 1
            self.cancel()
            return []
        pcm = speech[0].float().cpu().numpy().astype(np.float32, copy=False)
        if pcm.size == 0:
            return []
        chunk = AudioChunk(self.epoch, self.response_id, self._next_out_seq, pcm)
        self._next_out_seq += 1
        self.stats.samples += pcm.size
        return [chunk]


def _run_flow(model: Token2Wav, jobs: list[_Job]) -> None:
    """Batch flow calls over jobs with the same code count and final flag."""
    groups: dict[tuple[int, bool], list[_Job]] = {}
    for job in jobs:
        if job.tokens:
            groups.setdefault((len(job.tokens), job.last), []).append(job)
    for (_, last), group in groups.items():
        states = []
        for job in group:
            s = job.stream
            if s._flow is None:
                s._flow = model.prime(s.voice)
            states.append(s._flow)
        tokens = torch.tensor([j.tokens for j in group], dtype=torch.long, device=model.device)
        mel, new_states = model.flow.chunk(states, tokens, last)
        for i, job in enumerate(group):
            job.mel = mel[i:i + 1].float()
            job.flow_state = new_states[i]


def _run_hift(model: Token2Wav, jobs: list[_Job]) -> dict[int, torch.Tensor]:
    """HiFT with the 8-frame overlap, batched over jobs whose inputs have the same length."""
    out: dict[int, torch.Tensor] = {}
    groups: dict[tuple[int, int], list[_Job]] = {}
    for job in jobs:
        if job.mel is not None:
            groups.setdefault((job.stream._hift.mel.shape[2], job.mel.shape[2]), []).append(job)
    n = model.overlap_samples
    w = model.crossfade_window
    for group in groups.values():
        mel_in = torch.cat([torch.cat([j.stream._hift.mel, j.mel], dim=2) for j in group])
        source = torch.cat([j.stream._hift.source for j in group])
        noise = torch.cat([j.stream._hift_noise(mel_in.shape[2]) for j in group])
        speech, excitation = model.hift(mel_in, source, noise=noise)
        for i, job in enumerate(group):
            s = job.stream
            sp = speech[i:i + 1].clone()
            if s._hift.speech.shape[1] > 0:
                # float64 window, result stored back as float32 (as the reference)
                sp[:, :n] = sp[:, :n] * w[:n] + s._hift.speech[:, -n:] * w[n:]
            s._hift = HiftCache(mel=mel_in[i:i + 1, :, -MEL_CACHE_FRAMES:].clone(),
                                source=excitation[i:i + 1, :, -n:].clone(),
                                speech=sp[:, -n:].clone())
            out[id(job)] = sp if job.last else sp[:, :-n]
    return out


def synthesize_hops(streams: Sequence[VocoderStream]) -> list[list[EngineEvent]]:
    """Run every hop the given streams have ready, batching across streams.

    Returns the events of each stream, in order. A failure inside one batch fails the streams of
    that batch only.
    """
    events: list[list[EngineEvent]] = [[] for _ in streams]
    index = {id(s): i for i, s in enumerate(streams)}
    if not streams:
        return events
    model = streams[0].model
    while True:
        jobs = []
        for s in streams:
            job = s._next_job() if s.active else None
            if job is None:
                continue
            errs = s._check_length(job)
            if errs:
                events[index[id(s)]].extend(errs)
                continue
            jobs.append(job)
        if not jobs:
            return events
        try:
            with torch.inference_mode():
                _run_flow(model, jobs)
                audio = _run_hift(model, jobs)
        except Exception as exc:  # one bad batch must not take the engine down
            for job in jobs:
                events[index[id(job.stream)]].extend(job.stream._fail(ERR_INTERNAL, f"{type(exc).__name__}: {exc}"))
            continue
        for job in jobs:
            s = job.stream
            if not s.active:
                continue
            if job.flow_state is not None:
                s._flow = job.flow_state
            s._consumed_tokens += job.advance
            del s._pending[: job.advance]
            s.stats.hops += 1
            if job.last:
                # natural final: the remaining codes (if any) plus the held tail
                speech = audio.get(id(job), s._hift.speech)
                events[index[id(s)]].extend(s._emit(speech))
                s.state = "finished"
                s._release()
            else:
                events[index[id(s)]].extend(s._emit(audio[id(job)]))
