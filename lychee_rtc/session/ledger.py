"""What happened to each response: the history truth a client and the operator can rely on."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class ResponseRecord:
    response_id: str
    epoch: int
    status: str = "in_progress"
    reason: str = ""
    created_at: float = 0.0
    first_audio_at: float | None = None  # monotonic time the first chunk reached the sink
    audible: bool = False  # its first sample has left the server
    played_samples: int = 0
    rate: int = 0
    generation_done: bool = False
    final_status: str = "completed"  # what the engine said when generation ended
    client_played_ms: float | None = None  # from playback.ack

    @property
    def played_ms(self) -> float:
        return 1000.0 * self.played_samples / self.rate if self.rate else 0.0


class ResponseLedger:
    """Recent responses, bounded: old records are forgotten once the limit is reached."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._records: OrderedDict[str, ResponseRecord] = OrderedDict()
        self.total = 0

    def add(self, record: ResponseRecord) -> ResponseRecord:
        self._records[record.response_id] = record
        self.total += 1
        while len(self._records) > self.limit:
            self._records.popitem(last=False)
        return record

    def get(self, response_id: str | None) -> ResponseRecord | None:
        return self._records.get(response_id) if response_id else None

    def __len__(self) -> int:
        return len(self._records)
