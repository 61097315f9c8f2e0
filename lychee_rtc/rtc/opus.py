"""libopus called directly, one packet at a time, on the calling thread.

aiortc's Opus codecs go through PyAV: the decoder turns each packet into a 48 kHz stereo frame on a
thread of its own, which the inbound path then resamples to the engine's rate; the encoder resizes
each frame with a resampler, upmixes it to stereo and runs on the event loop's executor. For one
mono voice stream per call that costs several times the codec's own work. libopus decodes straight
to any of its rates (8, 12, 16, 24 or 48 kHz), so a 16 kHz engine gets its samples with no
resampler at all, and encodes mono at the track's rate in one call.

The library is the one PyAV's wheels bundle (so the same build that aiortc would use), or the
system's ``libopus``. ``available()`` says whether either was found; without one the callers keep
aiortc's codecs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from functools import lru_cache

import numpy as np

RATES = (8000, 12000, 16000, 24000, 48000)
MAX_FRAME_S = 0.12  # the longest Opus packet: 120 ms
MAX_PACKET_BYTES = 1500

_APPLICATIONS = {"voip": 2048, "audio": 2049, "lowdelay": 2051}
_SET_BITRATE = 4002
_SET_COMPLEXITY = 4010
_SET_VBR_CONSTRAINT = 4020


class OpusError(ValueError):
    """libopus refused a packet or a setting (its own error text)."""


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    import av

    bundled = sorted(glob.glob(os.path.join(os.path.dirname(av.__file__) + ".libs", "libopus*.so*")))
    path = bundled[0] if bundled else ctypes.util.find_library("opus")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    pointer = ctypes.c_void_p
    lib.opus_decoder_create.restype = pointer
    lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.opus_decoder_destroy.argtypes = [pointer]
    lib.opus_decode_float.restype = ctypes.c_int
    lib.opus_decode_float.argtypes = [pointer, ctypes.c_char_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_int]
    lib.opus_encoder_create.restype = pointer
    lib.opus_encoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.opus_encoder_destroy.argtypes = [pointer]
    lib.opus_encode.restype = ctypes.c_int32
    lib.opus_encode.argtypes = [pointer, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int32]
    lib.opus_encoder_ctl.restype = ctypes.c_int  # variadic: its one int argument is passed as a C int
    lib.opus_strerror.restype = ctypes.c_char_p
    lib.opus_strerror.argtypes = [ctypes.c_int]
    return lib


def available() -> bool:
    return _library() is not None


def _check(lib: ctypes.CDLL, code: int, what: str) -> int:
    if code < 0:
        raise OpusError(f"{what}: {lib.opus_strerror(code).decode()}")
    return code


class OpusDecoder:
    """Opus packets in, mono float32 samples at ``rate`` out (whatever rate or channels were sent)."""

    _state = None  # libopus's decoder, until closed

    def __init__(self, rate: int) -> None:
        if rate not in RATES:
            raise OpusError(f"libopus decodes at {RATES} Hz, not {rate}")
        lib = _library()
        if lib is None:
            raise OpusError("libopus is not available")
        self._lib = lib
        self.rate = rate
        error = ctypes.c_int()
        self._state = lib.opus_decoder_create(rate, 1, ctypes.byref(error))
        _check(lib, error.value, "opus_decoder_create")
        self._out = np.zeros(int(rate * MAX_FRAME_S), np.float32)
        self._out_pointer = self._out.ctypes.data

    def decode(self, payload: bytes) -> np.ndarray:
        """One packet's samples (a fresh array); ``OpusError`` for a packet libopus cannot read."""
        if self._state is None:
            raise OpusError("decoder is closed")
        if not payload:  # libopus would conceal a whole 120 ms for it
            raise OpusError("empty Opus packet")
        n = _check(self._lib, self._lib.opus_decode_float(self._state, payload, len(payload), self._out_pointer,
                                                          len(self._out), 0), "opus_decode_float")
        return self._out[:n].copy()

    def close(self) -> None:
        if self._state is not None:
            self._lib.opus_decoder_destroy(self._state)
            self._state = None

    def __del__(self) -> None:
        self.close()


class OpusEncoder:
    """Mono 16-bit frames at ``rate`` in, one Opus packet per frame out.

    ``application``: libopus's ``voip``, ``audio`` or ``lowdelay`` (the last has 2.5 ms of codec delay
    instead of 6.5). The frame length is whatever each call is given (2.5 to 60 ms).
    """

    _state = None  # libopus's encoder, until closed

    def __init__(self, rate: int = 48000, application: str = "voip", bitrate: int | None = None,
                 complexity: int | None = None, constrained_vbr: bool = True) -> None:
        if rate not in RATES:
            raise OpusError(f"libopus encodes at {RATES} Hz, not {rate}")
        if application not in _APPLICATIONS:
            raise OpusError(f"unknown Opus application {application!r}")
        lib = _library()
        if lib is None:
            raise OpusError("libopus is not available")
        self._lib = lib
        self.rate = rate
        self.application = application
        error = ctypes.c_int()
        self._state = lib.opus_encoder_create(rate, 1, _APPLICATIONS[application], ctypes.byref(error))
        _check(lib, error.value, "opus_encoder_create")
        if bitrate is not None:
            self._ctl(_SET_BITRATE, bitrate, "bitrate")
        if complexity is not None:
            self._ctl(_SET_COMPLEXITY, complexity, "complexity")
        if not constrained_vbr:
            self._ctl(_SET_VBR_CONSTRAINT, 0, "VBR constraint")
        self._out = ctypes.create_string_buffer(MAX_PACKET_BYTES)

    def _ctl(self, request: int, value: int, what: str) -> None:
        _check(self._lib, self._lib.opus_encoder_ctl(ctypes.c_void_p(self._state), request, ctypes.c_int(value)), what)

    def encode(self, pcm: np.ndarray) -> bytes:
        """``pcm``: int16 mono samples, one frame."""
        if self._state is None:
            raise OpusError("encoder is closed")
        pcm = np.ascontiguousarray(pcm, dtype=np.int16)
        n = _check(self._lib, self._lib.opus_encode(self._state, pcm.ctypes.data, len(pcm), self._out,
                                                    MAX_PACKET_BYTES), "opus_encode")
        return self._out.raw[:n]

    def close(self) -> None:
        if self._state is not None:
            self._lib.opus_encoder_destroy(self._state)
            self._state = None

    def __del__(self) -> None:
        self.close()
