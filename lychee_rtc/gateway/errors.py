"""What a refused call action (transfer, hold, consultation) says: HTTP status, error code, message."""

from __future__ import annotations


class CallActionRefused(Exception):
    """A call action (transfer, hold) refused: an HTTP status, an error code and a message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
