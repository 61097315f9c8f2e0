"""Worker ids inside session ids, so the entry routes follow-ups without a shared table.

A worker ``w3`` names its sessions ``sess_w3-<random>``; the entry reads ``w3`` back from any id
that a follow-up request carries (a path segment or a query parameter).
"""

from __future__ import annotations

import re

_WORKER_ID = re.compile(r"w[0-9]{1,6}")
_IN_SESSION_ID = re.compile(r"[a-z]+_(w[0-9]{1,6})-[0-9A-Za-z_-]+")


def worker_id(index: int) -> str:
    return f"w{index}"


def is_worker_id(value: str) -> bool:
    return bool(_WORKER_ID.fullmatch(value))


def session_prefix(worker: str) -> str:
    """What a worker puts in front of the random part of its session ids."""
    if not is_worker_id(worker):
        raise ValueError(f"not a worker id: {worker!r}")
    return f"{worker}-"


def worker_of(session_id: str) -> str | None:
    """The worker that holds ``session_id``; None for an id no worker of a cluster made."""
    match = _IN_SESSION_ID.fullmatch(session_id)
    return match.group(1) if match else None
