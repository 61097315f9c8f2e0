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

Where each part lives: the decode functions (prefill, listening forward, speaking steps) in
``decode.py``; the per-slot state machine (controls, decisions, events) in ``slot.py``; the window
programs and their CUDA graphs in ``graphs.py``. This module runs a step: it batches the slots,
fills the programs' buffers, and hands the decided tokens back to the state machine.

State of a slot lives in :class:`~.slot.SlotState` (host) and in rows of a few device buffers
indexed by slot (KV caches, and :class:`~.decode.RuleRows`: speech history for the 4-gram rule,
rule counters; with sliding on, its staging cache row and stored audio features); closing a slot
resets all of them.

Long conversations (``context.py``, ``slide.py``, ``slide_budget.py``): after each step, every
sliding slot re-prefills a few more positions of the context it will keep at its next slide (system
prefix + recent conversation) into its staging row, within one budget for the whole engine, the
nearest slide first, the pieces of all slots in one batched forward where their shapes allow; at
the slide point that row replaces the slot's and the slot goes on at the new positions. ``max_seq``
positions per slot, whatever the conversation's length.

Static shapes (``graphs.py``): each group's batch is padded to a bucket (1, 2, 4, 8, ...), laid
out so that its slots' cache rows are read in place wherever a window of rows allows, and its
inputs are copied into that program's fixed buffers; the listening forward and the speaking window
(all ten decode steps) are functions of those buffers, replayed as CUDA graphs on a GPU and called
eagerly elsewhere. Every group of a step is launched first; the results of all of them come back
to the host in one transfer at the end of the step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ..base import ContextPolicy, Control, EngineEvent, SessionOptions
from .audio import encode_windows, mel_filterbank
from .config import LycheeConfig, SpecialTokens
from .context import POSITIONS_PER_SECOND, RESERVE_STEPS, SlidePolicy
from .decode import CHUNK, DecodeRules, RuleRows, prefill
from .graphs import (
    BatchRows,
    ListenBuffers,
    Program,
    SpeakBuffers,
    WindowPrograms,
    batch_rows,
    bucket_sizes,
    fetch,
    use_cuda_graphs,
)
from .model import LycheeFD
from .slide import FeatureStore, Piece, SlideJob, Slider, SlideStats
from .slide_budget import Claim, cost, fixed_cost, held_back, share
from .slot import Mode, SlotMachine, SlotResult, SlotState
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTIONS = "You are a helpful assistant."
# On a CPU, a window step (its own forwards and its slide share) should end within this much of
# the thread's CPU time; a share is cut to what is left of it (never what a slide needs to be on
# time). 400 ms is the window's deadline; the rest is room for the estimate's error.
SHARE_DEADLINE_S = 0.34
PER_COST_SMOOTHING = 0.2  # weight of the newest share in the running seconds-per-cost estimate
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
    # Rolling context (context.py): conversation positions kept by a slide and dropped per slide,
    # and positions re-prefilled per window step by all slots together (None: from max_seq and
    # max_sessions, docs/lychee_fd.md; context_window 0 turns sliding off).
    context_window: int | None = None
    context_slide_step: int | None = None
    context_prefill_budget: int | None = None
    # Sliding off: listening with fewer than this many windows of context left resets the
    # conversation (with sliding on, a reset happens only at the very end, as a last resort).
    context_reserve_windows: int = 25
    cuda_graphs: str = "auto"  # auto: captured on CUDA, eager elsewhere; on: CUDA required; off: eager


def slide_policy(tokenizer: Tokenizer, settings: RunnerSettings, max_sessions: int) -> tuple[SlidePolicy, list[int]]:
    """The rolling-context policy of a runner with these settings, and its default system prefix
    (the sink the sizes are derived for); a session's own instructions may be up to a quarter of
    ``max_seq``."""
    prefix = tokenizer.encode(SYSTEM_TEMPLATE.format(instructions=DEFAULT_INSTRUCTIONS))
    policy = SlidePolicy.build(settings.max_seq, settings.context_window, settings.context_slide_step,
                               settings.context_prefill_budget, len(prefix), max(len(prefix), settings.max_seq // 4),
                               max_sessions)
    return policy, prefix


class LycheeRunner:
    """The slots of one engine and its batched window step (implements :class:`~.slot.SlotDevice`)."""

    def __init__(self, model: LycheeFD, tokenizer: Tokenizer, max_sessions: int, settings: RunnerSettings):
        self.model = model
        self.tokenizer = tokenizer
        self.cfg: LycheeConfig = model.cfg
        self.settings = settings
        self.tok: SpecialTokens = self.cfg.resolve_tokens(tokenizer)
        self.device = model.lm_head.weight.device
        self.max_sessions = max_sessions
        # The default system prefix (the reference's, fixed); a session may bring its own
        # instructions (vLLM-Omni's template), capped so that most of the context stays for audio.
        self.prefix_ids = self.system_prefix(None)
        self.prefix_len = len(self.prefix_ids)
        self.max_prefix = max(self.prefix_len, settings.max_seq // 4)
        if settings.max_seq < self.prefix_len + 4 * CHUNK:
            raise ValueError(f"max_seq {settings.max_seq} leaves no room after the {self.prefix_len}-token prefix")
        self.max_post = settings.max_seq - self.prefix_len
        self.policy, _ = slide_policy(tokenizer, settings, max_sessions)
        # Slides pace and budget by cost: late pieces attend to thousands of keys (slide_budget.py).
        main = self.cfg.text
        fixed = fixed_cost(main.hidden_size, main.num_key_value_heads * main.head_dim, main.intermediate_size)
        self.policy = replace(self.policy, fixed=fixed)
        # One row per slot plus a scratch row that padding rows of a bucket may write (graphs.py),
        # and with sliding on one staging row per slot after those (slide.py).
        self.scratch = max_sessions
        self.buckets = bucket_sizes(max_sessions)
        sliding = self.policy.enabled
        model.setup_caches(max_sessions + 1 + (max_sessions if sliding else 0), settings.max_seq)
        self.store: FeatureStore | None = None
        self.slider: Slider | None = None
        self.slides: dict[int, SlideJob] = {}
        self.slide_stats = SlideStats(budget=self.policy.budget)  # benchmarks and tests read it
        if sliding:
            hidden = model.embed_tokens.weight.shape[1]
            self.store = FeatureStore(max_sessions, settings.max_seq // CHUNK + 1, hidden,
                                      model.embed_tokens.weight.dtype, self.device)
        self.filters = mel_filterbank(device=self.device)
        st = settings
        self.rules = DecodeRules.build(
            self.cfg, self.tok, self.device, stoken_delay_num=st.stoken_delay_num,
            strict_codec_range=st.strict_codec_range, start_speak_factor=st.start_speak_factor,
            start_listen_factor=st.start_listen_factor, end_speak_factor=st.end_speak_factor,
            max_text_tokens=st.max_text_tokens, max_speech_tokens=st.max_speech_tokens,
            no_repeat_ngram=st.no_repeat_ngram)
        self.rule_rows = RuleRows.create(max_sessions + 1, st.max_seq, self.tok.stoken_pad, self.device)
        self.machine = SlotMachine(self.cfg, self.tok, tokenizer, self, code_lo=self.rules.code_lo,
                                   max_seq=st.max_seq, context_reserve_windows=st.context_reserve_windows,
                                   sliding=sliding)
        if self.store is not None:
            # A GPU forward's fixed cost (weights read, launches) dwarfs padded rows; a CPU pays for them.
            self.slider = Slider(model, self.store, self.tok.audio_pad,
                                 pad_ratio=float("inf") if self.device.type == "cuda" else 1.25)
        self.slots: list[SlotState | None] = [None] * max_sessions
        # The share's clock: on a CPU the engine thread's CPU time, what the window's own forwards
        # and the share both spend. None on a GPU: a window takes tens of ms there and the share's
        # kernels queue behind it, so a host clock would not measure either.
        self.share_clock = time.thread_time if self.device.type == "cpu" else None
        self.per_cost_s: float | None = None  # recent shares' seconds per unit of cost
        # Graphs are captured here, before any slot opens: a capture's warm-up writes the caches.
        self.graphs_captured = use_cuda_graphs(settings.cuda_graphs, self.device)
        self.window_programs = WindowPrograms(model, self.rules, self.rule_rows, self.buckets, self.scratch,
                                              self.graphs_captured)
        if self.graphs_captured:
            self.window_programs.capture()

    @property
    def programs(self) -> dict[tuple[str, int, int, int | None], Program]:
        return self.window_programs.programs

    @property
    def use_graphs(self) -> bool:
        return self.window_programs.use_graphs

    @use_graphs.setter
    def use_graphs(self, value: bool) -> None:
        """False runs the captured programs eagerly (to compare)."""
        self.window_programs.use_graphs = value

    def context_policy(self) -> ContextPolicy:
        """The policy as the engine reports it (capabilities, ``session.created``)."""
        p = self.policy
        return ContextPolicy(mode="sliding" if p.enabled else "reset", max_positions=self.settings.max_seq,
                             positions_per_second=POSITIONS_PER_SECOND, sink_positions=self.prefix_len,
                             window_positions=p.kept(self.prefix_len, self.prefix_len) if p.enabled else 0,
                             slide_positions=p.step if p.enabled else 0)

    def staging_row(self, slot: int) -> int:
        return self.scratch + 1 + slot

    def system_prefix(self, instructions: str | None) -> list[int]:
        text = SYSTEM_TEMPLATE.format(instructions=instructions or DEFAULT_INSTRUCTIONS)
        return self.tokenizer.encode(text)

    # ------------------------------------------------------------------------------------------
    # slot lifecycle

    def open(self, slot: int, options: SessionOptions) -> None:
        state = SlotState(index=slot)
        state.prefix_ids = self.prefix_for(slot, options.instructions)
        state.instructions = options.instructions
        state.temperature = self.settings.temperature if options.temperature is None else options.temperature
        seed = options.seed if options.seed is not None else self.settings.seed * 1000003 + slot
        state.generator = torch.Generator(device=self.device).manual_seed(int(seed))
        state.seed = options.seed
        self.slots[slot] = state
        self.start_context(state)

    def close(self, slot: int) -> None:
        self._clear_rows(slot)
        self.slots[slot] = None

    def apply_controls(self, slot: int, controls: Sequence[Control]) -> list[EngineEvent]:
        state = self.slots[slot]
        return [] if state is None else self.machine.apply_controls(state, controls)

    def stop_response(self, slot: int) -> None:
        """End the slot's response at this window boundary (its audio could not be made)."""
        state = self.slots[slot]
        if state is not None and state.mode is Mode.SPEAKING:
            self.machine.stop_speaking(state)

    # -- the device side of a slot (SlotDevice) -------------------------------------------------

    def prefix_for(self, slot: int, instructions: str | None) -> list[int]:
        if not instructions:
            return list(self.prefix_ids)
        # Text averages about 4 characters per token, so 8 per prefix token is more than can fit:
        # cut the text first so tokenizing stays cheap on the engine thread, then the tokens.
        ids = self.system_prefix(instructions[: 8 * self.max_prefix])
        if len(ids) > self.max_prefix:
            log.warning("slot %d: instructions of %d tokens cut to %d", slot, len(ids), self.max_prefix)
            ids = ids[: self.max_prefix - 1] + ids[-1:]  # keep the closing <|EOT|>
        return ids

    @torch.no_grad()
    def start_context(self, state: SlotState) -> None:
        """Fresh conversation in this slot: prefill the system prefix, decide position 0."""
        self.slides.pop(state.index, None)
        self._clear_rows(state.index)
        self.machine.reset_host(state)
        prefill(self.model, state.prefix_ids, state.index, self.tok.text_pad)

    def pad_speech(self, slot: int, position: int) -> None:
        self.rule_rows.history[slot, position] = self.tok.stoken_pad
        job = self.slides.get(slot)
        if job is not None:
            job.rewind(position)

    def reset_rules(self, slot: int) -> None:
        self.rule_rows.reset_rules(slot)

    def _clear_rows(self, slot: int) -> None:
        self.slides.pop(slot, None)
        self.model.reset_rows([slot] if self.store is None else [slot, self.staging_row(slot)])
        self.rule_rows.reset(slot, self.tok.stoken_pad)
        if self.store is not None:
            self.store.clear(slot)

    # ------------------------------------------------------------------------------------------
    # the step

    @torch.no_grad()
    def step(self, items: Sequence[tuple[int, np.ndarray, int]]) -> list[SlotResult]:
        """One batched step over (slot, 6400-sample window, epoch) items; results in order."""
        clock = self.share_clock
        started = clock() if clock is not None else 0.0
        results: list[SlotResult] = []
        states: list[SlotState] = []
        for slot, _, epoch in items:
            state = self.slots[slot]
            if state is None:
                raise KeyError(f"slot {slot} is not open")
            resets = state.context_resets
            results.append(self.machine.begin_window(state, epoch))
            if self.slider is not None and state.context_resets > resets:
                self.slide_stats.fallbacks += 1  # its slide was not ready when the slot reached its end
            states.append(state)
        windows = torch.from_numpy(np.stack([np.asarray(w, dtype=np.float32) for _, w, _ in items])).to(self.device)
        feats = encode_windows(self.model.encoder, self.model.adapter, self.filters, windows)
        if self.store is not None:  # kept for the re-prefills of slides
            self.store.write([s.index for s in states], [s.window for s in states], feats)
        feats = feats.reshape(-1, feats.shape[-1])  # row 5i+j: feature j of item i

        listen = [i for i, s in enumerate(states) if s.mode is Mode.LISTENING]
        speak = [i for i, s in enumerate(states) if s.mode is Mode.SPEAKING]
        # Launch every group, then one transfer for all of them: no host sync inside the window.
        launched: list[tuple[str, list[int], int]] = []
        outs: list[Tensor] = []
        for group in self._by_length(states, listen):
            prog, rows, n = self._launch_listen(group, states)
            launched.append(("listen", group, n))
            outs += self.window_programs.run(prog, feats, rows)
        if speak:
            launched.append(("speak", speak, CHUNK))
            prog, rows = self._launch_speak(speak, states)
            outs += self.window_programs.run(prog, feats, rows)
        host = fetch(outs)
        for k, (kind, group, n) in enumerate(launched):
            for i, first, probs in zip(group, host[2 * k], host[2 * k + 1]):
                if kind == "listen":
                    self.machine.after_listening(states[i], results[i], n, first, probs)
                else:
                    self.machine.after_speaking(states[i], results[i], first, probs)
        # The window's results are on the host: now, off its critical path, the slides' share.
        self._advance_slides(states, None if clock is None else clock() - started)
        return results

    def _advance_slides(self, states: list[SlotState], spent_s: float | None = None) -> None:
        """Start, feed and finish the context slides of the slots stepped now (``slide.py``).

        A slot's next slide starts as soon as its last one took effect (or at open), so its
        re-prefill has a whole slide step to run in; the step's budget goes to the nearest slide
        points first; a slide takes effect at its point if its staging row has caught up, later
        (counted late) if not, and if the slot reaches its end first the last resort resets it.
        ``spent_s``: what the window itself took on the share's clock; a dear window gets a smaller
        share (``slide_budget.held_back``), the pace of the next steps taking up the rest.
        """
        stats = self.slide_stats
        stats.new_step()
        stats.budget = self.policy.budget
        if self.slider is None:
            return
        for s in states:
            if s.index not in self.slides:
                prefix = s.pending_prefix_ids if s.pending_prefix_ids is not None else s.prefix_ids
                plan = self.policy.plan(s.prefix_len, len(prefix), len(s.text))
                if plan is not None:
                    self.slides[s.index] = SlideJob(plan, prefix)
        active = [(s, self.slides[s.index]) for s in states if s.index in self.slides]
        claims = [Claim(s.index, job.steps_left(len(s.text)), max(0, job.target(len(s.text), s.fed) - job.staged),
                        job.staged, job.prefix_len + job.plan.kept, self._mean_cost(job)) for s, job in active]
        policy = self.policy
        if policy.fixed is None:
            grants = share(claims, policy.budget, least=policy.rate)
            spare = policy.budget - sum(grants)
        else:
            grants = share(claims, policy.budget_cost, least=policy.rate, fixed=policy.fixed)
            limit = policy.budget_cost
            if spent_s is not None and self.per_cost_s:
                allowed = max(0.0, SHARE_DEADLINE_S - spent_s) / self.per_cost_s
                cut = held_back(claims, grants, policy.fixed, allowed, policy.budget_cost)
                if cut != grants:
                    stats.held += 1
                    grants, limit = cut, min(limit, allowed)
            stats.budget_cost = policy.budget_cost
            stats.cost = sum(cost(c.staged, c.staged + g, policy.fixed) for c, g in zip(claims, grants))
            stats.most_cost = max(stats.most_cost, stats.cost)
            # padding may use what is left, priced as positions at the largest context
            spare = int((limit - stats.cost) // (policy.fixed + policy.context))
        pieces = [Piece(job, s.index, self.staging_row(s.index), job.staged + g, s.text, s.stoken, s.control)
                  for (s, job), g in zip(active, grants) if g]
        stats.positions, stats.pieces = sum(grants), len(pieces)
        if pieces:
            clock = self.share_clock
            began = clock() if clock is not None else 0.0
            stats.computed, stats.forwards = self.slider.stage(pieces, max(0, spare))
            if clock is not None and stats.cost > 0:
                per = (clock() - began) / stats.cost
                old = self.per_cost_s
                self.per_cost_s = per if old is None else old + PER_COST_SMOOTHING * (per - old)
            stats.most_computed = max(stats.most_computed, stats.computed)
        for s, job in active:
            if job.ready(len(s.text), s.fed):
                late = len(s.text) > job.plan.swap_at
                self.slider.switch(job, s.index, self.staging_row(s.index), self.rule_rows, len(s.text), s.window,
                                   self.tok.stoken_pad)
                self.machine.slide(s, job.plan.shift, job.prefix_ids)
                del self.slides[s.index]
                stats.switches += 1
                stats.slides += 1
                stats.late += late
                log.debug("slot %d: context slid by %d positions (%d kept)%s", s.index, job.plan.shift, len(s.text),
                          " late" if late else "")

    def _mean_cost(self, job: SlideJob) -> float:
        """A slide's whole cost over its paced steps (a slide step less the reserve), what a dear
        window's cut measures later steps against (``slide_budget.held_back``)."""
        if self.policy.fixed is None:
            return 0.0
        steps = max(1, job.plan.shift // CHUNK - RESERVE_STEPS)
        return cost(0, job.prefix_len + job.plan.kept, self.policy.fixed) / steps

    def _by_length(self, states: list[SlotState], idx: list[int]) -> list[list[int]]:
        groups: dict[int, list[int]] = {}
        for i in idx:
            s = states[i]
            groups.setdefault(CHUNK * s.window + CHUNK - 1 - s.fed, []).append(i)
        return list(groups.values())

    def _batch_rows(self, slots: list[int]) -> BatchRows:
        """The batch's cache rows (``graphs.batch_rows``). An open slot outside the batch lends its
        row to padding only while its conversation, after this step has fed up to a window more,
        still ends a window below the top positions that padding writes."""
        busy = {i: s for i, s in enumerate(self.slots) if s is not None}
        spare = [i for i, s in busy.items() if s.prefix_len + len(s.text) + 2 * CHUNK <= self.settings.max_seq]
        return batch_rows(slots, self.buckets, busy, self.scratch, spare)

    def _pad_positions(self, rows: BatchRows, first: np.ndarray, n: int) -> np.ndarray:
        """First positions of a batch's rows: ``first`` holds the real rows'; each padding row writes
        its ``n`` positions where nothing is read before it is fed again (``graphs.py``), as low as
        that allows, because on a CPU attention reads keys up to the batch's furthest position:

        * the row of an open slot outside the batch: just past what that slot will have fed after
          this step (its decided positions and a window more; ``_batch_rows`` lends the row only
          while that ends a window below the top);
        * the scratch row or a free row (nothing reads it): the batch's furthest real position.
        """
        top = self.settings.max_seq - n
        out = first.copy()
        furthest = int(max(first[r] for r in rows.real)) if rows.real else top
        for r in rows.padding():
            row = rows.rows[r]
            owner = self.slots[row] if row < self.max_sessions else None
            at = furthest if owner is None else owner.prefix_len + len(owner.text) + CHUNK
            out[r] = min(max(at, 0), top)
        return out

    def _state_rows(self, rows: BatchRows, slots: list[int]) -> np.ndarray:
        """Rule-state rows of a batch: each slot's own; padding keeps its state in the scratch row."""
        out = np.full(rows.size, self.scratch, dtype=np.int64)
        out[list(rows.real)] = slots
        return out

    def _upload(self, dst: Tensor, src: np.ndarray) -> None:
        # From pageable memory the copy is staged at once and never waits for the device.
        dst.copy_(torch.from_numpy(src), non_blocking=True)

    def _audio_index(self, state: SlotState, item: int, n: int) -> list[int]:
        """Audio channel of the positions fed: feature j of this window at 10k+2j, pad elsewhere."""
        start = state.window * CHUNK
        return [5 * item + (p - start) // 2 if p >= start and p % 2 == 0 else -1
                for p in range(state.fed, state.fed + n)]

    def _launch_listen(self, group: list[int], states: list[SlotState]) -> tuple[Program, BatchRows, int]:
        """Fill a listening program's buffers for one group (same number of positions to feed)."""
        t = self.tok
        batch = [states[i] for i in group]
        for s in batch:
            self.machine.pad_listening(s)
        n = len(batch[0].text) - batch[0].fed
        slots = [s.index for s in batch]
        rows = self._batch_rows(slots)
        prog = self.window_programs.get("listen", n, rows)
        b = rows.size
        tokens = np.empty((b, 3, n), dtype=np.int64)
        tokens[:] = np.array([t.text_pad, t.stoken_pad, t.sleep])[:, None]
        first = np.zeros(b, dtype=np.int64)
        audio_idx = np.full((b, n), -1, dtype=np.int64)
        for r, s, i in zip(rows.real, batch, group):
            tokens[r] = [s.text[s.fed:], s.stoken[s.fed:], s.control[s.fed:]]
            first[r] = s.prefix_len + s.fed
            audio_idx[r] = self._audio_index(s, i, n)
        pos = self._pad_positions(rows, first, n)[:, None] + np.arange(n, dtype=np.int64)
        buf = prog.buffers
        assert isinstance(buf, ListenBuffers)
        self._upload(buf.tokens, tokens)
        self._upload(buf.pos, pos)
        self._upload(buf.audio_idx, audio_idx)
        self._upload(buf.rows, self._state_rows(rows, slots))
        return prog, rows, n

    def _launch_speak(self, idx: list[int], states: list[SlotState]) -> tuple[Program, BatchRows]:
        """Fill the speaking program's buffers for every speaking slot (ten lockstep steps)."""
        t = self.tok
        batch = [states[i] for i in idx]
        slots = [s.index for s in batch]
        rows = self._batch_rows(slots)
        prog = self.window_programs.get("speak", CHUNK, rows)
        buf = prog.buffers
        assert isinstance(buf, SpeakBuffers)
        b = rows.size
        pending = np.tile(np.array([t.text_pad, t.stoken_pad, t.sleep], dtype=np.int64), (b, 1))
        base_pos = np.zeros(b, dtype=np.int64)
        hist_len = np.zeros(b, dtype=np.int64)
        temperature = np.zeros(b, dtype=np.float32)
        audio_idx = np.full((b, CHUNK), -1, dtype=np.int64)
        for r, s, i in zip(rows.real, batch, idx):
            pending[r] = [s.text[-1], s.stoken[-1], s.control[-1]]
            base_pos[r] = s.prefix_len + s.fed
            hist_len[r] = len(s.stoken)
            temperature[r] = s.temperature
            audio_idx[r] = self._audio_index(s, i, CHUNK)
            # Each row's own generator, drawn for the whole window at once (the same values, in
            # the same order, as ten draws of one step each).
            assert s.generator is not None
            buf.noise[r].uniform_(generator=s.generator)
        base_pos = self._pad_positions(rows, base_pos, CHUNK)[:, None]
        for dst, src in ((buf.pending, pending), (buf.base_pos, base_pos), (buf.hist_len, hist_len),
                         (buf.temperature, temperature), (buf.audio_idx, audio_idx),
                         (buf.rows, self._state_rows(rows, slots))):
            self._upload(dst, src)
        return prog, rows
