"""Threads per session: resamplers start no FFmpeg worker threads and are freed when a call ends."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import warnings

import av
import numpy as np
import pytest
from av.filter import Graph

from lychee_rtc.bench.client import RtcClient
from lychee_rtc.pcm import FrameResampler, PcmResampler


def os_threads() -> int:
    """Every thread of the process, FFmpeg's native ones included (threading.active_count misses those)."""
    return len(os.listdir("/proc/self/task"))


def native_threads() -> int:
    """Threads Python did not start: FFmpeg's, onnxruntime's, ..."""
    return os_threads() - threading.active_count()


def decoder_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "audio-decoder")  # aiortc: one per receiver


def frame48k() -> av.AudioFrame:
    f = av.AudioFrame.from_ndarray(np.zeros((1, 960), np.int16), format="s16", layout="mono")
    f.sample_rate, f.pts = 48000, 0
    return f


def filter_graphs() -> int:
    """FFmpeg filter graphs alive in this process (each resampler builds one on its first frame)."""
    # isinstance() on every live object also touches torch's deprecated module aliases, which warn.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, Graph))


def test_resamplers_start_no_threads_and_close_frees_them():
    gc.collect()
    gc.disable()  # close() must free the graphs by itself, not leave them to the collector
    try:
        before_threads, before_graphs = os_threads(), filter_graphs()
        resamplers = [FrameResampler("flt", "mono", 16000) for _ in range(8)]
        for r in resamplers:
            assert len(np.concatenate([f.to_ndarray().reshape(-1) for f in r.resample(frame48k())])) > 0
        pcm = [PcmResampler(16000, 48000) for _ in range(8)]
        for r in pcm:
            assert len(r.process(np.ones(1600, np.float32))) > 0
        assert os_threads() == before_threads
        assert filter_graphs() == before_graphs + 16
        for r in resamplers:
            r.close()
        for r in pcm:
            r.close()
        assert filter_graphs() == before_graphs
        assert os_threads() == before_threads
    finally:
        gc.enable()
    for closed in resamplers:  # a closed resampler says so instead of building a new graph
        with pytest.raises(ValueError, match="closed"):
            closed.resample(frame48k())
    with pytest.raises(ValueError, match="closed"):
        pcm[0].process(np.ones(160, np.float32))


async def test_live_sessions_add_no_threads_and_ended_ones_leave_none(echo_server, utterance):
    url, _ = echo_server
    warm = RtcClient(url)  # the engine's worker thread and the loop's executor start with the first call
    await warm.connect()
    await warm.close()
    gc.collect()
    gc.disable()  # what is freed must be freed without the collector
    try:
        baseline = native_threads()
        clients = [RtcClient(url) for _ in range(3)]
        for c in clients:
            await c.connect()
            c.mic.feed(np.zeros(24000, np.float32))
            c.mic.feed(utterance)
        for c in clients:  # a response means every resampler and codec (both ends) is in use
            await c.wait_event("output_audio_buffer.started", timeout=60)
        during = native_threads()
        assert decoder_threads() == 6  # aiortc's own, server and client side: the only per-call threads
        for c in clients:
            await c.close()
        for _ in range(200):
            if native_threads() <= baseline and decoder_threads() == 0:
                break
            await asyncio.sleep(0.05)
        after, decoders = native_threads(), decoder_threads()
    finally:
        gc.enable()
    assert during <= baseline, f"{during - baseline} native threads for 3 live calls"
    assert after <= baseline and decoders == 0
