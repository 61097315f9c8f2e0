"""Loss concealment for the uplink: a lost packet's time is kept, filled with a fading repeat.

Pure silence in the middle of a word is a click the model hears as a stop; repeating the last
received audio while fading it out over one packet is the classic cheap concealment, and beyond
one packet it falls to silence so a long outage is not invented speech.
"""

from __future__ import annotations

import numpy as np


def conceal(previous: np.ndarray, n: int, fade: int) -> np.ndarray:
    """``n`` samples that continue ``previous`` (its last period repeated) fading to zero over ``fade``."""
    out = np.zeros(n, dtype=np.float32)
    if n <= 0 or len(previous) == 0 or fade <= 0:
        return out
    period = previous[-min(len(previous), fade):]
    k = min(n, fade)
    reps = -(-k // len(period))
    out[:k] = np.tile(period, reps)[:k] * np.linspace(1.0, 0.0, k, endpoint=False, dtype=np.float32)
    return out
