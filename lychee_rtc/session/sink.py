"""What a session needs from the transport that plays its audio (implemented in ``media``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class CutReport:
    old_epoch: int
    response_id: str | None  # the response audible when the cut happened, if any
    played_samples: int  # of that response
    discarded_samples: int  # queued audio that will never be played
    sample_offset: int  # outbound stream position of the cut
    rate: int


class AudioSink(Protocol):
    @property
    def epoch(self) -> int: ...

    @property
    def depth_ms(self) -> float: ...

    def write(self, epoch: int, response_id: str, pcm: np.ndarray) -> bool:
        """Queue PCM at the engine's output rate; False (and nothing queued) if ``epoch`` is stale."""

    def end_response(self, epoch: int, response_id: str) -> bool:
        """No more audio for this response; the sink reports when its last sample has played."""

    def cut(self, new_epoch: int) -> CutReport:
        """Drop everything queued and accept only ``new_epoch`` from now on."""
