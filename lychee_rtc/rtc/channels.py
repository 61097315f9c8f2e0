"""Data channels: which dialect speaks on a channel is chosen by its label.

The transport knows no dialect: the server hands the negotiator a mapping ``label -> factory``, and
each channel whose label is in it gets a dialect of its own. A channel with another label is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

from lychee_rtc.session.session import DuplexSession


@dataclass(frozen=True)
class ChannelPort:
    """The transport's side of one open data channel, as a dialect sees it."""

    send: Callable[[str], None]
    buffered_amount: Callable[[], int]
    # The last event seq a resuming client already has, once (None: a fresh start, or already taken).
    take_resume_point: Callable[[], int | None]


class ChannelDialect(Protocol):
    def handle_message(self, message: str | bytes) -> None: ...

    def detach(self) -> None: ...


# Attaches a dialect to the session over the channel and returns it.
DialectFactory = Callable[[DuplexSession, ChannelPort], ChannelDialect]
Dialects = Mapping[str, DialectFactory]
