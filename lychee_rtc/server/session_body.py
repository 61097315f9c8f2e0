"""The ``session`` object a request may carry (an offer, a call the server places): checked, then options."""

from __future__ import annotations

from typing import Any

from lychee_rtc.engine.base import SessionOptions
from lychee_rtc.server.http import BodyError
from lychee_rtc.session.protocol import validator


def session_options(raw: Any, voices: tuple[str, ...] | list[str]) -> tuple[SessionOptions, bool]:
    """(options, metrics wanted) from a request's ``session`` object; BodyError when it is malformed."""
    if raw is None:
        return SessionOptions(), False
    errors = list(validator("session_config").iter_errors(raw))
    if errors:
        where = "/".join(str(p) for p in errors[0].path)
        raise BodyError(400, "invalid_session", f"session{'/' + where if where else ''}: {errors[0].message}")
    if not raw:
        return SessionOptions(), False
    options = SessionOptions(**{k: raw[k] for k in ("voice", "temperature", "seed", "instructions") if k in raw})
    if options.voice is not None and options.voice not in voices:
        choice = f"one of {list(voices)}" if voices else "not selectable with this engine"
        raise BodyError(400, "invalid_session", f"session/voice: {options.voice!r} is {choice}")
    return options, bool(raw.get("metrics", False))
