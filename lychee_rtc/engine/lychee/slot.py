"""The per-slot state machine of the Lychee-FD runner, on the host.

A slot listens or speaks. Between windows it takes controls (cancel, force-listen, commit,
restart, update); after each window it turns the decided tokens into engine events: the listening
decision (S-S starts a response), a speaking window's text and codes, the natural end
(``<tts_end>``), the model's own barge-in (S-L without ``<tts_end>``). A context slide
(``slide.py``) shifts its positions and nothing else; the context limit's reset is the last resort.

The machine owns no tensors. What it needs from the device side (a prefill, a speech-history
position padded, the rule state of a new response) it asks through :class:`SlotDevice`, which the
runner implements.
"""

from __future__ import annotations

import enum
import logging
import secrets
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from ..base import (
    BargeIn,
    CodecTokens,
    Control,
    ControlKind,
    EngineError,
    EngineEvent,
    ResponseDone,
    ResponseStarted,
    TextDelta,
    TurnState,
)
from .config import LycheeConfig, SpecialTokens
from .decode import CHUNK
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

RESPONSE_ID_PREFIX = "resp_"


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
    context_slides: int = 0
    dropped: int = 0  # conversation positions dropped by slides since the conversation began

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)


@dataclass
class SlotResult:
    events: list[EngineEvent]
    codes: list[int]  # codec ids decided this window (for a vocoder)
    response_id: str | None
    finished: bool  # natural end: flush the vocoder
    cancelled: bool  # stop at once: drop the vocoder stream


class SlotDevice(Protocol):
    """The device side of a slot, as the state machine needs it."""

    def prefix_for(self, slot: int, instructions: str | None) -> list[int]:
        """System prefix ids for these instructions (capped)."""

    def start_context(self, state: SlotState) -> None:
        """A fresh conversation: clear the slot's rows, prefill its prefix, reset the host state."""

    def pad_speech(self, slot: int, position: int) -> None:
        """The speech history at ``position`` becomes <|StokenPad|> (a response cut short)."""

    def reset_rules(self, slot: int) -> None:
        """The sampling rules' counters start again (a new response)."""


class SlotMachine:
    def __init__(self, cfg: LycheeConfig, tok: SpecialTokens, tokenizer: Tokenizer, device: SlotDevice, *,
                 code_lo: int, max_seq: int, context_reserve_windows: int, sliding: bool = False):
        self.tok = tok
        self.tokenizer = tokenizer
        self.device = device
        self.code_lo = code_lo
        self.codec_end = tok.audio_code_min + cfg.stoken_codec_vocab_size  # ids the vocoder can render
        self.speech_end = cfg.stoken_token_ids_max
        self.max_seq = max_seq
        self.context_reserve_windows = context_reserve_windows
        # With sliding, a slide keeps the slot two windows short of its end; the reset is only the
        # last resort at the very end.
        self.sliding = sliding

    def reset_host(self, state: SlotState) -> None:
        """The host half of a fresh conversation: position 0 decided, nothing fed, listening."""
        if state.pending_prefix_ids is not None:
            state.prefix_ids, state.pending_prefix_ids = state.pending_prefix_ids, None
        t = self.tok
        state.text, state.stoken, state.control = [t.text_pad], [t.stoken_pad], [t.sleep]
        state.fed = 0
        state.window = 0
        state.dropped = 0
        state.mode = Mode.LISTENING
        state.forced_decision = None

    # -- between windows ------------------------------------------------------------------------

    def apply_controls(self, state: SlotState, controls: Sequence[Control]) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        for c in controls:
            if c.kind is ControlKind.CANCEL:
                state.epoch = max(state.epoch, c.epoch)
                if state.mode is Mode.SPEAKING:
                    self.stop_speaking(state)
                    events.append(TurnState(state.epoch, "listening", "cancelled"))
            elif c.kind is ControlKind.FORCE_LISTEN:
                state.force_listen, state.commit = True, False
                if state.mode is Mode.SPEAKING:  # the session cancels first; be safe if it did not
                    self.stop_speaking(state)
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
                    self.stop_speaking(state)
                state.instructions = c.options.instructions
                state.prefix_ids = self.device.prefix_for(state.index, c.options.instructions)
                state.pending_prefix_ids = None
                state.commit = False
                self.device.start_context(state)
            elif c.kind is ControlKind.UPDATE and c.options is not None:
                if c.options.instructions != state.instructions:
                    # The prefix sits at the start of the context: it can only change at a reset.
                    state.instructions = c.options.instructions
                    state.pending_prefix_ids = self.device.prefix_for(state.index, c.options.instructions)
                if c.options.temperature is not None:
                    state.temperature = c.options.temperature
                # The session sends all its options with every update: re-seed only on a new seed,
                # or a voice change would restart the random stream.
                if c.options.seed is not None and c.options.seed != state.seed and state.generator is not None:
                    state.generator.manual_seed(int(c.options.seed))
                    state.seed = c.options.seed
        return events

    def stop_speaking(self, state: SlotState) -> None:
        """Leave speaking at a window boundary: the pending slot-9 position becomes a plain S-L
        decision with padded text/speech, as the reference's S->L tail fallback does."""
        t = self.tok
        last = len(state.text) - 1
        state.text[last], state.stoken[last], state.control[last] = t.text_pad, t.stoken_pad, t.start_listening
        self.device.pad_speech(state.index, last)
        state.mode = Mode.LISTENING
        state.response_id = None
        state.detok = None
        state.forced_decision = None
        state.commit = False

    def begin_window(self, state: SlotState, epoch: int) -> SlotResult:
        """Before a window: catch up with the session's epoch and keep within the context."""
        res = SlotResult([], [], state.response_id, False, False)
        if epoch > state.epoch:
            # The session moved on without our seeing its CANCEL: the response in flight
            # belongs to the old epoch and must not continue under the new one.
            if state.mode is Mode.SPEAKING:
                self.stop_speaking(state)
                res.cancelled = True
                res.events.append(TurnState(epoch, "listening", "cancelled"))
            state.epoch = epoch
        self._context_policy(state, res)
        return res

    def slide(self, state: SlotState, shift: int, prefix_ids: list[int]) -> None:
        """The host half of a slide: the oldest ``shift`` positions are gone, the context now
        starts with ``prefix_ids`` (new instructions waiting for it take effect here)."""
        assert shift % CHUNK == 0 and shift <= state.fed
        del state.text[:shift], state.stoken[:shift], state.control[:shift]
        state.fed -= shift
        state.window -= shift // CHUNK
        state.dropped += shift
        state.context_slides += 1
        if state.pending_prefix_ids is prefix_ids:
            state.pending_prefix_ids = None
        state.prefix_ids = prefix_ids

    def _context_policy(self, state: SlotState, res: SlotResult) -> None:
        """Never run past the static cache; reset the conversation while listening when close.

        With sliding on this is the last resort, reached only if a slide could not keep up."""
        k = state.window
        capacity = (self.max_seq - state.prefix_len - CHUNK) // CHUNK  # windows that fit
        left = capacity - k
        if state.mode is Mode.SPEAKING and left <= 1:
            rid = state.response_id
            self.stop_speaking(state)
            res.cancelled = True
            if rid is not None:
                res.events.append(ResponseDone(state.epoch, rid, "incomplete", "context_limit"))
            res.events.append(TurnState(state.epoch, "listening", "context_limit"))
        # Never let the reserve exceed half the context (a long system prompt shrinks it).
        reserve = 1 if self.sliding else min(self.context_reserve_windows, capacity // 2)
        if state.mode is Mode.LISTENING and left <= reserve:
            state.context_resets += 1
            # With sliding on this means a slide could not keep up: worth a warning.
            (log.warning if self.sliding else log.info)(
                "slot %d: context limit (%d positions); conversation memory reset", state.index, self.max_seq)
            res.events.append(EngineError(state.epoch, "context_reset",
                                          f"the model's context ({self.max_seq} positions, "
                                          f"{self.max_seq * 0.04:.0f} s) is nearly full: its memory of "
                                          "this conversation was reset; the session continues"))
            self.device.start_context(state)

    # -- listening ------------------------------------------------------------------------------

    def pad_listening(self, state: SlotState) -> None:
        """Positions up to 10k+8 of a listening window are forced pads (Sleep..., Detect at slot 8)."""
        t = self.tok
        for p in range(len(state.text), CHUNK * state.window + CHUNK - 1):
            state.text.append(t.text_pad)
            state.stoken.append(t.stoken_pad)
            state.control.append(t.detect if p % CHUNK == CHUNK - 2 else t.sleep)

    def after_listening(self, state: SlotState, res: SlotResult, fed: int, choice: int, probs: list[float]) -> None:
        """The window's ``fed`` positions are in the caches; decide position 10k+9."""
        t = self.tok
        state.fed += fed
        state.window += 1
        token = t.start_speaking if choice == 0 else t.keep_listening
        if state.forced_decision is not None:
            token = state.forced_decision
        elif state.force_listen:
            token = t.keep_listening
        elif state.commit:
            token = t.start_speaking
        state.forced_decision = None
        state.commit = False
        state.text.append(t.text_pad)
        state.stoken.append(t.stoken_pad)
        state.control.append(token)
        if token == t.start_speaking:
            self._begin_response(state, res, {"start_speaking": probs[0], "keep_listening": probs[1]})

    def _begin_response(self, state: SlotState, res: SlotResult, probs: dict[str, float]) -> None:
        state.mode = Mode.SPEAKING
        state.response_id = f"{RESPONSE_ID_PREFIX}{secrets.token_hex(8)}"
        state.seq = 0
        state.detok = IncrementalDetokenizer(self.tokenizer)
        self.device.reset_rules(state.index)
        res.response_id = state.response_id
        res.events.append(TurnState(state.epoch, "speaking", "model_start_speaking", probs))
        res.events.append(ResponseStarted(state.epoch, state.response_id))

    # -- speaking -------------------------------------------------------------------------------

    def after_speaking(self, state: SlotState, res: SlotResult, toks: list[list[int]], probs: list[float]) -> None:
        """The window's ten positions were fed and decided: text and codes out, end or barge-in."""
        t = self.tok
        state.fed += CHUNK
        state.window += 1
        rid = state.response_id
        assert rid is not None
        text_ids: list[int] = []
        codes: list[int] = []
        end_at: int | None = None
        for j, (tx, sp, ct) in enumerate(toks):
            state.text.append(tx)
            state.stoken.append(sp)
            state.control.append(ct)
            if end_at is not None:
                continue
            if tx not in self.tokenizer.id_to_added and tx in self.tokenizer.id_to_token:
                text_ids.append(tx)
            if self.code_lo <= sp < self.codec_end:
                codes.append(sp - t.audio_code_min)
            elif self.code_lo <= sp < self.speech_end:
                state.codes_dropped += 1  # a tokenizer audio id the vocoder cannot render
            if sp == t.tts_end:
                end_at = j
        if text_ids and state.detok is not None:
            delta = state.detok.push(text_ids)
            if delta:
                res.events.append(TextDelta(state.epoch, rid, state.seq, delta, tuple(text_ids)))
                state.seq += 1
        if codes:
            res.codes = codes
            res.events.append(CodecTokens(state.epoch, rid, state.seq, tuple(codes)))
            state.seq += 1
        res.response_id = rid
        if end_at is not None:
            # Natural end: final codes above, then done. If <tts_end> fell on slot 9 the reference
            # appends a whole pad window ending in S-L: the next window is forced to that.
            if state.detok is not None:
                tail = state.detok.flush()
                if tail:
                    res.events.append(TextDelta(state.epoch, rid, state.seq, tail))
                    state.seq += 1
            res.events.append(ResponseDone(state.epoch, rid, "completed", "tts_end"))
            res.events.append(TurnState(state.epoch, "listening", "speech_end"))
            res.finished = True
            state.mode = Mode.LISTENING
            state.response_id = None
            state.detok = None
            state.forced_decision = t.start_listening if end_at == CHUNK - 1 else None
            return
        if state.control[-1] == t.start_listening:
            # S-L without <tts_end>: the model heard the user barge in. Stop speaking; the session
            # answers with CANCEL under a new epoch.
            res.events.append(BargeIn(state.epoch, rid, "model_barge_in"))
            res.events.append(TurnState(state.epoch, "listening", "model_barge_in",
                                        {"start_listening": probs[0], "keep_speaking": probs[1]}))
            res.cancelled = True
            self.stop_speaking(state)
