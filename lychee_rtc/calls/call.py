"""What the call registry needs of a call, whatever its transport, and the refusal it answers with."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol

from lychee_rtc.calls.tokens import Opener
from lychee_rtc.media.playout import PlayoutCounters
from lychee_rtc.session.session import DuplexSession


class ServerFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("the server is at capacity")
        self.retry_after_s = retry_after_s


class Call(Protocol):
    """One transport, one engine slot and one duplex session, as the registry sees it."""

    session: DuplexSession
    tasks: list[asyncio.Task]  # the transport's own tasks, cancelled when the call ends
    watchdog: asyncio.Task | None  # the registry's, set by register()
    token: str | None  # the session's own secret, when its client was given one (calls.tokens)
    connected_at: float | None
    folded: dict[str, int]  # counters already added to Prometheus
    # Called with the reason once the call is torn down (a SIP gateway hangs up its leg here).
    on_closed: list[Callable[[str], Awaitable[None] | None]]
    # The media path was lost then, and the session waits for its transport to come back (a resume).
    suspended_at: float | None
    suspend_reason: str | None
    resuming: bool  # a new transport is being attached right now
    # When the media path was first lost, until a new one connects: a resume that never connects
    # does not restart the resume window.
    path_lost_at: float | None

    @property
    def resumable(self) -> bool:
        """Whether a lost media path may be replaced (its client holds a token to resume with): if
        not, losing it ends the call at once."""

    def opener(self) -> Opener:
        """What opens this session's resources besides the server key (calls.tokens)."""

    def connect_started_at(self) -> float:
        """When the current transport began connecting: the connect timeout counts from here."""

    def snapshot(self) -> dict: ...

    def playout_counters(self) -> PlayoutCounters: ...

    async def drop_path(self) -> None:
        """Let go of a lost media path while the session waits for a new one."""

    async def close_transport(self) -> None: ...
