"""Data-channel size limits enforced while SCTP fragments arrive, not after reassembly.

aiortc buffers every fragment of a message until the last one comes (re-scanning its whole list on
each fragment), and only then hands the message up, where its size can first be checked. A peer
sending one multi-megabyte message therefore costs event-loop time quadratic in its size, and a
message whose last fragment never comes stays buffered for the life of the association. The guard
replaces the association's inbound streams with bounded ones:

* a message is dropped as soon as its buffered fragments exceed ``max_message_size`` (the size
  advertised in the SDP's ``a=max-message-size``); later fragments of it are discarded on arrival;
* the fragments buffered across all streams stay under ``max_buffered`` (the receive window a
  compliant sender respects, plus one message); a peer beyond it is violating the protocol;
* at most ``max_streams`` inbound streams are tracked.

Dropped bytes are credited back to the advertised receive window, so the sender is not throttled
for data that was thrown away. This relies on aiortc's ``InboundStream`` and the transport's
``_get_inbound_stream``/``_advertised_rwnd``; ``install`` refuses (returns False) if they change.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

from aiortc.rtcsctptransport import (
    SCTP_DATA_UNORDERED,
    InboundStream,
    RTCSctpCapabilities,
    RTCSctpTransport,
)

log = logging.getLogger(__name__)

# Stream sequence numbers of dropped messages remembered per stream, to discard their late fragments.
DROPPED_MEMORY = 64


@dataclass
class SctpGuardCounters:
    oversize_messages: int = 0
    dropped_bytes: int = 0
    peak_buffered: int = 0  # most bytes held in reassembly at once, all streams together
    overflows: int = 0


def undelivered_chunks(transport: RTCSctpTransport | None) -> int:
    """DATA chunks handed to SCTP and not yet acknowledged by the peer (queued or in flight).

    A data channel's ``bufferedAmount`` reaches 0 when its messages are queued in SCTP, not when
    they are sent; closing the association then loses them. 0 when unknown.
    """
    if transport is None:
        return 0
    return len(getattr(transport, "_outbound_queue", ())) + len(getattr(transport, "_sent_queue", ()))


class SctpGuard:
    def __init__(
        self,
        max_message_size: int,
        receive_window: int = 256 * 1024,
        max_streams: int = 1024,
        on_oversize: Callable[[int, int], None] | None = None,
        on_overflow: Callable[[str], None] | None = None,
    ) -> None:
        self.max_message_size = max_message_size
        self.receive_window = receive_window
        self.max_buffered = receive_window + max_message_size
        self.max_streams = max_streams
        self.on_oversize = on_oversize  # (stream_id, bytes seen so far) of a dropped message
        self.on_overflow = on_overflow  # (what) when the peer exceeds the window or the stream count
        self.counters = SctpGuardCounters()
        self.buffered = 0
        self.violated = False
        self._transport: RTCSctpTransport | None = None

    # --- wiring ------------------------------------------------------------------------------------

    def install(self, transport: RTCSctpTransport) -> bool:
        """Bound ``transport``'s reassembly; must run before the association starts."""
        if not hasattr(transport, "_inbound_streams") or not hasattr(transport, "_advertised_rwnd") \
                or not hasattr(transport, "_get_inbound_stream"):
            log.warning("this aiortc's SCTP transport has no known reassembly hooks: sizes are checked after it")
            return False
        self._transport = transport
        transport._advertised_rwnd = self.receive_window
        transport._get_inbound_stream = self._get_inbound_stream  # type: ignore[method-assign]
        limit = self.max_message_size
        # The SDP answer advertises what this guard enforces (a=max-message-size).
        transport.getCapabilities = lambda: RTCSctpCapabilities(maxMessageSize=limit)  # type: ignore[method-assign]
        return True

    def _get_inbound_stream(self, stream_id: int) -> InboundStream:
        assert self._transport is not None
        streams = self._transport._inbound_streams
        stream = streams.get(stream_id)
        if stream is None:
            if len(streams) >= self.max_streams:
                self._violation(f"more than {self.max_streams} inbound streams")
                return _DiscardingStream(self)
            stream = streams[stream_id] = BoundedInboundStream(self)
        return stream

    # --- accounting (called by the streams) --------------------------------------------------------

    def credit(self, n: int) -> None:
        """Give ``n`` bytes of receive window back: they were dropped, not delivered."""
        if self._transport is not None and n:
            self._transport._advertised_rwnd += n
        self.counters.dropped_bytes += n

    def adjust(self, delta: int) -> None:
        self.buffered += delta
        self.counters.peak_buffered = max(self.counters.peak_buffered, self.buffered)

    def oversize(self, stream_id: int, size: int) -> None:
        self.counters.oversize_messages += 1
        if self.on_oversize is not None:
            self.on_oversize(stream_id, size)

    def _violation(self, what: str) -> None:
        self.counters.overflows += 1
        if self.violated:
            return
        self.violated = True
        log.warning("data channel peer violates its limits: %s", what)
        if self.on_overflow is not None:
            self.on_overflow(what)


class BoundedInboundStream(InboundStream):
    def __init__(self, guard: SctpGuard) -> None:
        super().__init__()
        self._guard = guard
        self._size = 0  # bytes in self.reassembly
        self._ordered: dict[int, int] = {}  # stream_seq -> bytes buffered of that ordered message
        self._unordered = 0
        self._skip: set[int] = set()  # dropped ordered messages the sequence number must step over
        self._dropped: deque[int] = deque(maxlen=DROPPED_MEMORY)

    def add_chunk(self, chunk) -> None:
        n = len(chunk.user_data)
        guard = self._guard
        ordered = not (chunk.flags & SCTP_DATA_UNORDERED)
        if guard.violated or (ordered and chunk.stream_seq in self._dropped):
            guard.credit(n)  # the transport takes n off the window right after this returns
            return
        message = (self._ordered.get(chunk.stream_seq, 0) if ordered else self._unordered) + n
        if message > guard.max_message_size:
            self._drop_message(chunk, ordered, message)
            return
        if guard.buffered + n > guard.max_buffered:
            guard.credit(n)
            guard._violation(f"{guard.buffered + n} bytes of fragments exceed the {guard.max_buffered} byte window")
            return
        super().add_chunk(chunk)
        self._recount()

    def pop_messages(self):
        try:
            while True:
                # A dropped message is stepped over once every message before it was delivered.
                while self.sequence_number in self._skip:
                    self._skip.discard(self.sequence_number)
                    self.sequence_number = (self.sequence_number + 1) & 0xFFFF
                yield from super().pop_messages()
                if self.sequence_number not in self._skip:
                    return
        finally:
            self._recount()

    def prune_chunks(self, tsn: int) -> int:
        size = super().prune_chunks(tsn)
        self._recount()
        return size

    def _drop_message(self, chunk, ordered: bool, size: int) -> None:
        if ordered:
            def belongs(c) -> bool:
                return not (c.flags & SCTP_DATA_UNORDERED) and c.stream_seq == chunk.stream_seq
            self._dropped.append(chunk.stream_seq)
            self._skip.add(chunk.stream_seq)
        else:
            def belongs(c) -> bool:
                return bool(c.flags & SCTP_DATA_UNORDERED)
        removed = sum(len(c.user_data) for c in self.reassembly if belongs(c))
        self.reassembly = [c for c in self.reassembly if not belongs(c)]
        self._guard.credit(removed + len(chunk.user_data))
        self._recount()
        self._guard.oversize(chunk.stream_id, size)

    def _recount(self) -> None:
        ordered: dict[int, int] = {}
        unordered = 0
        for c in self.reassembly:
            if c.flags & SCTP_DATA_UNORDERED:
                unordered += len(c.user_data)
            else:
                ordered[c.stream_seq] = ordered.get(c.stream_seq, 0) + len(c.user_data)
        size = unordered + sum(ordered.values())
        self._guard.adjust(size - self._size)
        self._size, self._ordered, self._unordered = size, ordered, unordered


class _DiscardingStream(InboundStream):
    """Stands in for a stream beyond the limit: nothing is kept, the window is given back."""

    def __init__(self, guard: SctpGuard) -> None:
        super().__init__()
        self._guard = guard

    def add_chunk(self, chunk) -> None:
        self._guard.credit(len(chunk.user_data))
