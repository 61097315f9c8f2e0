"""Named voices: prompt recordings listed in configuration, prepared lazily, cached with a bound.

Preparing a voice runs the two ONNX models and primes the flow over the whole prompt (10 Euler
steps over the prompt's mel frames) - far too slow to repeat per response, and the result is
identical every time, so it is cached. A primed voice holds the estimator caches of its prompt
(full size: about 1.3 MB per prompt frame in fp32), hence the LRU bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Mapping

from .model import Token2Wav, Voice


# The prompt voice that ships with lychee-rtc (a profile's ``voices: {name: builtin}``): 6.9 s of
# synthetic English speech (espeak-ng), so a fresh installation speaks without a recording of its own.
# It sounds synthetic; a natural voice needs a prompt recording (any sample rate, at most 17.6 s).
BUILTIN_VOICE = Path(__file__).with_name("data") / "builtin_voice.wav"


class UnknownVoice(KeyError):
    pass


class VoiceBank:
    def __init__(self, model: Token2Wav, voices: Mapping[str, str | Path], default: str | None = None,
                 max_cached: int = 4):
        if max_cached < 1:
            raise ValueError("max_cached must be >= 1")
        if not voices:
            raise ValueError("at least one voice is required")
        self.model = model
        self._paths = {name: Path(path) for name, path in voices.items()}
        missing = [f"{n}: {p}" for n, p in self._paths.items() if not p.is_file()]
        if missing:
            raise FileNotFoundError("voice prompt file(s) not found: " + ", ".join(missing))
        self.default = default or next(iter(self._paths))
        if self.default not in self._paths:
            raise UnknownVoice(f"default voice {self.default!r} is not listed")
        self.max_cached = max_cached
        self._cache: OrderedDict[str, Voice] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._paths)

    def resolve(self, name: str | None) -> str:
        name = name or self.default
        if name not in self._paths:
            raise UnknownVoice(f"unknown voice {name!r}; available: {', '.join(self._paths)}")
        return name

    def get(self, name: str | None = None, prime: bool = True) -> Voice:
        """The prepared (and by default primed) voice; raises UnknownVoice / PromptTooLong."""
        name = self.resolve(name)
        with self._lock:
            voice = self._cache.get(name)
            if voice is not None:
                self._cache.move_to_end(name)
        if voice is None:
            voice = self.model.prepare_voice(name, self._paths[name])
            with self._lock:
                voice = self._cache.setdefault(name, voice)
                self._cache.move_to_end(name)
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)  # streams still holding it keep their reference
        if prime:
            self.model.prime(voice)
        return voice

    def cached(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._cache)
