"""Prometheus metrics of calls and their sessions, in a registry owned by the application (no
process-global state): the call registry counts and folds into it, sessions report through it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lychee_rtc.engine.base import WindowTiming
from lychee_rtc.session.observer import SessionObserver

# Step-time buckets around the 400 ms window deadline.
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.8, 1.2, 2.0)


class CallMetrics(SessionObserver):
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Memory, threads' CPU and open fds of this process (process_*), for long-running servers.
        ProcessCollector(registry=r)
        self.active_sessions = Gauge("lychee_rtc_active_sessions", "Sessions with an engine slot", registry=r)
        self.sessions_total = Counter("lychee_rtc_sessions_total", "Sessions created", registry=r)
        self.sessions_refused = Counter("lychee_rtc_sessions_refused_total", "Offers refused: capacity full", registry=r)
        # By close reason: the server's own fixed vocabulary (session.closed's reasons), never an id.
        self.sessions_closed = Counter("lychee_rtc_sessions_closed_total", "Sessions ended, by reason", ["reason"],
                                       registry=r)
        self.sessions_resumed = Counter("lychee_rtc_sessions_resumed_total",
                                        "Sessions re-attached to a new connection after losing theirs", registry=r)
        self.windows = Counter("lychee_rtc_windows_total", "Engine windows processed", registry=r)
        self.step_seconds = Histogram("lychee_rtc_engine_step_seconds",
                                      "Batched engine step time (deadline: one window)", buckets=STEP_BUCKETS,
                                      registry=r)
        self.queue_wait_seconds = Histogram("lychee_rtc_engine_queue_wait_seconds",
                                            "Time a window waited for its step", buckets=STEP_BUCKETS, registry=r)
        self.first_audio_seconds = Histogram("lychee_rtc_time_to_first_audio_seconds",
                                             "Response start to its first PCM chunk", buckets=STEP_BUCKETS,
                                             registry=r)
        self.stale_chunks = Counter("lychee_rtc_stale_chunks_dropped_total",
                                    "Audio chunks of an old epoch dropped", registry=r)
        self.barge_in_seconds = Histogram("lychee_rtc_barge_in_seconds",
                                          "User speech onset (uplink time) to the playout cut, for barge-ins",
                                          buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0), registry=r)
        self.interrupt_seconds = Histogram("lychee_rtc_interrupt_handling_seconds",
                                           "Time to execute an interruption (epoch bump, cut, events)",
                                           buckets=(1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2), registry=r)
        # Per-session counters are folded in when a session ends and sampled live by the collector.
        self.underrun_windows = Counter("lychee_rtc_window_underruns_total",
                                        "Windows completed with silence because the uplink was late", registry=r)
        self.late_samples = Counter("lychee_rtc_late_samples_total", "Uplink samples dropped as late", registry=r)
        self.gap_samples = Counter("lychee_rtc_gap_samples_total", "Uplink samples lost (filled)", registry=r)
        self.overload_windows = Counter("lychee_rtc_windows_dropped_total",
                                        "Windows dropped because the engine was behind", registry=r)
        self.playout_underrun_samples = Counter("lychee_rtc_playout_underrun_samples_total",
                                                "Silence played in the middle of a response", registry=r)
        # Sampled per session on each watchdog tick; no session ids in labels (they are not public).
        self.playout_depth = Histogram("lychee_rtc_playout_buffer_depth_seconds", "Queued output audio, sampled",
                                       buckets=(0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 30.0),
                                       registry=r)

    def window_timing(self, timing: WindowTiming) -> None:
        self.windows.inc()
        self.step_seconds.observe(timing.step_ms / 1000.0)
        self.queue_wait_seconds.observe(timing.queue_wait_ms / 1000.0)

    def interruption(self, handling_s: float, since_speech_s: float | None) -> None:
        self.interrupt_seconds.observe(handling_s)
        if since_speech_s is not None:
            self.barge_in_seconds.observe(since_speech_s)

    def stale_chunk(self) -> None:
        self.stale_chunks.inc()

    def first_audio(self, seconds: float) -> None:
        self.first_audio_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
