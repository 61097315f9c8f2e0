"""What a session needs from the stage that cleans its uplink before the engine hears it.

The stage itself (WebRTC's audio processing: echo cancellation, noise suppression, high-pass filter,
gain control) lives in ``media/audio_processing.py``; the transports feed it what they played. The
session only routes its uplink through it and changes its settings (``session.update``).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from lychee_rtc.config import AudioProcessing


class ProcessingUnavailable(Exception):
    """Processing was asked for and this server cannot do it (the optional library is missing)."""


class UplinkProcessing(Protocol):
    @property
    def settings(self) -> AudioProcessing: ...

    def describe(self) -> dict[str, Any]:
        """What is active, for the session's events."""

    def snapshot(self) -> dict[str, Any]:
        """``describe`` and the stage's counters, for an operator's view of the session."""

    def configure(self, settings: AudioProcessing) -> np.ndarray:
        """Switch stages on or off; returns the audio it still held (to hand on before what follows).
        Raises ProcessingUnavailable if a stage is asked for and cannot run."""

    def process(self, samples: np.ndarray) -> np.ndarray:
        """Uplink audio arrived: the processed audio ready so far (it may hold back < 10 ms)."""

    def take_revision(self) -> np.ndarray:
        """Audio that replaces the end of what ``process``/``process_gap`` returned before the last call
        (empty if none): to go where the engine has not heard it yet, before that call's output."""

    def process_gap(self, fill: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lost uplink time, concealed by ``fill``: (audio held before it, the processed fill), each
        exactly as long as what came in, so the gap keeps its place on the uplink."""

    def close(self) -> None:
        """The session has ended: free the processing state now."""
