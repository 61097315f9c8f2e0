"""CPU time of processes and process trees, from /proc, and the codec floor of one call.

CPU seconds a process spent (user + system) over a span are what load costs it whatever else runs on
the machine, unlike wall-clock latency: the figure to size a fleet with. A process tree counts the
process and every descendant alive at the end of the span (a cluster entry's Ray daemons and worker
processes); one that ended inside the span is missed, which a steady span does not have.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def tree(root: int) -> dict[int, float]:
    """CPU seconds of ``root`` and each of its descendants, by pid."""
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            stats[int(name)] = stat
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _) in stats.items():
        children[parent].append(pid)
    out: dict[int, float] = {}
    todo = [root] if root in stats else []
    while todo:
        pid = todo.pop()
        out[pid] = stats[pid][1]
        todo.extend(children[pid])
    return out


@dataclass
class CpuSpan:
    """CPU seconds of some process trees over one span of wall time."""

    roots: list[int]
    _start: dict[int, float] | None = None
    _t0: float = 0.0
    seconds: float = 0.0  # CPU seconds used in the span
    wall_s: float = 0.0

    def start(self) -> None:
        self._start = self._sample()
        self._t0 = time.monotonic()

    def stop(self) -> float:
        """Percent of one core used over the span."""
        assert self._start is not None
        end = self._sample()
        self.wall_s = time.monotonic() - self._t0
        self.seconds = sum(cpu - self._start.get(pid, 0.0) for pid, cpu in end.items())
        return self.percent

    @property
    def percent(self) -> float:
        return 100.0 * self.seconds / self.wall_s if self.wall_s > 0 else 0.0

    def _sample(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for root in self.roots:
            out.update(tree(root))
        return out


@dataclass(frozen=True)
class CodecFloor:
    """One call's codec work as a share of one core: Opus decode of the uplink and encode of the
    downlink, 48 kHz mono, 20 ms frames, with nothing around it."""

    libopus_percent: float  # what this server's media path calls (rtc/opus.py)
    aiortc_percent: float  # aiortc's codecs through PyAV: stereo decode and 96 kb/s stereo encode with their resamplers


def codec_floor(seconds: float = 5.0) -> CodecFloor:
    import fractions

    import av
    from aiortc.codecs.opus import OpusDecoder as AiortcDecoder, OpusEncoder as AiortcEncoder
    from aiortc.jitterbuffer import JitterFrame

    from lychee_rtc.rtc import opus

    rng = np.random.default_rng(7)
    n = int(seconds * 50)
    t = np.arange(960 * n) / 48000
    pcm = (0.2 * np.sin(2 * np.pi * 220 * t) + rng.normal(0, 0.05, len(t))).astype(np.float32)
    pcm16 = (pcm * 32767).astype(np.int16)
    frames = [pcm16[i * 960:(i + 1) * 960] for i in range(n)]
    packets = [p for p in (opus.OpusEncoder(48000, "voip", 32000).encode(f) for f in frames)]

    encoder, decoder = opus.OpusEncoder(48000, "voip", 96000), opus.OpusDecoder(48000)
    t0 = time.thread_time()
    for frame, packet in zip(frames, packets):
        decoder.decode(packet)
        encoder.encode(frame)
    ours = time.thread_time() - t0

    a_encoder, a_decoder = AiortcEncoder(), AiortcDecoder()
    t0 = time.thread_time()
    for i, (frame, packet) in enumerate(zip(frames, packets)):
        a_decoder.decode(JitterFrame(packet, i * 960))
        f = av.AudioFrame.from_ndarray(frame[None, :], format="s16", layout="mono")
        f.sample_rate, f.pts, f.time_base = 48000, i * 960, fractions.Fraction(1, 48000)
        a_encoder.encode(f)
    theirs = time.thread_time() - t0
    return CodecFloor(100.0 * ours / seconds, 100.0 * theirs / seconds)
