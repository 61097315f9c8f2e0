"""Build the configured engine backend."""

from __future__ import annotations

from lychee_rtc.config import Settings
from lychee_rtc.engine.base import StepBackend


def build_backend(settings: Settings) -> StepBackend:
    name = settings.engine.name
    max_sessions = settings.session.max_sessions
    if name == "echo":
        from lychee_rtc.engine.echo import EchoBackend, LoopbackBackend

        echo = settings.engine.echo
        cls = LoopbackBackend if echo.mode == "loopback" else EchoBackend
        return cls(echo, max_sessions)
    if name == "lychee":
        from lychee_rtc.engine.lychee.backend import build_lychee_backend

        return build_lychee_backend(settings.engine.lychee, max_sessions)
    raise ValueError(f"engine.name: unknown engine {name!r}")
