"""The engine interface (docs/architecture.md, "Where a 400 ms window goes" step 3, and "Epochs").

An engine is transport-agnostic. The session pushes fixed-size input windows and control commands
into its slot; the engine answers with a stream of typed events. Heavy compute happens inside
``StepBackend.step`` which the scheduler runs on a dedicated worker thread, never on the event loop.

Epoch authority lives in the session. Control commands carry the session's current epoch; every
event an engine emits is tagged with the epoch its slot believed current when the work was done, so
the session can drop anything older than its high-water mark.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence, Union

import numpy as np


class CapacityError(RuntimeError):
    """Raised by ``Engine.open`` when every slot is taken."""


@dataclass(frozen=True)
class ContextPolicy:
    """How an engine keeps a long conversation inside its model's fixed context.

    Counted in model positions (``positions_per_second`` of them per second of conversation).
    ``sliding``: the first ``sink_positions`` (the system prompt) always stay; when the conversation
    reaches ``window_positions + slide_positions`` positions, the oldest ``slide_positions`` are
    dropped and the most recent ``window_positions`` kept, so memory of the recent conversation
    survives however long the call lasts. ``reset``: the conversation restarts from the system
    prompt when the context is full (the client gets an ``error`` with code ``context_reset``).
    """

    mode: Literal["sliding", "reset"]
    max_positions: int  # positions per session, system prompt included
    positions_per_second: float
    sink_positions: int  # the default system prompt's length; a session's own instructions may be longer
    window_positions: int  # recent conversation kept by a slide (0 with ``reset``)
    slide_positions: int  # positions dropped per slide (0 with ``reset``)


@dataclass(frozen=True)
class EngineCapabilities:
    name: str
    input_rate: int  # Hz of the windows pushed into a slot (mono float32)
    output_rate: int  # Hz of the PCM an engine emits (mono float32)
    window_samples: int  # exact number of input samples per window
    max_sessions: int
    barge_in: bool = True
    client_cancel: bool = True
    forced_listen: bool = True
    commit_hint: bool = True
    text_output: bool = False
    audio_output: Literal["pcm", "codes", "none"] = "pcm"
    voices: tuple[str, ...] = ()
    # The model takes a system prompt (``SessionOptions.instructions``). A change before the model
    # first speaks restarts its context with the new prompt; later, it waits for the next reset.
    instructions: bool = False
    # Output mirrors input frame by frame (loopback): the playout may trim standing delay and shift
    # its pacing phase, because there is no speech to protect, only latency to minimise.
    live_passthrough: bool = False
    # How a long conversation stays within the model's context; None: the engine keeps none.
    context: ContextPolicy | None = None


@dataclass(frozen=True)
class SessionOptions:
    """Per-session choices a client may set with ``session.update``."""

    voice: str | None = None
    temperature: float | None = None
    seed: int | None = None
    instructions: str | None = None


# The keys of a phone keypad as RFC 4733 numbers them (events 0-15).
DTMF_DIGITS = "0123456789*#ABCD"


class ControlKind(str, enum.Enum):
    CANCEL = "cancel"  # stop the current response at once; ``epoch`` is the new epoch
    FORCE_LISTEN = "force_listen"  # hold the model in listening until RELEASE_LISTEN
    RELEASE_LISTEN = "release_listen"
    COMMIT = "commit"  # the user has finished speaking: answer now
    UPDATE = "update"  # new SessionOptions (new instructions wait for the next context reset)
    RESTART = "restart"  # a fresh conversation now, prefilled from ``options`` (before the model spoke)
    DTMF = "dtmf"  # the caller pressed a key (``digit``); engines may use it or ignore it


@dataclass(frozen=True)
class Control:
    kind: ControlKind
    epoch: int
    options: SessionOptions | None = None
    digit: str | None = None  # for DTMF: one of 0-9 * # A-D


# ---------------------------------------------------------------------------------------------
# Events from an engine slot to its session. Every event carries the epoch it was produced under.


@dataclass(frozen=True)
class TurnState:
    epoch: int
    state: Literal["listening", "speaking"]
    reason: str
    probabilities: dict[str, float] | None = None
    kind: Literal["turn_state"] = "turn_state"


@dataclass(frozen=True)
class SpeechStarted:
    """User speech detected (VAD); ``sample`` is the input-stream sample where it started."""

    epoch: int
    sample: int
    kind: Literal["speech_started"] = "speech_started"


@dataclass(frozen=True)
class SpeechStopped:
    epoch: int
    sample: int
    kind: Literal["speech_stopped"] = "speech_stopped"


@dataclass(frozen=True)
class ResponseStarted:
    epoch: int
    response_id: str
    kind: Literal["response_started"] = "response_started"


@dataclass(frozen=True)
class TextDelta:
    epoch: int
    response_id: str
    seq: int
    text: str
    token_ids: tuple[int, ...] = ()
    kind: Literal["text_delta"] = "text_delta"


@dataclass(frozen=True)
class CodecTokens:
    """Speech-codec tokens, emitted when the engine has no vocoder stage configured."""

    epoch: int
    response_id: str
    seq: int
    codes: tuple[int, ...]
    kind: Literal["codec_tokens"] = "codec_tokens"


@dataclass(frozen=True)
class AudioChunk:
    """Mono float32 PCM at ``EngineCapabilities.output_rate``."""

    epoch: int
    response_id: str
    seq: int
    pcm: np.ndarray = field(repr=False)
    kind: Literal["audio_chunk"] = "audio_chunk"


@dataclass(frozen=True)
class ResponseDone:
    epoch: int
    response_id: str
    status: Literal["completed", "cancelled", "incomplete", "failed"]
    reason: str = ""
    kind: Literal["response_done"] = "response_done"


@dataclass(frozen=True)
class BargeIn:
    """The engine itself decided to stop speaking because the user spoke over it.

    The session reacts exactly as for a client cancel: bump the epoch, cut playout, and send
    ``Control(CANCEL, new_epoch)`` back to the slot.
    """

    epoch: int
    response_id: str
    reason: str = "barge_in"
    kind: Literal["barge_in"] = "barge_in"


@dataclass(frozen=True)
class WindowTiming:
    window_seq: int
    queue_wait_ms: float
    step_ms: float
    vocoder_ms: float = 0.0
    batch_size: int = 1
    kind: Literal["window_timing"] = "window_timing"


@dataclass(frozen=True)
class EngineError:
    epoch: int
    code: str
    message: str
    response_id: str | None = None
    kind: Literal["engine_error"] = "engine_error"


EngineEvent = Union[
    TurnState,
    SpeechStarted,
    SpeechStopped,
    ResponseStarted,
    TextDelta,
    CodecTokens,
    AudioChunk,
    ResponseDone,
    BargeIn,
    WindowTiming,
    EngineError,
]


# ---------------------------------------------------------------------------------------------
# What a backend implements. The scheduler (scheduler.py) owns slots, queues and threads; a backend
# only knows how to run one batched step over the slots that have a window due.


@dataclass(frozen=True)
class SlotWindow:
    """One due input window for one slot, with the controls received since the previous step."""

    slot: int
    window: np.ndarray  # float32, shape (window_samples,)
    window_seq: int
    epoch: int  # the session's epoch when the window was pushed
    controls: tuple[Control, ...] = ()


class StepBackend(Protocol):
    """A backend's methods run on the engine's worker thread, one at a time; a backend whose steps
    are trivially cheap may say ``steps_inline = True`` (a class attribute) to have them run on the
    event loop instead (the loopback engine)."""

    capabilities: EngineCapabilities

    def open_slot(self, slot: int, options: SessionOptions) -> None:
        """Prepare a freshly reset slot for a new session (runs on the worker thread)."""

    def close_slot(self, slot: int) -> None:
        """Forget everything about the slot; the next owner must not see any of it."""

    def step(self, windows: Sequence[SlotWindow]) -> list[list[EngineEvent]]:
        """Run one batched step; return the events of each input, in the same order."""

    def apply_controls(self, slot: int, controls: Sequence[Control]) -> list[EngineEvent]:
        """Apply controls to a slot between steps, when it has no window due (optional fast path)."""
