"""The session's event stream: every event stamped once, kept for a resume, and written with backpressure.

The session emits each event here exactly once. The stream gives it its ``seq`` and ``event_id``,
hands it to every listening translator (``add_listener``), keeps its text in a bounded journal so a
client that lost its connection can be replayed what it missed (``resume``), and writes it as it is
on the session's own ``events`` channel, if one is attached, or holds it until one is.

Writing never waits: a channel says how much it still holds unsent (``buffered``), and an
``EventChannel`` drops what a peer that is not reading could not take, so one slow client costs
counted events, never memory or the event loop. Every dialect writes through an ``EventChannel``.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from lychee_rtc.jsonio import strict_json_dumps

log = logging.getLogger(__name__)

# Above this much unsent data on a channel, optional events (metrics) are dropped.
CHANNEL_HIGH_WATER = 1 << 20
# Above this, the peer is not reading the channel at all: every event is dropped (and counted).
CHANNEL_HARD_LIMIT = 8 << 20
# The one event type that may be dropped on a congested channel: a newer one follows within a window.
OPTIONAL_EVENTS = frozenset({"metrics"})

EventListener = Callable[[dict[str, Any]], None]


class EventChannel:
    """One consumer's way out: ``send`` a text message, and how many bytes it still holds unsent.

    ``send`` may raise when the channel cannot take the message (closed, or a full queue): the
    message is then dropped, never retried.
    """

    def __init__(self, send: Callable[[str], None], buffered: Callable[[], int] = lambda: 0) -> None:
        self._send = send
        self._buffered = buffered

    def buffered(self) -> int:
        """Bytes handed to the channel and not yet sent (0 when the channel cannot tell)."""
        try:
            return int(self._buffered())
        except Exception:
            return 0

    def has_room(self, optional: bool = False) -> bool:
        """Whether an event should be written now: an optional one only below the high-water mark,
        any one only while the peer is still reading."""
        depth = self.buffered()
        return depth <= CHANNEL_HARD_LIMIT and not (optional and depth > CHANNEL_HIGH_WATER)

    def send(self, text: str) -> bool:
        """Hand ``text`` to the channel; False if it refused it (the peer's close path ends the session)."""
        try:
            self._send(text)
            return True
        except Exception:
            return False

    def write(self, text: str, optional: bool = False) -> bool:
        """Send ``text`` if the channel has room for it; False if it was dropped."""
        return self.has_room(optional) and self.send(text)


@dataclass
class StreamCounters:
    events_out: int = 0
    events_dropped: int = 0


class EventStream:
    def __init__(self, session_id: str, backlog_limit: int, journal_limit: int) -> None:
        self.session_id = session_id
        self.counters = StreamCounters()
        self._seq = itertools.count(1)
        self._backlog_limit = backlog_limit
        self._backlog: deque[str] = deque()  # emitted while no channel was attached
        # The latest events, as sent, for a client that resumes after losing its connection.
        self._journal: deque[tuple[int, str]] = deque(maxlen=journal_limit)
        self._channel: EventChannel | None = None
        self._listeners: list[EventListener] = []  # translators of other dialects

    # --- in: the session's events ------------------------------------------------------------------

    def emit(self, event_type: str, **fields: Any) -> dict[str, Any]:
        seq = next(self._seq)
        event = {"type": event_type, "seq": seq, "event_id": f"evt_{seq}", **fields}
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # one broken consumer must not starve the others
                log.exception("session %s: event listener failed on %s", self.session_id, event_type)
        text = strict_json_dumps(event)
        self._journal.append((seq, text))
        if self._channel is None:
            self._backlog.append(text)
            while len(self._backlog) > self._backlog_limit:
                self._backlog.popleft()
                self.counters.events_dropped += 1
        elif self._channel.has_room(event_type in OPTIONAL_EVENTS):
            self._transmit(text)
        else:
            self.counters.events_dropped += 1
        return event

    # --- out: the session's own channel, and listeners ------------------------------------------------

    def add_listener(self, listener: EventListener) -> None:
        """Receive every event from now on, as a dict (a translator turns it into its own dialect)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: EventListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def attach(self, channel: EventChannel) -> None:
        """Write the events on ``channel`` from now on, after those held while none was attached."""
        self._channel = channel
        while self._backlog:
            self._transmit(self._backlog.popleft())

    def detach(self, channel: EventChannel | None = None) -> None:
        """Stop writing on ``channel`` (or on whichever channel is attached, if None)."""
        if channel is None or self._channel is channel:
            self._channel = None

    def resume(self, channel: EventChannel, last_seq: int) -> tuple[int, int]:
        """Attach a resumed client's channel and replay the journal after ``last_seq``.

        Returns how many events were replayed and how many the client lost for good (older than
        the journal holds).
        """
        self._channel = channel
        self._backlog.clear()  # the journal holds all of it
        first = self._journal[0][0] if self._journal else last_seq + 1
        lost = max(0, first - last_seq - 1)
        replay = [text for seq, text in self._journal if seq > last_seq]
        for text in replay:
            self._transmit(text)
        return len(replay), lost

    def buffered(self) -> int:
        """Bytes of events handed to the attached channel and not yet sent (0 without a channel)."""
        return 0 if self._channel is None else self._channel.buffered()

    def _transmit(self, text: str) -> None:
        assert self._channel is not None
        if self._channel.send(text):
            self.counters.events_out += 1
        else:
            self.counters.events_dropped += 1
