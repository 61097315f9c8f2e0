"""Every test's log is checked: a lost task, an unretrieved exception, a traceback or a server error
fails the test that caused it, even when everything it asserts passed.

``conftest.py`` installs ``guard_logs`` for every test. asyncio reports a task destroyed while still
pending, or a task or future whose exception nobody retrieved, only when the object is collected,
so the guard runs a full collection after the test (and its event loop) has finished and reads what
that collection logged too. A test that provokes such a line on purpose names it with
``@pytest.mark.allowed_logs(regex, ...)``. A server in a child process is checked the same way
through ``offending_lines`` on its stderr.
"""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Iterable, Iterator

import pytest

# What asyncio and aiohttp say when work was lost or failed with nobody to handle it.
FORBIDDEN_PHRASES = (
    "Task was destroyed but it is pending",
    "Task exception was never retrieved",
    "Future exception was never retrieved",
    "Exception in callback",
    "Error handling request",
    "Unhandled exception",
    "Traceback (most recent call last)",
)


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _text(record: logging.LogRecord) -> str:
    try:
        message = record.getMessage()
    except Exception:  # a malformed record is itself worth showing
        message = f"{record.msg!r} % {record.args!r}"
    return f"{record.levelname} {record.name}: {message}"


def offends(record: logging.LogRecord) -> bool:
    """An error, a traceback, or one of asyncio's lost-work lines (logged at any level)."""
    if record.levelno >= logging.ERROR or record.exc_info:
        return True
    text = _text(record)
    return any(phrase in text for phrase in FORBIDDEN_PHRASES)


def offending_lines(lines: Iterable[str], allowed: Iterable[str] = ()) -> list[str]:
    """Lines of a child process's log that would fail a test (its stderr, standard log format)."""
    patterns = [re.compile(p) for p in allowed]
    found = []
    for line in lines:
        if not (any(phrase in line for phrase in FORBIDDEN_PHRASES) or re.search(r"\b(ERROR|CRITICAL)\b", line)):
            continue
        if not any(p.search(line) for p in patterns):
            found.append(line)
    return found


@pytest.fixture(autouse=True)
def guard_logs(request: pytest.FixtureRequest) -> Iterator[Recorder]:
    marker = request.node.get_closest_marker("allowed_logs")
    allowed = [re.compile(p) for p in (marker.args if marker else ())]
    recorder = Recorder()
    root = logging.getLogger()
    root.addHandler(recorder)
    try:
        yield recorder
        gc.collect()  # asyncio reports lost tasks and unretrieved exceptions when they are collected
    finally:
        root.removeHandler(recorder)
    bad = [_text(r) for r in recorder.records if offends(r) and not any(p.search(_text(r)) for p in allowed)]
    if bad:
        pytest.fail(f"{len(bad)} log line(s) this test must not cause (tests/log_guard.py):\n  "
                    + "\n  ".join(line[:500] for line in bad[:10]), pytrace=False)
