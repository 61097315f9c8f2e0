"""What a session needs from its call's recording (implemented in ``calls.recording``).

The session is where concealed uplink audio enters, before any processing of it, so the caller
channel is tapped here (``CallerTap``); the transport's sink taps the agent channel itself. A
client turns recording on or off through ``session.update`` (``RecordingControl``).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from lychee_rtc.session.sink import AudioSink


class CallerTap(Protocol):
    def caller_audio(self, samples: np.ndarray, rate: int) -> None:
        """Caller audio as it enters the session (concealment included), ending now."""


class RecordingControl(Protocol):
    @property
    def tap(self) -> CallerTap | None: ...

    def state(self) -> str:
        """off | recording | paused | failed"""

    def snapshot(self) -> dict[str, Any]:
        """The state and what has been written, for the session's snapshot."""

    def set_recording(self, on: bool, event_id: str | None = None) -> None:
        """Start, pause or resume; raises ProtocolError when the client may not."""

    def rebind(self, sink: AudioSink) -> None:
        """The session plays through a new transport from now on: tap its sink."""
