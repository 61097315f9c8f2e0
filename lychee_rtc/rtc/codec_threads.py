"""aiortc's audio encoders and decoders, without FFmpeg worker threads.

aiortc opens its FFmpeg codec contexts and its encoders' resamplers with FFmpeg's default thread
count, one per CPU, for each call, and PyAV's audio encoder adds a resampler of its own (frame
sizing) that nobody can configure: a handful of idle threads per session on a laptop, hundreds on
a large GPU host. Audio at 20 ms frames needs none of them. ``limit_codec_threads``, once per
process:

* tells libavutil that the machine has one CPU (``av_cpu_force_count``), which is what FFmpeg's
  "automatic" thread counts are derived from - this covers the resamplers PyAV creates internally;
* wraps aiortc's codec factories so each new encoder/decoder has a single-threaded codec context
  and a ``FrameResampler`` (same interface, no worker thread, freed with the encoder), and each
  audio encoder packetizes at its track's frame length (``packet_time``).

The server does no video encoding, so nothing here needs FFmpeg's threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
from typing import Any, Callable

import av

from lychee_rtc.pcm import RESAMPLER_THREADS, FrameResampler
from lychee_rtc.rtc.packet_time import frame_by_track

log = logging.getLogger(__name__)


def _limit(coder: Any) -> Any:
    context = getattr(coder, "codec", None)
    if isinstance(context, av.CodecContext) and not context.is_open:
        context.thread_count = RESAMPLER_THREADS  # read when the context opens, at its first frame
    resampler = getattr(coder, "resampler", None)
    if isinstance(resampler, av.AudioResampler) and resampler.format is not None and resampler.layout is not None:
        coder.resampler = FrameResampler(resampler.format.name, resampler.layout.name, resampler.rate,
                                         resampler.frame_size)
    return coder


def _wrapped(factory: Callable[[Any], Any], encoders: bool) -> Callable[[Any], Any]:
    def make(codec: Any) -> Any:
        coder = _limit(factory(codec))
        # An audio encoder also takes its packet time from the track (rtc/packet_time.py).
        return frame_by_track(coder) if encoders and getattr(codec, "mimeType", "").startswith("audio/") else coder

    make.limits_threads = True  # type: ignore[attr-defined]
    return make


def _libavutil() -> ctypes.CDLL | None:
    # PyAV's wheels bundle FFmpeg next to the package; a source build links the system's.
    bundled = sorted(glob.glob(os.path.join(os.path.dirname(av.__file__) + ".libs", "libavutil*.so*")))
    path = bundled[0] if bundled else ctypes.util.find_library("avutil")
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def force_ffmpeg_cpu_count(count: int) -> bool:
    lib = _libavutil()
    if lib is None or not hasattr(lib, "av_cpu_force_count"):
        log.warning("libavutil not found: FFmpeg keeps one thread per CPU for its automatic thread counts")
        return False
    lib.av_cpu_force_count(ctypes.c_int(count))
    return True


_limited = False


def limit_codec_threads() -> None:
    """Idempotent, process-wide: aiortc's codec factories hand out thread-limited coders."""
    global _limited
    if _limited:
        return
    _limited = True
    force_ffmpeg_cpu_count(RESAMPLER_THREADS)
    import aiortc.rtcrtpreceiver as receiver
    import aiortc.rtcrtpsender as sender

    for module, name in ((sender, "get_encoder"), (receiver, "get_decoder")):
        encoders = name == "get_encoder"
        factory = getattr(module, name, None)
        if factory is None:
            log.warning("aiortc has no %s.%s: its codecs keep FFmpeg's default threads", module.__name__, name)
            continue
        if not getattr(factory, "limits_threads", False):
            setattr(module, name, _wrapped(factory, encoders))
