"""What a session counts, and the hooks through which the server's metrics watch it."""

from __future__ import annotations

from dataclasses import dataclass

from lychee_rtc.engine.base import WindowTiming


@dataclass
class SessionCounters:
    messages_in: int = 0
    bad_messages: int = 0
    rate_limited_messages: int = 0
    stale_engine_events: int = 0
    stale_audio_chunks: int = 0
    interruptions: int = 0
    input_samples: int = 0
    dtmf_digits: int = 0


class SessionObserver:
    """Hooks for metrics; the server installs one, tests may ignore it."""

    def window_timing(self, timing: WindowTiming) -> None: ...
    def interruption(self, handling_s: float, since_speech_s: float | None) -> None: ...
    def stale_chunk(self) -> None: ...
    def first_audio(self, seconds: float) -> None: ...
