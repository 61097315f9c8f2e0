"""Static batch shapes for the window step, and CUDA graphs of it.

A window's work for a group of slots runs on fixed device buffers: the group is padded to a batch
*bucket* (1, 2, 4, 8, ... up to ``max_sessions``), its tokens, positions, cache rows and noise are
copied into that bucket's buffers, and one function of those buffers computes the window. On a CPU
the function runs eagerly; on CUDA it is captured once as a ``torch.cuda.CUDAGraph`` and replayed,
so a speaking window's ten decode steps (about 7,000 kernels at full size) cost one launch. The
eager and the graph path run the same code on the same buffers; only capture/replay is CUDA-only.
:class:`WindowPrograms` is a runner's cache of these programs (one per kind, length and bucket),
built from the decode functions of ``decode.py``.

Padding rows must never touch a live session's caches. They use the rows right after the batch
when those rows belong to no open slot (the batch is then cache rows ``0..b-1`` and attention reads
the caches as views, the fast path), else one *scratch* row (index ``max_sessions``) that no slot
owns; several padding rows may write it at once, and whatever ends up there is never read by a real
row.

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
    rows: tuple[int, ...]  # the cache row of every batch row: the real slots first, then padding
    contiguous: bool  # rows == 0..b-1: the caches are read as views instead of gathered

    @property
    def size(self) -> int:
        return len(self.rows)


def batch_rows(slots: Sequence[int], bucket: int, busy: Collection[int], scratch: int) -> BatchRows:
    """Cache rows for the real ``slots`` padded to ``bucket`` rows.

    ``busy`` holds every open slot (whose rows padding must not touch); ``scratch`` is the row that
    belongs to nobody.
    """
    n = len(slots)
    if n > bucket:
        raise ValueError(f"{n} slots do not fit a bucket of {bucket}")
    if list(slots) == list(range(n)) and not any(r in busy for r in range(n, bucket)):
        return BatchRows(tuple(range(bucket)), True)
    return BatchRows(tuple(slots) + (scratch,) * (bucket - n), False)


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
    """The listening and speaking programs of one runner, keyed by (kind, positions, bucket, contiguous).

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
        self.programs: dict[tuple[str, int, int, bool], Program] = {}
        self.use_graphs = use_graphs  # False replays nothing (eager), e.g. to compare

    def get(self, kind: str, positions: int, rows: BatchRows) -> Program:
        key = (kind, positions, rows.size, rows.contiguous)
        prog = self.programs.get(key)
        if prog is None:
            if len(self.programs) >= 8 * len(self.buckets):  # bounded: kinds x lengths x buckets x 2
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
        cache_rows = None if rows.contiguous else row_t
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
            for contiguous in (True, False):
                rows = BatchRows(tuple(range(b)) if contiguous else (self.scratch,) * b, contiguous)
                for kind in ("speak", "listen"):
                    with torch.no_grad():
                        self.get(kind, CHUNK, rows).run.capture(pool)
        # Rows 0..b-1 and the scratch row now hold warm-up values: clear them for their owners.
        self.model.reset_rows(list(range(self.scratch + 1)))
        self.rule_rows.reset(slice(None), self.rules.tok.stoken_pad)
        log.info("captured %d CUDA graphs (buckets %s)", len(self.programs), list(self.buckets))

    def run(self, prog: Program, feats: Tensor, n: int) -> list[Tensor]:
        """Fill the audio channel, run (or replay) the program, keep the first ``n`` rows."""
        buf = prog.buffers
        pad = self.model.embed_tokens.weight[self.rules.tok.audio_pad]
        picked = feats[buf.audio_idx.clamp(min=0)].to(pad.dtype)
        buf.audio.copy_(torch.where((buf.audio_idx >= 0)[..., None], picked, pad))
        out = prog.run() if self.use_graphs else prog.run.fn()
        # Graph outputs are overwritten by the next replay: copy the real rows out.
        return [out[0][:n].clone(), out[1][:n].clone()]
