"""The flow's per-hop Euler solve (10 DiT evaluations, ~5,000 kernels) as CUDA graphs.

The solve is a pure function of its tensors (noise, mu, speaker, condition, the estimator caches and
their key mask), so it can be captured whenever a shape repeats, while serving, without touching any
stream's state. Shapes repeat in the steady state: a hop adds the same number of mel frames and the
estimator cache is trimmed back to ``P + 100`` frames each hop (``cfm.trim_estimator_cache``), so a
fixed set of streams keeps one signature hop after hop. A signature gets a graph the second time it
is seen (the first hops of a response and the prompt priming stay eager), the graphs are kept in a
small LRU, and inputs are copied into the graph's buffers and outputs copied out of them, so callers
own what they get back. Elsewhere (CPU, switch off) the solve runs eagerly.

HiFT is left eager: it is a few dozen convolutions per hop, and a hop's length changes at a
response's end; measure before capturing it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch

Signature = tuple

MODES = ("auto", "on", "off")


def signature(args: Sequence[torch.Tensor | None]) -> Signature:
    return tuple(None if a is None else (tuple(a.shape), a.dtype, a.device) for a in args)


class _Captured:
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], args: Sequence[torch.Tensor | None]):
        self.inputs = [None if a is None else a.clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.inputs)  # warm-up: cuBLAS workspaces, lazy initialisation
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads may use CUDA (e.g. preparing a voice) while this one captures
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs)

    def __call__(self, args: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        for dst, src in zip(self.inputs, args):
            if dst is not None:
                dst.copy_(src)
        self.graph.replay()
        return tuple(o.clone() for o in self.outputs)


class GraphedSolve:
    """Replays ``fn`` from CUDA graphs keyed by the input signature; eager for anything not on CUDA."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], max_graphs: int = 4, capture_after: int = 2,
                 max_tracked: int = 64):
        if max_graphs < 1 or capture_after < 1:
            raise ValueError("max_graphs and capture_after must be >= 1")
        self.fn = fn
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self.max_tracked = max_tracked
        self.graphs: OrderedDict[Signature, _Captured] = OrderedDict()
        self.seen: OrderedDict[Signature, int] = OrderedDict()
        self.replays = 0
        self.captures = 0

    def __call__(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if not any(a is not None and a.is_cuda for a in args):
            return self.fn(*args)
        key = signature(args)
        captured = self.graphs.get(key)
        if captured is None:
            count = self.seen.pop(key, 0) + 1
            self.seen[key] = count
            while len(self.seen) > self.max_tracked:
                self.seen.popitem(last=False)
            if count < self.capture_after:
                return self.fn(*args)
            if len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)  # the least recently replayed shape
            captured = self.graphs[key] = _Captured(self.fn, args)
            self.captures += 1
        self.graphs.move_to_end(key)
        self.replays += 1
        return captured(args)


def use_cuda_graphs(mode: str, device: torch.device) -> bool:
    """The vocoder's ``cuda_graphs`` switch: auto = on CUDA only; on = CUDA required; off = eager."""
    if mode not in MODES:
        raise ValueError(f"cuda_graphs must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "on" and device.type != "cuda":
        raise ValueError(f"cuda_graphs: on needs a CUDA device, the vocoder is on {device}")
    return mode != "off" and device.type == "cuda"
