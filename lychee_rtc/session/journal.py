"""Events kept for a client that may come back: each as sent, under its sequence number, bounded.

A dialect that can resume a client after a lost connection records every event it writes
(``record``) and replays what the client missed (``since``). The client's acknowledgements
(``ack``) let the journal forget what it has; without them it keeps at most ``max_bytes`` of
text: beyond that the journal is overflowed for good (a resume is then impossible and must be said
so), and it frees what it held. Events a cut took back before they were written are forgotten too
(``forget``), as the client never was to get them.
"""

from __future__ import annotations

from collections import OrderedDict


class JournalGap(Exception):
    """The client asks for events older than the journal keeps."""


class JournalOverflow(Exception):
    """More was written than the journal may keep without the client's acknowledgements."""


class EventJournal:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.overflowed = False
        self.acked = 0  # the highest sequence number the client confirmed
        self._entries: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, seq: int, text: str) -> None:
        if self.overflowed:
            return
        self._entries[seq] = text
        self.bytes += len(text)
        if self.bytes > self.max_bytes:
            self.overflowed = True
            self._entries.clear()
            self.bytes = 0

    def ack(self, seq: int) -> None:
        """The client has every event up to ``seq``."""
        self.acked = max(self.acked, seq)
        while self._entries:
            first = next(iter(self._entries))
            if first > seq:
                break
            self.bytes -= len(self._entries.pop(first))

    def forget(self, seqs: list[int | None]) -> None:
        for seq in seqs:
            if seq is not None and seq in self._entries:
                self.bytes -= len(self._entries.pop(seq))

    def since(self, last_seq: int, next_seq: int) -> list[str]:
        """The events after ``last_seq``, in order; ``next_seq`` is the number the next event gets.

        Raises ``JournalOverflow`` if the journal gave up, ``JournalGap`` if some of them were
        trimmed (acknowledged, which a client asking for them again contradicts) or never kept.
        """
        if self.overflowed:
            raise JournalOverflow()
        if last_seq + 1 < next_seq and last_seq < self.acked:
            raise JournalGap()
        return [text for seq, text in self._entries.items() if seq > last_seq]
