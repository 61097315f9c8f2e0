"""Where a call's CPU goes: a sampling profile of the server, summed up by stage of the media path.

``py-spy`` samples every thread of the server process (from outside, without pausing it) over the
measured span. Each sample's stack is read from its innermost frame outwards and counted for the
first stage a frame belongs to; samples whose innermost frame is a wait (the event loop's poll, an
idle worker thread) are not work and are left out. A stage's share of the samples times the
server's measured CPU per call is that stage's CPU per call. Sampling has an error of a few tenths of
a percent of a stage at the sample counts of one span; kernel time inside a system call is counted
in the frame that made it (a UDP send, on loopback, includes delivering it to the receiver).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass

# (stage, patterns of a frame "function (file:line)"), tried from the innermost frame outwards.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("UDP send and receive (kernel)", ("_SelectorDatagramTransport.sendto", "StunProtocol.send_data",
                                       "selector_events.py:1159)", "recvfrom")),
    ("SRTP", ("pylibsrtp/",)),
    ("Opus decode", ("OpusDecoder.decode", "decoder_worker", "PcmDecoder.decode")),
    ("Opus encode", ("OpusEncoder.encode", "PcmEncoder.encode", "OpusEncoder.pack")),
    ("audio level (RFC 6465)", ("compute_audio_level_dbov", "audio_level_dbov")),
    ("resample", ("lychee_rtc/pcm.py", "soxr/")),
    ("echo cancellation", ("media/audio_processing.py", "livekit/")),
    ("recording", ("media/recording/", "calls/recording.py")),
    ("VAD", ("engine/vad.py", "onnxruntime", "torch/")),
    ("thread hand-offs", ("concurrent/futures/", "run_in_executor", "run_coroutine_threadsafe", "threading.py",
                          "queue.py", "_write_to_self", "_read_from_self")),
    ("engine step and hop", ("engine/scheduler.py", "engine/echo.py", "engine/base.py")),
    ("jitter buffer", ("rtc/jitter.py", "aiortc/jitterbuffer.py")),
    ("RTP parse and serialize", ("aiortc/rtp.py", "aiortc/utils.py")),
    ("RTCP", ("_run_rtcp", "_handle_rtcp", "_send_rtcp")),
    ("data channel (SCTP, events)", ("rtcsctptransport.py", "rtcdatachannel.py", "session/event_stream.py",
                                     "session/native.py", "rtc/sctp_guard.py", "crc32c")),
    ("pacing and playout", ("rtc/outbound.py", "media/playout.py", "media/epoch_sink.py", "rtc/send_phase.py",
                            "rtc/inline_encoder.py", "rtc/packet_time.py", "lychee_rtc/aio.py")),
    ("uplink timeline, window clock, session", ("rtc/inbound.py", "media/uplink.py", "media/conceal.py",
                                                "session/")),
    ("aiortc sender and receiver (Python)", ("rtcrtpsender.py", "rtcrtpreceiver.py", "rtc/dtmf.py",
                                             "aiortc/clock.py", "aiortc/codecs/", "mediastreams.py")),
    ("ICE and DTLS routing", ("aioice/", "rtcdtlstransport.py", "rtcicetransport.py", "OpenSSL/",
                              "cryptography/")),
    ("HTTP, signaling, call registry", ("aiohttp/", "lychee_rtc/server/", "lychee_rtc/calls/", "yarl/",
                                        "multidict/")),
    ("Python and asyncio overhead", ("asyncio/", "uvloop", "<frozen", "contextvars")),
)
OTHER = "other"
# Innermost frames that are waits, not work.
IDLE = ("select (selectors.py", "EpollSelector.select", "Condition.wait", "thread.py:81)", "Queue.get (queue.py",
        "run_forever (uvloop", "lock.acquire")


def classify(frames: list[str]) -> str | None:
    """The stage of one sample (innermost frame last); None for a wait."""
    if not frames or any(p in frames[-1] for p in IDLE):
        return None
    for frame in reversed(frames):
        for stage, patterns in STAGES:
            if any(p in frame for p in patterns):
                return stage
    return OTHER


@dataclass
class StageProfile:
    samples: int  # samples of work (waits left out)
    shares: dict[str, float]  # stage -> fraction of the samples

    def per_call(self, cpu_percent_per_call: float) -> dict[str, float]:
        return {stage: share * cpu_percent_per_call for stage, share in self.shares.items()}


def parse_raw(text: str) -> StageProfile:
    """py-spy's raw (collapsed stack) output: ``frame;frame;... count`` per line."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stage = classify(stack.split(";")[1:])  # the first entry names the thread
        if stage is not None:
            counts[stage] += int(count)
    total = sum(counts.values())
    return StageProfile(total, {s: n / total for s, n in counts.most_common()} if total else {})


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.path.exists(beside) else None


async def record(pid: int, seconds: float, rate: int = 200) -> StageProfile:
    """Sample ``pid`` (all its threads) for ``seconds``."""
    exe = py_spy()
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "profile.txt")
        proc = await asyncio.create_subprocess_exec(
            exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
            "--format", "raw", "--threads", "--nonblocking", "--output", out,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}")
        with open(out) as f:
            return parse_raw(f.read())
