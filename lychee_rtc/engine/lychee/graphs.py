"""Static batch shapes for the window step, and CUDA graphs of it.

A window's work for a group of slots runs on fixed device buffers: the group is padded to a batch
*bucket* (1, 2, 4, 8, ... up to ``max_sessions``), its tokens, positions, cache rows and noise are
copied into that bucket's buffers, and one function of those buffers computes the window. On a CPU
the function runs eagerly; on CUDA it is captured once as a ``torch.cuda.CUDAGraph`` and replayed,
so a speaking window's ten decode steps (about 7,000 kernels at full size) cost one launch. The
eager and the graph path run the same code on the same buffers; only capture/replay is CUDA-only.
:class:`WindowPrograms` is a runner's cache of these programs (one per kind, length and bucket),
built from the decode functions of ``decode.py``.

Attention reads a batch's cache rows in place when the batch is a *window* of consecutive rows
``start..start+b-1`` (``start`` a multiple of ``b``): each real slot runs in its own row, and the
window's other rows are padding. Otherwise it must gather the rows, a copy of every layer's whole
rows (``max_seq`` positions) per forward, which costs as much as the attention itself; so a batch
takes the smallest bucket that has such a window (three speaking slots 0, 1, 3 run as rows 0..3, a
lone slot 2 as row 2) and is gathered only when none fits.

Padding rows never change what a live session reads. A padding row in a window is a free row, the
*scratch* row (index ``max_sessions``, owned by no slot), or the row of an open slot that is not in
this batch: it then writes its ``T`` positions just past what that slot will have fed after the
step (its decided positions and a window more), which the runner allows only while that ends at
least a window below the top of the row; such positions are never read before the slot itself
feeds them (attention is causal), so what the padding left there is overwritten first. In the
scratch or a free row it writes at the batch's furthest real position. Not at the top: on a CPU
attention reads keys only up to the batch's furthest position, and a padding row at the top would
make every row read all ``max_seq``. Padding rows keep their rule state (speech history, counters)
in the scratch row. A gathered batch pads with the scratch row, which several padding rows may
write at once.

Why hand-captured graphs rather than ``torch.compile(mode="reduce-overhead")``: the step keeps
per-row state in plain tensors that the runner also reads and resets between windows, the capture
must happen before any session opens (a capture's warm-up run writes the caches of the rows it
uses), and the graphs must replay the exact eager kernels so that graph and eager outputs are the
same; compiling a 40-layer model also costs minutes of start-up and re-compiles on guard changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Collection, Generic, Sequence, TypeVar

import torch
from torch import Tensor

from .decode import CHUNK, DecodeRules, RuleRows, listen_window, speak_window
from .model import LycheeFD

log = logging.getLogger(__name__)

BUCKET_LADDER = (1, 2, 4, 8, 16, 32, 64, 128)
GRAPH_MODES = ("auto", "on", "off")

T = TypeVar("T")


def bucket_sizes(max_sessions: int) -> tuple[int, ...]:
    """Batch sizes that get their own buffers (and graphs): powers of two below ``max_sessions``,
    and ``max_sessions`` itself, so a bucket is never larger than the runner can fill."""
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    return tuple(sorted({b for b in BUCKET_LADDER if b < max_sessions} | {max_sessions}))


def bucket_for(n: int, sizes: Sequence[int]) -> int:
    """The smallest bucket that holds ``n`` rows."""
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"a batch of {n} rows does not fit the largest bucket ({max(sizes)})")


@dataclass(frozen=True)
class BatchRows:
    rows: tuple[int, ...]  # the cache row of every batch row
    real: tuple[int, ...]  # the batch row of each real slot, in the order the slots were given
    start: int | None  # rows == start..start+b-1: the caches are read in place; None: gathered

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def contiguous(self) -> bool:
        return self.start is not None

    def padding(self) -> list[int]:
        """Batch rows that hold no real slot."""
        real = set(self.real)
        return [r for r in range(self.size) if r not in real]


def window_starts(bucket: int, scratch: int) -> range:
    """First rows of the windows a bucket may read in place: aligned to the bucket, within the
    slot rows and the scratch row (the staging rows after it belong to slides)."""
    return range(0, scratch + 2 - bucket, bucket)


def batch_rows(slots: Sequence[int], buckets: Sequence[int], busy: Collection[int], scratch: int,
               spare: Collection[int] = ()) -> BatchRows:
    """Cache rows for the real ``slots``: the smallest bucket with a window that holds them all and
    whose other rows are free, the scratch row, or ``spare``; else gathered, padded with the scratch.

    ``busy`` holds every open slot; ``spare`` those whose rows padding may write above their conversation
    positions (the runner's rule: their conversation ends well below them).
    """
    n = len(slots)
    if len(set(slots)) != n:
        raise ValueError(f"a slot appears twice in {list(slots)}")
    taken = set(busy) - set(spare) - set(slots)
    for b in buckets:
        if b < n:
            continue
        for start in window_starts(b, scratch):
            window = range(start, start + b)
            if all(s in window for s in slots) and not taken & set(window):
                return BatchRows(tuple(window), tuple(s - start for s in slots), start)
    return gathered_rows(slots, buckets, scratch)


def gathered_rows(slots: Sequence[int], buckets: Sequence[int], scratch: int) -> BatchRows:
    """The fallback layout: the slots' rows gathered, padded with the scratch row."""
    n = len(slots)
    b = bucket_for(n, buckets)
    return BatchRows(tuple(slots) + (scratch,) * (b - n), tuple(range(n)), None)


def use_cuda_graphs(mode: str, device: torch.device) -> bool:
    """``engine.lychee.cuda_graphs``: auto = on CUDA only; on = required (CUDA); off = eager."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == "on" and device.type != "cuda":
        raise ValueError(f"cuda_graphs: on needs a CUDA device, the model is on {device}")
    return mode != "off" and device.type == "cuda"


class StaticProgram(Generic[T]):
    """A function of fixed buffers: called eagerly, or captured once and then replayed.

    The function's outputs are tensors; after capture they live in the graph's memory and are
    overwritten by the next replay, so callers copy what they keep before replaying again.
    """

    def __init__(self, fn: Callable[[], T]):
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: T | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def capture(self, pool=None, warmup: int = 1) -> None:
        """Warm up on a side stream (cuBLAS workspaces, lazy inits), then record one run.

        The warm-up runs really execute and write whatever the function writes (KV caches of the
        buffer's rows): capture only while those rows belong to no session.
        """
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the server may touch CUDA while the engine captures
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.out = self.fn()
        self.graph = graph

    def __call__(self) -> T:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        assert self.out is not None
        return self.out


def fetch(tensors: Sequence[torch.Tensor]) -> list[list]:
    """Bring several small device tensors to the host in one transfer (one synchronisation).

    Values travel as float64, which holds every token id and float32 probability exactly.
    """
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        n = t.numel()
        part = flat[at:at + n].reshape(tuple(t.shape))
        out.append(part.astype(int).tolist() if not t.is_floating_point() else part.tolist())
        at += n
    return out


# ----------------------------------------------------------------------------------------------
# the window programs of a runner


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


class WindowPrograms:
    """The listening and speaking programs of one runner, keyed by (kind, positions, bucket, start)
    (``start`` None: the gathering program of that bucket).

    Each program owns its buffers; :meth:`capture` records the steady-state ones as CUDA graphs
    before any slot opens, :meth:`run` fills the audio channel and runs (or replays) one.
    """

    def __init__(self, model: LycheeFD, rules: DecodeRules, rule_rows: RuleRows, buckets: Sequence[int],
                 scratch: int, use_graphs: bool):
        self.model = model
        self.rules = rules
        self.rule_rows = rule_rows
        self.buckets = tuple(buckets)
        self.scratch = scratch
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.programs: dict[tuple[str, int, int, int | None], Program] = {}
        # kinds x lengths (a listening group's first window, the steady one) x buckets x layouts
        self.max_programs = 4 * sum(len(window_starts(b, scratch)) + 1 for b in self.buckets)
        self.use_graphs = use_graphs  # False replays nothing (eager), e.g. to compare

    def get(self, kind: str, positions: int, rows: BatchRows) -> Program:
        key = (kind, positions, rows.size, rows.start)
        prog = self.programs.get(key)
        if prog is None:
            if len(self.programs) >= self.max_programs:
                raise RuntimeError(f"unexpected program shape {key}")
            prog = self._new(kind, positions, rows)
            self.programs[key] = prog
        return prog

    def _new(self, kind: str, positions: int, rows: BatchRows) -> Program:
        b, dev, t = rows.size, self.device, self.rules.tok
        model, rules, rule_rows = self.model, self.rules, self.rule_rows
        h = model.embed_tokens.weight.shape[1]
        # Valid defaults (padding values) so that a capture's warm-up computes something sane.
        row_t = torch.tensor(rows.rows, device=dev)
        audio = torch.zeros((b, positions, h), dtype=self.dtype, device=dev)
        audio_idx = torch.full((b, positions), -1, dtype=torch.long, device=dev)
        cache_rows = row_t if rows.start is None else slice(rows.start, rows.start + b)
        if kind == "listen":
            pads = torch.tensor([t.text_pad, t.stoken_pad, t.sleep], device=dev)
            lb = ListenBuffers(tokens=pads[None, :, None].repeat(b, 1, positions).contiguous(), audio=audio,
                               audio_idx=audio_idx, pos=torch.arange(positions, device=dev).repeat(b, 1),
                               rows=row_t)

            def listen() -> tuple[Tensor, Tensor]:
                return listen_window(model, rules, lb.tokens[:, 0], lb.tokens[:, 1], lb.tokens[:, 2], lb.audio,
                                     lb.pos, cache_rows)

            return Program(kind, rows, lb, StaticProgram(listen))
        r = rules.speech_slice.stop - rules.speech_slice.start
        sb = SpeakBuffers(
            pending=torch.tensor([[t.text_pad, t.stoken_pad, t.sleep]] * b, device=dev), audio=audio,
            audio_idx=audio_idx, base_pos=torch.zeros((b, 1), dtype=torch.long, device=dev),
            hist_len=torch.zeros(b, dtype=torch.long, device=dev), rows=row_t,
            temperature=torch.zeros(b, dtype=torch.float32, device=dev),
            noise=torch.full((b, CHUNK, r), 0.5, dtype=torch.float32, device=dev))

        def speak() -> tuple[Tensor, Tensor]:
            return speak_window(model, rules, rule_rows, sb.pending, sb.audio, sb.base_pos, sb.hist_len, sb.rows,
                                cache_rows, sb.temperature, sb.noise)

        return Program(kind, rows, sb, StaticProgram(speak))

    def capture(self) -> None:
        """Capture the steady-state programs of every bucket as CUDA graphs (largest first, one
        memory pool), then clear the rows their warm-up runs wrote. Only before any slot is open.
        A listening group's first window (9 positions, once per conversation) stays eager."""
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            layouts = [BatchRows(tuple(range(s, s + b)), (), s) for s in window_starts(b, self.scratch)]
            for rows in layouts + [BatchRows((self.scratch,) * b, (), None)]:
                for kind in ("speak", "listen"):
                    with torch.no_grad():
                        self.get(kind, CHUNK, rows).run.capture(pool)
        # The slot rows and the scratch row now hold warm-up values: clear them for their owners.
        self.model.reset_rows(list(range(self.scratch + 1)))
        self.rule_rows.reset(slice(None), self.rules.tok.stoken_pad)
        log.info("captured %d CUDA graphs (buckets %s)", len(self.programs), list(self.buckets))

    def run(self, prog: Program, feats: Tensor, rows: BatchRows) -> list[Tensor]:
        """Fill the audio channel, run (or replay) the program, keep the real rows (in slot order)."""
        buf = prog.buffers
        pad = self.model.embed_tokens.weight[self.rules.tok.audio_pad]
        picked = feats[buf.audio_idx.clamp(min=0)].to(pad.dtype)
        buf.audio.copy_(torch.where((buf.audio_idx >= 0)[..., None], picked, pad))
        out = prog.run() if self.use_graphs else prog.run.fn()
        # Graph outputs are overwritten by the next replay: copy the real rows out.
        real = list(rows.real)
        return [out[0][real], out[1][real]]  # indexing copies
