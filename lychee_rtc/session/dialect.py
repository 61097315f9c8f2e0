"""What every client dialect of a session is: a translator between one channel and the session.

A dialect (``session/native.py`` for ``events``, the OpenAI Realtime one in ``server/openai/``) is
made for one channel of one call by a ``DialectFactory``. The transport only moves bytes: it calls
``attach`` (or ``resume``, where the dialect supports it) when the channel opens, hands every message
to ``handle_message``, and calls ``detach`` when the channel closes. The dialect writes through the
``EventChannel`` it was made with, which drops what a peer that is not reading cannot take, and
every client message it reads counts against the session's one message rate
(``DuplexSession.admit_message``), whichever dialect it came in.

A transport is given its dialects as a mapping of channel label to factory, built by the server,
so the transports never import the server's dialects.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, runtime_checkable

from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.session import DuplexSession


@runtime_checkable
class EventDialect(Protocol):
    """(Named apart from the carriers' frame ``Dialect``s in ``telephony/carriers``.)"""

    def attach(self) -> None:
        """Start writing the session's events on the channel."""

    def handle_message(self, raw: str | bytes) -> None:
        """One client message: a typed control for the session, or an ``error`` on the channel."""

    def detach(self) -> None:
        """The channel is gone: write nothing more on it."""


@runtime_checkable
class ResumableDialect(EventDialect, Protocol):
    def resume(self, last_seq: int) -> None:
        """Attach as a client that lost its connection having had the events up to ``last_seq``."""


DialectFactory = Callable[[DuplexSession, EventChannel], EventDialect]
# Channel label -> the dialect spoken on channels of that label.
DialectMap = Mapping[str, DialectFactory]
