"""What a session says about itself: its ``session`` object and its state and counters.

A part of ``DuplexSession`` (``session.py``), kept apart: the events and the admin views read it,
nothing in it changes the session.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any


class SessionInfo:
    def describe(self) -> dict[str, Any]:
        caps = self.capabilities
        return {
            "id": self.id,
            "epoch": self.epoch,
            "engine": self.engine_name,
            "voice": self.options.voice,
            "temperature": self.options.temperature,
            "seed": self.options.seed,
            "instructions": self.options.instructions,
            "metrics": self.metrics_enabled,
            "input_audio_format": {"encoding": "pcm_f32le", "sample_rate": caps.input_rate,
                                   "window_samples": caps.window_samples},
            "output_audio_format": {"encoding": "pcm_f32le", "sample_rate": caps.output_rate},
            "capabilities": {k: v for k, v in asdict(caps).items() if k != "name"},
            **({"origin": self.origin} if self.origin else {}),
            **({"audio_processing": self.processing.describe()} if self.processing is not None else {}),
            **({"recording": self.recording.state()} if self.recording is not None else {}),
        }

    def snapshot(self) -> dict[str, Any]:
        """State and counters for GET /v1/sessions."""
        clock = self.window_clock.counters
        slot = self.slot.counters
        return {
            "session_id": self.id,
            **({"origin": self.origin} if self.origin else {}),
            "state": self.state,
            "epoch": self.epoch,
            "engine": self.engine_name,
            **({"audio_processing": self.processing.snapshot()} if self.processing is not None else {}),
            "active_response": self.responses.active,
            "age_s": round(self.clock() - self.created_at, 3),
            **({"recording": self.recording.snapshot()} if self.recording is not None else {}),
            "counters": {
                **asdict(self.counters),
                **asdict(self.events.counters),
                **{f"window_{k}": v for k, v in asdict(clock).items()},
                "engine_windows_in": slot.windows_in,
                "engine_windows_stepped": slot.windows_stepped,
                "engine_windows_dropped": slot.windows_dropped,
                "responses": self.responses.ledger.total,
                "playout_depth_ms": round(self.sink.depth_ms, 1),
            },
        }
