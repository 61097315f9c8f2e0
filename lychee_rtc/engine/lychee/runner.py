"""The real-time Lychee-FD runner: per-slot state, one batched step per 400 ms window.

Position grid (post-prefix index p, 40 ms each; window k owns positions 10k..10k+9): the tokens of
a position are decided one position ahead, so when window k's audio arrives the tokens of 10k-1
(slot 9 of the previous window) are known but not yet fed. A step therefore feeds positions
10k-1..10k+8 (0..8 for the very first window, whose position 0 is the initial
TextPad/StokenPad/Sleep) and decides 10k..10k+9:

* listening slot: one forward over its 10 positions with forced TextPad/StokenPad and
  Sleep x8, Detect; the decision for 10k+9 (K-L or S-S) comes from the last position's control
  logits. Only two lm_head rows are evaluated.
* speaking slot: 10 decode steps, each ``speak_step``: main stack -> text sampled -> merge with
  E[sampled text] -> speech sampled; control forced Sleep/Detect, decided (K-S or S-L) at slot 9.

All speaking slots of a step run the 10 decode steps in lockstep as one batch; all listening slots
share one forward. Inside a window nothing is copied to the host: the tokens come back in one
transfer at the end, where the per-slot state machine (responses, barge-in, natural end) runs.

State of a slot lives in :class:`SlotState` (host) and in rows of a few device buffers indexed by
slot (KV caches, speech history for the 4-gram rule, rule counters); closing a slot resets both.

Static shapes (``graphs.py``): each group's batch is padded to a bucket (1, 2, 4, 8, ...) and its
inputs are copied into that bucket's fixed buffers; the listening forward and the speaking window
(all ten decode steps) are functions of those buffers, replayed as CUDA graphs on a GPU and called
eagerly elsewhere. Every group of a step is launched first; the results of all of them come back
to the host in one transfer at the end of the step.
"""

from __future__ import annotations

import enum
import logging
import secrets
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ..base import (
    BargeIn,
    CodecTokens,
    Control,
    ControlKind,
    EngineError,
    EngineEvent,
    ResponseDone,
    ResponseStarted,
    SessionOptions,
    TextDelta,
    TurnState,
)
from .audio import encode_windows, mel_filterbank
from .config import LycheeConfig, SpecialTokens
from .graphs import BatchRows, StaticProgram, batch_rows, bucket_for, bucket_sizes, fetch, use_cuda_graphs
from .model import LycheeFD
from .sampling import (
    SpeechRuleState,
    TextRuleState,
    control_decision,
    sample_speech,
    sample_text,
)
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

CHUNK = 10  # positions per 400 ms window (validated in config)
DEFAULT_INSTRUCTIONS = "You are a helpful assistant."
SYSTEM_TEMPLATE = "<|BOT|>system\n{instructions}<|EOT|>"  # the reference's fixed prefix for the default


@dataclass(frozen=True)
class RunnerSettings:
    """Sampling knobs and limits (reference defaults; profile keys of the same names)."""

    max_seq: int = 8192  # KV positions per session, system prefix included
    start_speak_factor: float = 1.2
    start_listen_factor: float = 1.2
    end_speak_factor: float = 1.0
    temperature: float = 0.7  # speech channel; <= 0 means greedy
    no_repeat_ngram: int = 4
    max_text_tokens: int = 128
    max_speech_tokens: int = 1000
    stoken_delay_num: int | None = None  # None: config.json's value
    strict_codec_range: bool = False  # sample only codes the vocoder accepts (< codec vocab size)
    seed: int = 0
    # Listening with fewer than this many windows of context left resets the conversation.
    context_reserve_windows: int = 25
    cuda_graphs: str = "auto"  # auto: captured on CUDA, eager elsewhere; on: CUDA required; off: eager


class Mode(enum.Enum):
    LISTENING = "listening"
    SPEAKING = "speaking"


@dataclass
class SlotState:
    index: int
    epoch: int = 0
    mode: Mode = Mode.LISTENING
    # Decided tokens of every post-prefix position so far; positions < ``fed`` are in the caches.
    text: list[int] = field(default_factory=list)
    stoken: list[int] = field(default_factory=list)
    control: list[int] = field(default_factory=list)
    prefix_ids: list[int] = field(default_factory=list)  # system prefix, prefilled at positions 0..P-1
    instructions: str | None = None  # what prefix_ids (or pending_prefix_ids) were made from
    pending_prefix_ids: list[int] | None = None  # new instructions waiting for the next context reset
    fed: int = 0
    window: int = 0  # index k of the next window (it decides positions up to 10k+9)
    force_listen: bool = False
    commit: bool = False
    forced_decision: int | None = None
    response_id: str | None = None
    seq: int = 0
    detok: IncrementalDetokenizer | None = None
    temperature: float = 0.7
    generator: torch.Generator | None = None
    seed: int | None = None  # the client's seed, when it chose one
    codes_dropped: int = 0
    context_resets: int = 0

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)


@dataclass
class ListenBuffers:
    """Fixed inputs of one listening program (bucket b, T positions per row)."""

    tokens: Tensor  # (b, 3, T) text, stoken, control fed at each position
    audio: Tensor  # (b, T, H) audio channel
    audio_idx: Tensor  # (b, T) row of the step's flattened encoder features, -1: <|AudioPad|>
    pos: Tensor  # (b, T) absolute positions
    rows: Tensor  # (b,) cache rows


@dataclass
class SpeakBuffers:
    """Fixed inputs of one speaking program (bucket b, ten decode steps)."""

    pending: Tensor  # (b, 3) the decided, not yet fed tokens of position 10k-1
    audio: Tensor  # (b, 10, H)
    audio_idx: Tensor  # (b, 10)
    base_pos: Tensor  # (b, 1) absolute position of the first fed token
    hist_len: Tensor  # (b,) speech channel length before the window
    rows: Tensor  # (b,)
    temperature: Tensor  # (b,) float32, <= 0: greedy
    noise: Tensor  # (b, 10, R) uniform draws of each row's own generator


@dataclass
class Program:
    kind: str  # "listen" | "speak"
    rows: BatchRows
    buffers: ListenBuffers | SpeakBuffers
    run: StaticProgram


@dataclass
class SlotResult:
    events: list[EngineEvent]
    codes: list[int]  # codec ids decided this window (for a vocoder)
    response_id: str | None
    finished: bool  # natural end: flush the vocoder
    cancelled: bool  # stop at once: drop the vocoder stream


class LycheeRunner:
    def __init__(self, model: LycheeFD, tokenizer: Tokenizer, max_sessions: int, settings: RunnerSettings):
        self.model = model
        self.tokenizer = tokenizer
        self.cfg: LycheeConfig = model.cfg
        self.settings = settings
        self.tok: SpecialTokens = self.cfg.resolve_tokens(tokenizer)
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.max_sessions = max_sessions
        # The default system prefix (the reference's, fixed); a session may bring its own
        # instructions (vLLM-Omni's template), capped so that most of the context stays for audio.
        self.prefix_ids = self.system_prefix(None)
        self.prefix_len = len(self.prefix_ids)
        self.max_prefix = max(self.prefix_len, settings.max_seq // 4)
        if settings.max_seq < self.prefix_len + 4 * CHUNK:
            raise ValueError(f"max_seq {settings.max_seq} leaves no room after the {self.prefix_len}-token prefix")
        self.max_post = settings.max_seq - self.prefix_len
        # One row per slot plus a scratch row that padding rows of a bucket may write (graphs.py).
        self.scratch = max_sessions
        self.buckets = bucket_sizes(max_sessions)
        model.setup_caches(max_sessions + 1, settings.max_seq)
        self.filters = mel_filterbank(device=self.device)
        t = self.tok
        delay = self.cfg.stoken_delay_num if settings.stoken_delay_num is None else settings.stoken_delay_num
        self.speech_prefix = torch.tensor([t.stoken_delay] * delay + [t.tts_start], device=self.device)
        self.speech_slice = slice(self.cfg.stoken_token_ids_min, self.cfg.stoken_token_ids_max)
        self.code_lo = t.audio_code_min
        self.code_hi = (t.audio_code_min + self.cfg.stoken_codec_vocab_size if settings.strict_codec_range
                        else self.cfg.stoken_token_ids_max)
        self.listen_rows = torch.tensor([t.start_speaking, t.keep_listening], device=self.device)
        self.speak_rows = torch.tensor([t.start_listening, t.keep_speaking], device=self.device)
        # Device rows indexed by slot: the speech channel (for the 4-gram rule) and rule counters.
        rows = max_sessions + 1
        self.speech_history = torch.full((rows, settings.max_seq), t.stoken_pad, dtype=torch.long, device=self.device)
        z = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.text_rule = TextRuleState(z.clone(), z.clone().bool())
        self.speech_rule = SpeechRuleState(z.clone(), z.clone(), z.clone().bool())
        self.slots: list[SlotState | None] = [None] * max_sessions
        self._rid_prefix = "resp_"
        self.programs: dict[tuple[str, int, int, bool], Program] = {}
        # Graphs are captured here, before any slot opens: a capture's warm-up writes the caches.
        self.graphs_captured = use_cuda_graphs(settings.cuda_graphs, self.device)
        self.use_graphs = self.graphs_captured  # False replays nothing (eager), e.g. to compare
        if self.graphs_captured:
            self.capture_graphs()

    def system_prefix(self, instructions: str | None) -> list[int]:
        text = SYSTEM_TEMPLATE.format(instructions=instructions or DEFAULT_INSTRUCTIONS)
        return self.tokenizer.encode(text)

    # ------------------------------------------------------------------------------------------
    # slot lifecycle

    def open(self, slot: int, options: SessionOptions) -> None:
        state = SlotState(index=slot)
        state.prefix_ids = self._prefix_for(slot, options.instructions)
        state.instructions = options.instructions
        state.temperature = self.settings.temperature if options.temperature is None else options.temperature
        seed = options.seed if options.seed is not None else self.settings.seed * 1000003 + slot
        state.generator = torch.Generator(device=self.device).manual_seed(int(seed))
        state.seed = options.seed
        self.slots[slot] = state
        self._start_context(state)

    def _prefix_for(self, slot: int, instructions: str | None) -> list[int]:
        if not instructions:
            return list(self.prefix_ids)
        # Text averages about 4 characters per token, so 8 per prefix token is more than can fit:
        # cut the text first so tokenizing stays cheap on the engine thread, then the tokens.
        ids = self.system_prefix(instructions[: 8 * self.max_prefix])
        if len(ids) > self.max_prefix:
            log.warning("slot %d: instructions of %d tokens cut to %d", slot, len(ids), self.max_prefix)
            ids = ids[: self.max_prefix - 1] + ids[-1:]  # keep the closing <|EOT|>
        return ids

    def close(self, slot: int) -> None:
        self._clear_rows(slot)
        self.slots[slot] = None

    def _clear_rows(self, slot: int) -> None:
        self.model.reset_rows([slot])
        self.speech_history[slot] = self.tok.stoken_pad
        for t in (self.text_rule.count, self.text_rule.has_eos, self.speech_rule.prefix_count,
                  self.speech_rule.count, self.speech_rule.has_eos):
            t[slot] = 0

    @torch.no_grad()
    def _start_context(self, state: SlotState) -> None:
        """Fresh conversation in this slot: prefill the system prefix, decide position 0."""
        self._clear_rows(state.index)
        if state.pending_prefix_ids is not None:
            state.prefix_ids, state.pending_prefix_ids = state.pending_prefix_ids, None
        t = self.tok
        state.text, state.stoken, state.control = [t.text_pad], [t.stoken_pad], [t.sleep]
        state.fed = 0
        state.window = 0
        state.mode = Mode.LISTENING
        state.forced_decision = None
        ids = state.prefix_ids
        prefix = torch.tensor([ids], device=self.device)
        rows = torch.tensor([state.index], device=self.device)
        pos = torch.arange(len(ids), device=self.device)[None]
        # Merge at the last prefix position sees the first post-prefix text token, <|TextPad|>.
        nxt = torch.tensor([ids[1:] + [t.text_pad]], device=self.device)
        e = self.model.embed_tokens
        self.model.forward_positions(e(prefix), e(nxt), self.model.context(pos, rows))

    # ------------------------------------------------------------------------------------------
    # controls

    def apply_controls(self, slot: int, controls: Sequence[Control]) -> list[EngineEvent]:
        state = self.slots[slot]
        if state is None:
            return []
        events: list[EngineEvent] = []
        for c in controls:
            if c.kind is ControlKind.CANCEL:
                state.epoch = max(state.epoch, c.epoch)
                if state.mode is Mode.SPEAKING:
                    self._stop_speaking(state)
                    events.append(TurnState(state.epoch, "listening", "cancelled"))
            elif c.kind is ControlKind.FORCE_LISTEN:
                state.force_listen, state.commit = True, False
                if state.mode is Mode.SPEAKING:  # the session cancels first; be safe if it did not
                    self._stop_speaking(state)
                    events.append(TurnState(state.epoch, "listening", "turn.listen"))
            elif c.kind is ControlKind.RELEASE_LISTEN:
                state.force_listen = False
            elif c.kind is ControlKind.COMMIT:
                # "Answer now" means something only while listening; kept while speaking, it would
                # make the model start again right after the user cancelled it.
                state.commit = state.mode is Mode.LISTENING and not state.force_listen
            elif c.kind is ControlKind.RESTART and c.options is not None:
                # The session fenced the old conversation with a CANCEL epoch before this.
                if state.mode is Mode.SPEAKING:
                    self._stop_speaking(state)
                state.instructions = c.options.instructions
                state.prefix_ids = self._prefix_for(slot, c.options.instructions)
                state.pending_prefix_ids = None
                state.commit = False
                self._start_context(state)
            elif c.kind is ControlKind.UPDATE and c.options is not None:
                if c.options.instructions != state.instructions:
                    # The prefix sits at the start of the context: it can only change at a reset.
                    state.instructions = c.options.instructions
                    state.pending_prefix_ids = self._prefix_for(slot, c.options.instructions)
                if c.options.temperature is not None:
                    state.temperature = c.options.temperature
                # The session sends all its options with every update: re-seed only on a new seed,
                # or a voice change would restart the random stream.
                if c.options.seed is not None and c.options.seed != state.seed and state.generator is not None:
                    state.generator.manual_seed(int(c.options.seed))
                    state.seed = c.options.seed
        return events

    def stop_response(self, slot: int) -> None:
        """End the slot's response at this window boundary (its audio could not be made)."""
        state = self.slots[slot]
        if state is not None and state.mode is Mode.SPEAKING:
            self._stop_speaking(state)

    def _stop_speaking(self, state: SlotState) -> None:
        """Leave speaking at a window boundary: the pending slot-9 position becomes a plain S-L
        decision with padded text/speech, as the reference's S->L tail fallback does."""
        t = self.tok
        last = len(state.text) - 1
        state.text[last], state.stoken[last], state.control[last] = t.text_pad, t.stoken_pad, t.start_listening
        self.speech_history[state.index, last] = t.stoken_pad
        state.mode = Mode.LISTENING
        state.response_id = None
        state.detok = None
        state.forced_decision = None
        state.commit = False

    # ------------------------------------------------------------------------------------------
    # the step

    @torch.no_grad()
    def step(self, items: Sequence[tuple[int, np.ndarray, int]]) -> list[SlotResult]:
        """One batched step over (slot, 6400-sample window, epoch) items; results in order."""
        results: list[SlotResult] = []
        states: list[SlotState] = []
        for slot, _, epoch in items:
            state = self.slots[slot]
            if state is None:
                raise KeyError(f"slot {slot} is not open")
            res = SlotResult([], [], state.response_id, False, False)
            if epoch > state.epoch:
                # The session moved on without our seeing its CANCEL: the response in flight
                # belongs to the old epoch and must not continue under the new one.
                if state.mode is Mode.SPEAKING:
                    self._stop_speaking(state)
                    res.cancelled = True
                    res.events.append(TurnState(epoch, "listening", "cancelled"))
                state.epoch = epoch
            self._context_policy(state, res)
            results.append(res)
            states.append(state)
        windows = torch.from_numpy(np.stack([np.asarray(w, dtype=np.float32) for _, w, _ in items])).to(self.device)
        feats = encode_windows(self.model.encoder, self.model.adapter, self.filters, windows)
        feats = feats.reshape(-1, feats.shape[-1])  # row 5i+j: feature j of item i

        listen = [i for i, s in enumerate(states) if s.mode is Mode.LISTENING]
        speak = [i for i, s in enumerate(states) if s.mode is Mode.SPEAKING]
        # Launch every group, then one transfer for all of them: no host sync inside the window.
        launched: list[tuple[str, list[int]]] = []
        outs: list[Tensor] = []
        for group in self._by_length(states, listen):
            launched.append(("listen", group))
            outs += self._run(self._launch_listen(group, states), feats, len(group))
        if speak:
            launched.append(("speak", speak))
            outs += self._run(self._launch_speak(speak, states), feats, len(speak))
        host = fetch(outs)
        for n, (kind, group) in enumerate(launched):
            first, probs = host[2 * n], host[2 * n + 1]
            if kind == "listen":
                self._finish_listen(group, states, results, first, probs)
            else:
                self._finish_speak(group, states, results, first, probs)
        return results

    def _by_length(self, states: list[SlotState], idx: list[int]) -> list[list[int]]:
        groups: dict[int, list[int]] = {}
        for i in idx:
            s = states[i]
            groups.setdefault(CHUNK * s.window + CHUNK - 1 - s.fed, []).append(i)
        return list(groups.values())

    def _context_policy(self, state: SlotState, res: SlotResult) -> None:
        """Never run past the static cache; reset the conversation while listening when close."""
        k = state.window
        capacity = (self.settings.max_seq - state.prefix_len - CHUNK) // CHUNK  # windows that fit
        left = capacity - k
        if state.mode is Mode.SPEAKING and left <= 1:
            rid = state.response_id
            self._stop_speaking(state)
            res.cancelled = True
            if rid is not None:
                res.events.append(ResponseDone(state.epoch, rid, "incomplete", "context_limit"))
            res.events.append(TurnState(state.epoch, "listening", "context_limit"))
        # Never let the reserve exceed half the context (a long system prompt shrinks it).
        reserve = min(self.settings.context_reserve_windows, capacity // 2)
        if state.mode is Mode.LISTENING and left <= reserve:
            state.context_resets += 1
            log.info("slot %d: context limit (%d positions); conversation memory reset", state.index,
                     self.settings.max_seq)
            res.events.append(EngineError(state.epoch, "context_reset",
                                          f"the model's context ({self.settings.max_seq} positions, "
                                          f"{self.settings.max_seq * 0.04:.0f} s) is nearly full: its memory of "
                                          "this conversation was reset; the session continues"))
            self._start_context(state)

    # -- static programs ------------------------------------------------------------------------

    def _program(self, kind: str, positions: int, rows: BatchRows) -> Program:
        key = (kind, positions, rows.size, rows.contiguous)
        prog = self.programs.get(key)
        if prog is None:
            if len(self.programs) >= 8 * len(self.buckets):  # bounded: kinds x lengths x buckets x 2
                raise RuntimeError(f"unexpected program shape {key}")
            prog = self._new_program(kind, positions, rows)
            self.programs[key] = prog
        return prog

    def _new_program(self, kind: str, positions: int, rows: BatchRows) -> Program:
        b, dev, t = rows.size, self.device, self.tok
        h = self.model.embed_tokens.weight.shape[1]
        # Valid defaults (padding values) so that a capture's warm-up computes something sane.
        row_t = torch.tensor(rows.rows, device=dev)
        audio = torch.zeros((b, positions, h), dtype=self.dtype, device=dev)
        audio_idx = torch.full((b, positions), -1, dtype=torch.long, device=dev)
        cache_rows = None if rows.contiguous else row_t
        if kind == "listen":
            pads = torch.tensor([t.text_pad, t.stoken_pad, t.sleep], device=dev)
            lb = ListenBuffers(tokens=pads[None, :, None].repeat(b, 1, positions).contiguous(), audio=audio,
                               audio_idx=audio_idx, pos=torch.arange(positions, device=dev).repeat(b, 1),
                               rows=row_t)

            def listen() -> tuple[Tensor, Tensor]:
                scores = self.listen_window(lb.tokens[:, 0], lb.tokens[:, 1], lb.tokens[:, 2], lb.audio, lb.pos,
                                            cache_rows)
                return control_decision(scores, self.settings.start_speak_factor)

            return Program(kind, rows, lb, StaticProgram(listen))
        r = self.speech_slice.stop - self.speech_slice.start
        sb = SpeakBuffers(
            pending=torch.tensor([[t.text_pad, t.stoken_pad, t.sleep]] * b, device=dev), audio=audio,
            audio_idx=audio_idx, base_pos=torch.zeros((b, 1), dtype=torch.long, device=dev),
            hist_len=torch.zeros(b, dtype=torch.long, device=dev), rows=row_t,
            temperature=torch.zeros(b, dtype=torch.float32, device=dev),
            noise=torch.full((b, CHUNK, r), 0.5, dtype=torch.float32, device=dev))

        def speak() -> tuple[Tensor, Tensor]:
            return self.speak_window(sb.pending, sb.audio, sb.base_pos, sb.hist_len, sb.rows, cache_rows,
                                     sb.temperature, sb.noise)

        return Program(kind, rows, sb, StaticProgram(speak))

    def capture_graphs(self) -> None:
        """Capture the steady-state programs of every bucket as CUDA graphs (largest first, one
        memory pool). Only before any slot is open: warm-up runs write the caches of their rows.
        A listening group's first window (9 positions, once per conversation) stays eager."""
        if any(s is not None for s in self.slots):
            raise RuntimeError("capture_graphs: slots are open; their caches would be overwritten")
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            for contiguous in (True, False):
                rows = BatchRows(tuple(range(b)) if contiguous else (self.scratch,) * b, contiguous)
                for kind in ("speak", "listen"):
                    with torch.no_grad():
                        self._program(kind, CHUNK, rows).run.capture(pool)
        # Rows 0..b-1 and the scratch row now hold warm-up values: clear them for their owners.
        self.model.reset_rows(list(range(self.max_sessions + 1)))
        self.speech_history.fill_(self.tok.stoken_pad)
        for t in (self.text_rule.count, self.text_rule.has_eos, self.speech_rule.prefix_count,
                  self.speech_rule.count, self.speech_rule.has_eos):
            t.zero_()
        log.info("captured %d CUDA graphs (buckets %s)", len(self.programs), list(self.buckets))

    def _batch_rows(self, slots: list[int]) -> BatchRows:
        busy = {i for i, s in enumerate(self.slots) if s is not None}
        return batch_rows(slots, bucket_for(len(slots), self.buckets), busy, self.scratch)

    def _upload(self, dst: Tensor, src: np.ndarray) -> None:
        # From pageable memory the copy is staged at once and never waits for the device.
        dst.copy_(torch.from_numpy(src), non_blocking=True)

    def _audio_index(self, state: SlotState, item: int, n: int) -> list[int]:
        """Audio channel of the positions fed: feature j of this window at 10k+2j, pad elsewhere."""
        start = state.window * CHUNK
        return [5 * item + (p - start) // 2 if p >= start and p % 2 == 0 else -1
                for p in range(state.fed, state.fed + n)]

    def _run(self, prog: Program, feats: Tensor, n: int) -> list[Tensor]:
        """Fill the audio channel, run (or replay) the program, keep the first ``n`` rows."""
        buf = prog.buffers
        pad = self.model.embed_tokens.weight[self.tok.audio_pad]
        picked = feats[buf.audio_idx.clamp(min=0)].to(pad.dtype)
        buf.audio.copy_(torch.where((buf.audio_idx >= 0)[..., None], picked, pad))
        out = prog.run() if self.use_graphs else prog.run.fn()
        # Graph outputs are overwritten by the next replay: copy the real rows out.
        return [out[0][:n].clone(), out[1][:n].clone()]

    # -- listening: one forward over the window's positions -------------------------------------

    def _launch_listen(self, group: list[int], states: list[SlotState]) -> Program:
        t = self.tok
        batch = [states[i] for i in group]
        for s in batch:  # positions up to 10k+8 are forced pads (Sleep..., Detect at slot 8)
            for p in range(len(s.text), CHUNK * s.window + CHUNK - 1):
                s.text.append(t.text_pad)
                s.stoken.append(t.stoken_pad)
                s.control.append(t.detect if p % CHUNK == CHUNK - 2 else t.sleep)
        n = len(batch[0].text) - batch[0].fed
        rows = self._batch_rows([s.index for s in batch])
        prog = self._program("listen", n, rows)
        b = rows.size
        tokens = np.empty((b, 3, n), dtype=np.int64)
        tokens[:] = np.array([t.text_pad, t.stoken_pad, t.sleep])[:, None]
        pos = np.tile(np.arange(n, dtype=np.int64), (b, 1))
        audio_idx = np.full((b, n), -1, dtype=np.int64)
        for r, (s, i) in enumerate(zip(batch, group)):
            tokens[r] = [s.text[s.fed:], s.stoken[s.fed:], s.control[s.fed:]]
            pos[r] += s.prefix_len + s.fed
            audio_idx[r] = self._audio_index(s, i, n)
        buf = prog.buffers
        assert isinstance(buf, ListenBuffers)
        self._upload(buf.tokens, tokens)
        self._upload(buf.pos, pos)
        self._upload(buf.audio_idx, audio_idx)
        self._upload(buf.rows, np.array(rows.rows, dtype=np.int64))
        return prog

    def _finish_listen(self, group: list[int], states: list[SlotState], results: list[SlotResult],
                       choice_l: list[int], probs_l: list[list[float]]) -> None:
        t = self.tok
        batch = [states[i] for i in group]
        n = len(batch[0].text) - batch[0].fed
        for s, i, c, p in zip(batch, group, choice_l, probs_l):
            s.fed += n
            s.window += 1
            token = t.start_speaking if c == 0 else t.keep_listening
            if s.forced_decision is not None:
                token = s.forced_decision
            elif s.force_listen:
                token = t.keep_listening
            elif s.commit:
                token = t.start_speaking
            s.forced_decision = None
            s.commit = False
            s.text.append(t.text_pad)
            s.stoken.append(t.stoken_pad)
            s.control.append(token)
            if token == t.start_speaking:
                self._begin_response(s, results[i], {"start_speaking": p[0], "keep_listening": p[1]})

    def listen_window(self, text: Tensor, stoken: Tensor, control: Tensor, audio: Tensor, input_pos: Tensor,
                      rows: Tensor | None) -> Tensor:
        """Feed a window's positions to every stack; return (B, 2) logits of (S-S, K-L) at the end.

        Text is forced to <|TextPad|> while listening, so the merge branch's "next text" is known
        for every position and the whole window is a single forward.
        """
        m = self.model
        x = m.embed_channels(text, stoken, control, audio)
        nxt = m.embed_tokens.weight[self.tok.text_pad].expand_as(x)
        out = m.forward_positions(x, nxt, m.context(input_pos, rows))
        return torch.nn.functional.linear(out.control_hidden[:, -1], m.lm_head.weight[self.listen_rows])

    def _begin_response(self, s: SlotState, res: SlotResult, probs: dict[str, float]) -> None:
        s.mode = Mode.SPEAKING
        s.response_id = f"{self._rid_prefix}{secrets.token_hex(8)}"
        s.seq = 0
        s.detok = IncrementalDetokenizer(self.tokenizer)
        i = s.index
        for t in (self.text_rule.count, self.text_rule.has_eos, self.speech_rule.prefix_count,
                  self.speech_rule.count, self.speech_rule.has_eos):
            t[i] = 0
        res.response_id = s.response_id
        res.events.append(TurnState(s.epoch, "speaking", "model_start_speaking", probs))
        res.events.append(ResponseStarted(s.epoch, s.response_id))

    # -- speaking: 10 lockstep decode steps -------------------------------------------------------

    def _launch_speak(self, idx: list[int], states: list[SlotState]) -> Program:
        t = self.tok
        batch = [states[i] for i in idx]
        rows = self._batch_rows([s.index for s in batch])
        prog = self._program("speak", CHUNK, rows)
        buf = prog.buffers
        assert isinstance(buf, SpeakBuffers)
        b = rows.size
        pending = np.tile(np.array([t.text_pad, t.stoken_pad, t.sleep], dtype=np.int64), (b, 1))
        base_pos = np.zeros((b, 1), dtype=np.int64)
        hist_len = np.zeros(b, dtype=np.int64)
        temperature = np.zeros(b, dtype=np.float32)
        audio_idx = np.full((b, CHUNK), -1, dtype=np.int64)
        for r, (s, i) in enumerate(zip(batch, idx)):
            pending[r] = [s.text[-1], s.stoken[-1], s.control[-1]]
            base_pos[r] = s.prefix_len + s.fed
            hist_len[r] = len(s.stoken)
            temperature[r] = s.temperature
            audio_idx[r] = self._audio_index(s, i, CHUNK)
            # Each row's own generator, drawn for the whole window at once (the same values, in
            # the same order, as ten draws of one step each).
            assert s.generator is not None
            buf.noise[r].uniform_(generator=s.generator)
        for dst, src in ((buf.pending, pending), (buf.base_pos, base_pos), (buf.hist_len, hist_len),
                         (buf.temperature, temperature), (buf.audio_idx, audio_idx),
                         (buf.rows, np.array(rows.rows, dtype=np.int64))):
            self._upload(dst, src)
        return prog

    def _finish_speak(self, idx: list[int], states: list[SlotState], results: list[SlotResult],
                      tokens_l: list[list[list[int]]], probs_l: list[list[float]]) -> None:
        for i, toks, p in zip(idx, tokens_l, probs_l):
            s = states[i]
            s.fed += CHUNK
            s.window += 1
            self._finish_speaking_window(s, results[i], toks, {"start_listening": p[0], "keep_speaking": p[1]})

    def speak_window(self, pending: Tensor, audio: Tensor, base_pos: Tensor, hist_len: Tensor, rows_t: Tensor,
                     rows: Tensor | None, temperature: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
        """Ten decode steps for B speaking rows. Returns tokens (B, 10, 3) and slot-9 probabilities."""
        text_rule = TextRuleState(self.text_rule.count[rows_t], self.text_rule.has_eos[rows_t])
        speech_rule = SpeechRuleState(self.speech_rule.prefix_count[rows_t], self.speech_rule.count[rows_t],
                                      self.speech_rule.has_eos[rows_t])
        cur = pending
        ended = torch.zeros(pending.shape[0], dtype=torch.bool, device=pending.device)
        outs = []
        probs = torch.zeros((pending.shape[0], 2), device=pending.device)
        for j in range(CHUNK):
            cur, text_rule, speech_rule, ended, p = self.speak_step(
                j, cur, audio[:, j:j + 1], base_pos + j, hist_len + j, rows_t, rows, text_rule, speech_rule,
                ended, temperature, noise[:, j])
            outs.append(cur)
            if p is not None:
                probs = p
        self.text_rule.count[rows_t], self.text_rule.has_eos[rows_t] = text_rule.count, text_rule.has_eos
        self.speech_rule.prefix_count[rows_t] = speech_rule.prefix_count
        self.speech_rule.count[rows_t], self.speech_rule.has_eos[rows_t] = speech_rule.count, speech_rule.has_eos
        return torch.stack(outs, dim=1), probs

    def speak_step(self, j: int, cur: Tensor, audio: Tensor, pos: Tensor, hist_len: Tensor, rows_t: Tensor,
                   rows: Tensor | None, text_rule: TextRuleState, speech_rule: SpeechRuleState, ended: Tensor,
                   temperature: Tensor, noise: Tensor):
        """Feed one position per row (tokens ``cur`` (B, 3)), decide the next: text, then merge
        with E[that text], then speech; control forced except at slot 9."""
        m, t, st = self.model, self.tok, self.settings
        ctx = m.context(pos, rows)
        x = m.embed_channels(cur[:, 0:1], cur[:, 1:2], cur[:, 2:3], audio)
        out = m.forward_branches(x, ctx)
        text, text_rule = sample_text(m.head(out.text_hidden[:, -1]), cur[:, 0], text_rule, eos=t.text_eos,
                                      pad=t.tts_pad, max_tokens=st.max_text_tokens,
                                      end_speak_factor=st.end_speak_factor)
        speech_h = m.merge(out.stoken_hidden, m.embed_tokens(text)[:, None], ctx)
        logits = m.head(speech_h[:, -1], self.speech_slice)
        history = self.speech_history[rows_t]
        speech, speech_rule = sample_speech(
            logits, self.speech_slice.start, cur[:, 1], history, hist_len, speech_rule, prefix=self.speech_prefix,
            eos=t.tts_end, code_lo=self.code_lo, code_hi=self.code_hi, max_tokens=st.max_speech_tokens,
            ngram=st.no_repeat_ngram, temperature=temperature, noise=noise)
        probs = None
        if j == CHUNK - 1:
            scores = torch.nn.functional.linear(out.control_hidden[:, -1], m.lm_head.weight[self.speak_rows])
            choice, probs = control_decision(scores, st.start_listen_factor)
            control = torch.where(choice == 0, t.start_listening, t.keep_speaking)
            forced_after_end = t.start_listening
        else:
            forced = t.detect if j == CHUNK - 2 else t.sleep
            control = torch.full_like(text, forced)
            forced_after_end = forced
        # After <tts_end> the rest of the window is padding that closes with S-L (the reference
        # appends exactly these tokens); the model still sees every position.
        text = torch.where(ended, t.text_pad, text)
        speech = torch.where(ended, t.stoken_pad, speech)
        control = torch.where(ended, forced_after_end, control)
        ended = ended | (speech == t.tts_end)
        self.speech_history[rows_t, hist_len] = speech
        return torch.stack([text, speech, control], dim=1), text_rule, speech_rule, ended, probs

    def _finish_speaking_window(self, s: SlotState, res: SlotResult, toks: list[list[int]],
                                probs: dict[str, float]) -> None:
        t = self.tok
        rid = s.response_id
        assert rid is not None
        text_ids: list[int] = []
        codes: list[int] = []
        end_at: int | None = None
        for j, (tx, sp, ct) in enumerate(toks):
            s.text.append(tx)
            s.stoken.append(sp)
            s.control.append(ct)
            if end_at is not None:
                continue
            if tx not in self.tokenizer.id_to_added and tx in self.tokenizer.id_to_token:
                text_ids.append(tx)
            if self.code_lo <= sp < t.audio_code_min + self.cfg.stoken_codec_vocab_size:
                codes.append(sp - t.audio_code_min)
            elif self.code_lo <= sp < self.cfg.stoken_token_ids_max:
                s.codes_dropped += 1  # a tokenizer audio id the vocoder cannot render
            if sp == t.tts_end:
                end_at = j
        if text_ids and s.detok is not None:
            delta = s.detok.push(text_ids)
            if delta:
                res.events.append(TextDelta(s.epoch, rid, s.seq, delta, tuple(text_ids)))
                s.seq += 1
        if codes:
            res.codes = codes
            res.events.append(CodecTokens(s.epoch, rid, s.seq, tuple(codes)))
            s.seq += 1
        res.response_id = rid
        if end_at is not None:
            # Natural end: final codes above, then done. If <tts_end> fell on slot 9 the reference
            # appends a whole pad window ending in S-L: the next window is forced to that.
            if s.detok is not None:
                tail = s.detok.flush()
                if tail:
                    res.events.append(TextDelta(s.epoch, rid, s.seq, tail))
                    s.seq += 1
            res.events.append(ResponseDone(s.epoch, rid, "completed", "tts_end"))
            res.events.append(TurnState(s.epoch, "listening", "speech_end"))
            res.finished = True
            s.mode = Mode.LISTENING
            s.response_id = None
            s.detok = None
            s.forced_decision = t.start_listening if end_at == CHUNK - 1 else None
            return
        if s.control[-1] == t.start_listening:
            # S-L without <tts_end>: the model heard the user barge in. Stop speaking; the session
            # answers with CANCEL under a new epoch.
            res.events.append(BargeIn(s.epoch, rid, "model_barge_in"))
            res.events.append(TurnState(s.epoch, "listening", "model_barge_in", probs))
            res.cancelled = True
            self._stop_speaking(s)
