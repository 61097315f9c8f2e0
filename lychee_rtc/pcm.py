"""PCM helpers shared by every layer (media, engines, vocoder, tools): resampling and WAV files.

Stateful mono resampling uses PyAV (libswresample). One ``PcmResampler`` per continuous stream:
its filter state carries across calls so chunk boundaries are inaudible, and a new stream (a new
response, a new epoch) gets a new resampler so no filter history from old audio can leak into it.

Resamplers are ``FrameResampler``s, not PyAV's ``AudioResampler``: that one builds an FFmpeg filter
graph with one worker thread per CPU (hundreds on a large GPU host, per resampler, per session),
while resampling one mono stream needs none. ``close()`` frees the graph at once instead of
whenever the garbage collector breaks the cycles a finished session leaves.
"""

from __future__ import annotations

import wave
from errno import EAGAIN
from pathlib import Path

import av
import numpy as np
from av.filter import Graph
from av.filter.context import FilterContext

# Filter-graph worker threads per resampler (FFmpeg's default, 0, means one per CPU).
RESAMPLER_THREADS = 1


class FrameResampler:
    """Converts audio frames to one format/layout/rate, set up from the first frame it is given."""

    def __init__(self, format: str = "flt", layout: str = "mono", rate: int = 16000, frame_size: int = 0) -> None:
        self.format = format
        self.layout = layout
        self.rate = rate
        self.frame_size = frame_size  # samples per output frame (0: as they come)
        self._graph: Graph | None = None
        self._sink: FilterContext | None = None
        self._source: tuple | None = None  # (format, layout, rate) the graph was built for
        self._closed = False

    def resample(self, frame: av.AudioFrame | None) -> list[av.AudioFrame]:
        """Frames out for ``frame`` in (``None`` flushes the filter's delay line)."""
        if self._closed:
            raise ValueError("resampler is closed")
        if frame is None:
            if self._graph is None:
                return []
            self._graph.push(None)
            return self._drain()
        source = (frame.format.name, frame.layout.name, frame.sample_rate)
        if self._graph is None:
            self._graph = self._build(frame)
            self._source = source
        elif source != self._source:
            raise ValueError(f"frame {source} does not match the resampler's input {self._source}")
        self._graph.push(frame)
        # One frame in makes at most one frame out (none while a resampler's first samples fill its delay
        # line), so one pull: a second would only end in FFmpeg's EAGAIN, which PyAV raises as an
        # exception, about a third of the cost of converting a 20 ms frame. Output frames of a set size
        # are another matter: a frame in may complete several.
        return self._drain(at_most=None if self.frame_size > 0 else 1)

    def close(self) -> None:
        self._graph = None
        self._sink = None
        self._closed = True

    def _build(self, frame: av.AudioFrame) -> Graph:
        graph = Graph()
        graph.threads = RESAMPLER_THREADS  # before any filter is added, or FFmpeg ignores it
        extra = {"time_base": str(frame.time_base)} if frame.time_base is not None else {}
        source = graph.add("abuffer", sample_rate=str(frame.sample_rate), sample_fmt=frame.format.name,
                           channel_layout=frame.layout.name, **extra)
        convert = graph.add("aformat", sample_rates=str(self.rate), sample_fmts=self.format,
                            channel_layouts=self.layout)
        sink = graph.add("abuffersink")
        source.link_to(convert)
        convert.link_to(sink)
        graph.configure()
        self._sink = sink
        if self.frame_size > 0:
            graph.set_audio_frame_size(self.frame_size)
        return graph

    def _drain(self, at_most: int | None = None) -> list[av.AudioFrame]:
        """What the filter has ready, up to ``at_most`` frames."""
        assert self._sink is not None
        out: list[av.AudioFrame] = []
        while at_most is None or len(out) < at_most:
            try:
                out.append(self._sink.pull())
            except EOFError:
                break
            except av.FFmpegError as exc:
                if exc.errno != EAGAIN:
                    raise
                break
        return out


class PcmResampler:
    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._passthrough = in_rate == out_rate
        self._resampler = None if self._passthrough else FrameResampler("flt", "mono", out_rate)
        self._pts = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.ascontiguousarray(pcm, dtype=np.float32).reshape(-1)
        if self._passthrough or len(pcm) == 0:
            return pcm.copy()
        if self._resampler is None:
            raise ValueError("resampler is closed")
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="flt", layout="mono")
        frame.sample_rate = self.in_rate
        frame.pts = self._pts
        self._pts += len(pcm)
        return frames_to_array(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        """Drain the filter's delay line and free the filter; the resampler cannot be used afterwards."""
        if self._passthrough or self._pts == 0 or self._resampler is None:
            self.close()
            return np.zeros(0, dtype=np.float32)
        out = frames_to_array(self._resampler.resample(None))
        self.close()
        return out

    def close(self) -> None:
        if self._resampler is not None:
            self._resampler.close()
            self._resampler = None


def frames_to_array(frames: list[av.AudioFrame]) -> np.ndarray:
    """Mono float frames (as a ``flt``/``mono`` resampler yields them) as one float32 array."""
    if not frames:
        return np.zeros(0, dtype=np.float32)
    if len(frames) == 1:  # the usual case: one frame in, one out
        return frames[0].to_ndarray().reshape(-1).astype(np.float32, copy=False)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32, copy=False)


def write_wav(path: str | Path, samples: np.ndarray, rate: int) -> Path:
    """Mono float samples in [-1, 1] as a 16-bit PCM WAV file."""
    pcm = (np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767).astype("<i2")
    path = Path(path)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path
