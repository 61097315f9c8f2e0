"""How fast a client may send messages to one session: a token bucket shared by all its dialects.

A flooding client must not monopolise the event loop, whichever vocabulary it speaks and on however
many channels: every client message of a session, on ``events``, ``oai-events`` or a sideband, draws
from the same bucket. Beyond it messages are dropped, and the client is told at most once a second.
"""

from __future__ import annotations

# A burst of this many messages, refilled at this rate.
MESSAGE_BURST = 200
MESSAGES_PER_SECOND = 100.0
REPORT_INTERVAL_S = 1.0


class MessageRate:
    def __init__(self, now: float) -> None:
        self._tokens = float(MESSAGE_BURST)
        self._refill_at = now
        self._reported_at = -REPORT_INTERVAL_S

    def admit(self, now: float) -> bool:
        """Take a token for one message at ``now``; False: drop the message."""
        self._tokens = min(float(MESSAGE_BURST), self._tokens + (now - self._refill_at) * MESSAGES_PER_SECOND)
        self._refill_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def should_report(self, now: float) -> bool:
        """Whether to tell the client about a dropped message now (one error a second, not one per drop)."""
        if now - self._reported_at >= REPORT_INTERVAL_S:
            self._reported_at = now
            return True
        return False

    @staticmethod
    def describe() -> str:
        return f"more than {MESSAGES_PER_SECOND:.0f} messages per second; messages are being dropped"
