"""The recording's writer thread: places what the call sends it, encodes Ogg/Opus, writes the sidecar.

Everything slow happens here, off the event loop: resampling, placement, encoding, file writes. The
loop only puts small items on a bounded queue (``recorder.CallRecorder``). Audio is written out
``LATENCY_S`` behind real time, which is how long a chunk may arrive after its place on the clock
and still be recorded; it is encoded in ``BLOCK_FRAMES`` blocks, the Ogg muxer closes a page every
``PAGE_S`` and each page is handed to the kernel at once. So a process killed at any moment leaves
a file that plays up to ``LATENCY_S`` + a block + a page + the thread's wake-up (0.44 s at most)
before the kill (docs/benchmarks.md has what was measured after SIGKILL).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import av
import numpy as np

from lychee_rtc.media.recording.timeline import CHANNELS, RATE, ChannelPlacer, MixBuffer, PlacementCounters

log = logging.getLogger(__name__)

# A WebRTC frame sent up to 0.2 s late (rtc.outbound's catch-up bound) and a caller chunk placed by
# its least-delayed arrival (up to timeline.TOLERANCE_S before its own) still find their place.
LATENCY_S = 0.25
# An Ogg page (27 bytes and a lacing byte a packet) every 50 ms: 4.6 kbit/s on the 32 of the audio.
PAGE_S = 0.05
# Items taken off the queue before writing out: the backlog first, so none of it arrives late.
DRAIN_ITEMS = 500
POLL_S = 0.05  # how often the thread takes what the loop queued and looks at the clock (well within LATENCY_S)
FRAME = RATE // 50  # Opus's 20 ms: written out in whole frames
# Encoded in blocks of this many frames (40 ms): each block shifts the placement buffer once.
BLOCK_FRAMES = 2
BUFFER_S = 4.0  # how far ahead of what is written a chunk may be placed


@dataclass
class WriterCounters(PlacementCounters):
    items_dropped: int = 0  # the queue was full: the loop dropped them rather than wait
    audio_bytes: int = 0
    events_written: int = 0
    encoded_samples: int = 0
    cpu_s: float = 0.0  # the writer thread's own CPU time, when it has finished


@dataclass
class WriterState:
    status: str = "recording"  # recording | complete | failed
    error: str | None = None
    counters: WriterCounters = field(default_factory=WriterCounters)
    # What the stamps took out to keep the caller's time (the recorder's; written to the meta).
    alignment: dict[str, Any] = field(default_factory=dict)


class RecordingWriter(threading.Thread):
    """Owns the files of one recording from ``start`` until it has written the last page."""

    def __init__(self, audio_path: Path, events_path: Path, t0: float, bitrate: int, max_queue: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_done: Callable[[WriterState], None] | None = None,
                 prepare: Callable[[], None] | None = None, complexity: int = 5) -> None:
        super().__init__(name=f"recording-{audio_path.parent.name}", daemon=True)
        self.audio_path = audio_path
        self.events_path = events_path
        self.t0 = t0
        self.bitrate = bitrate
        self.complexity = complexity
        self.clock = clock
        self.state = WriterState()
        self.queue: queue.Queue[tuple] = queue.Queue(max_queue)
        self._on_done = on_done
        self._prepare = prepare  # run first on the thread (the folder and its meta): no disk I/O on the loop
        self._buffer = MixBuffer(int(BUFFER_S * RATE), self.state.counters)
        self._placers = [ChannelPlacer(i, self.state.counters) for i in range(len(CHANNELS))]
        self._audio_file: BinaryIO | None = None
        self._events_file: Any = None
        self._container: Any = None
        self._stream: Any = None
        self._close_at: float | None = None

    # --- the loop's side ---------------------------------------------------------------------------

    def submit(self, item: tuple) -> bool:
        try:
            self.queue.put_nowait(item)
            return True
        except queue.Full:
            self.state.counters.items_dropped += 1
            return False

    def finish(self, at: float) -> None:
        """Write out what is left and close the files. Never waits: a flag, and a wake-up if there is room."""
        self._close_at = at
        try:
            self.queue.put_nowait(("wake",))
        except queue.Full:
            pass  # the thread is busy with the queue and sees the flag after its next item

    # --- the thread ----------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._open()
            while True:
                # Sleep, then take what came: a writer blocked in get() is woken by every item the
                # loop puts (100 a second per call), each wake-up a thread switch and a GIL hand-off
                # that cost the event loop more than the tap itself.
                time.sleep(POLL_S)
                try:
                    for _ in range(DRAIN_ITEMS):
                        self._handle(self.queue.get_nowait())
                except queue.Empty:
                    pass
                if self._close_at is not None:
                    self._close(self._close_at)
                    break
                self._write_until(self.clock() - LATENCY_S)
        except Exception as exc:  # a full disk, a vanished directory: the call goes on unrecorded
            self._fail(exc)
            self._drain_after_failure()
        finally:
            self._release()
            self.state.counters.cpu_s = time.thread_time()
            if self._on_done is not None:
                try:
                    self._on_done(self.state)
                except Exception:
                    log.exception("recording %s: completion hook failed", self.audio_path.parent.name)

    def _open(self) -> None:
        if self._prepare is not None:
            self._prepare()
        self._audio_file = open(self.audio_path, "wb")
        self._events_file = open(self.events_path, "w", encoding="utf-8")
        # flush_packets hands every finished page to the kernel at once: a SIGKILL loses nothing written.
        self._container = av.open(self._audio_file, "w", format="ogg",
                                  container_options={"page_duration": str(int(PAGE_S * 1e6)), "flush_packets": "1"})
        # Below complexity 7 libopus leaves out the analysis its free VBR steers by and overshoots the
        # bitrate by half; constrained VBR keeps it (and the recording's size) where it is set.
        self._stream = self._container.add_stream(
            "libopus", rate=RATE, layout="stereo",
            options={"compression_level": str(self.complexity), "vbr": "constrained"})
        self._stream.bit_rate = self.bitrate

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "audio":
            _, channel, at, samples, rate = item
            self._placers[channel].push(self._buffer, at - self.t0, samples, rate)
        elif kind == "shift":
            _, channel, by = item
            self._placers[channel].shift(self._buffer, by)
        elif kind == "cut":
            _, channel, at = item
            self._placers[channel].cut(self._buffer, at - self.t0)
        elif kind == "line":
            _, text = item
            self._events_file.write(text + "\n")
            self._events_file.flush()
            self.state.counters.events_written += 1

    def _write_until(self, until: float) -> None:
        target = round((until - self.t0) * RATE)
        block = FRAME * BLOCK_FRAMES
        for placer in self._placers:  # what the next looks may write, with a look to spare
            placer.settle(self._buffer, target + block + round(2 * POLL_S * RATE))
        n = (target - self._buffer.base) // block * block
        if n > 0:
            self._encode(self._buffer.take(self._buffer.base + n))

    def _encode(self, block: np.ndarray | None) -> None:
        frames = [None] if block is None else [self._frame(block)]
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        self._audio_file.flush()
        self.state.counters.audio_bytes = self._audio_file.tell()
        if block is not None:
            self.state.counters.encoded_samples += len(block)

    def _frame(self, block: np.ndarray) -> av.AudioFrame:
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(np.clip(block, -1.0, 1.0)).reshape(1, -1),
                                           format="flt", layout="stereo")
        frame.sample_rate = RATE
        frame.pts = self._buffer.base - len(block)
        return frame

    def _close(self, at: float) -> None:
        while not self.queue.empty():  # what the call sent before it closed
            self._handle(self.queue.get_nowait())
        for placer in self._placers:
            placer.close(self._buffer)
        end = max(round((at - self.t0) * RATE), self._buffer.end)
        while self._buffer.base < end:
            self._encode(self._buffer.take(min(end, self._buffer.base + self._buffer.capacity)))
        self._encode(None)
        self._container.close()
        self._container = None
        self.state.counters.audio_bytes = self._audio_file.tell()
        self.state.status = "complete"

    def _fail(self, exc: BaseException) -> None:
        self.state.status = "failed"
        self.state.error = f"{type(exc).__name__}: {exc}"
        log.error("recording %s failed, the call goes on unrecorded: %s", self.audio_path.parent.name,
                  self.state.error)

    def _drain_after_failure(self) -> None:
        """Keep taking (and dropping) items until the call closes, so the loop never finds a full queue."""
        while self._close_at is None:
            try:
                self.queue.get(timeout=0.2)
            except queue.Empty:
                pass

    def _release(self) -> None:
        for placer in self._placers:
            placer.close(MixBuffer(1, PlacementCounters()))
        if self._container is not None:
            try:
                self._container.close()
            except Exception:
                pass
        for f in (self._audio_file, self._events_file):
            if f is not None:
                try:
                    f.close()
                except Exception:
                    pass
