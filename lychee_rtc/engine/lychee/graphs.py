"""Static batch shapes for the window step, and CUDA graphs of it.

A window's work for a group of slots runs on fixed device buffers: the group is padded to a batch
*bucket* (1, 2, 4, 8, ... up to ``max_sessions``), its tokens, positions, cache rows and noise are
copied into that bucket's buffers, and one function of those buffers computes the window. On a CPU
the function runs eagerly; on CUDA it is captured once as a ``torch.cuda.CUDAGraph`` and replayed,
so a speaking window's ten decode steps (about 7,000 kernels at full size) cost one launch. The
eager and the graph path run the same code on the same buffers; only capture/replay is CUDA-only.

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

from dataclasses import dataclass
from typing import Callable, Collection, Generic, Sequence, TypeVar

import torch

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
