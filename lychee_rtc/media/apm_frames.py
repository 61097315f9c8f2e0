"""One WebRTC audio processing module (the ``livekit`` package's) fed float 10 ms frames.

The module takes 16-bit PCM in a frame object whose buffer it processes in place, through one
foreign call per frame. Each direction of each module owns one frame and its buffer for the whole
call, and samples go in and out through a numpy view of that buffer: per 10 ms nothing is built but
the float output, where a fresh frame, ``bytes`` and ``bytearray`` per call cost about as much as
the call itself (docs/benchmarks.md, "Concurrent calls").

Each call is a serialized request naming the module, the buffer's address and its format, and none
of that changes over a call: so each is serialized once (``PreparedCall``) and sent as it is, and its
reply is compared with the success reply seen before rather than parsed. The binding's own methods
build, serialize and parse a message per call, about three times the native work of a delay setting
and a third of AEC3's frame (docs/benchmarks.md, "With the running echo search"). Where the binding
is not laid out as expected, its public methods are used instead.

The conversion is the one the stage has always used: clipped to [-1, 1], scaled by 32767 and
truncated on the way in; divided by 32768 on the way out.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

_OUT_SCALE = np.float32(1.0 / 32768.0)  # a power of two: the same samples as dividing


class ApmFrames:
    """``module`` (an ``AudioProcessingModule``) with reused frames of ``frame`` samples at ``rate``, mono."""

    def __init__(self, module: Any, frame_cls: Any, rate: int, frame: int) -> None:
        self.module = module
        self.frame = frame
        self._scaled = np.empty(frame, np.float32)
        self._capture, self._capture_pcm = _frame(frame_cls, rate, frame)
        self._render, self._render_pcm = _frame(frame_cls, rate, frame)
        self._process_stream = _prepared(module, "apm_process_stream", self._capture,
                                         lambda: module.process_stream(self._capture))
        self._process_reverse = _prepared(module, "apm_process_reverse_stream", self._render,
                                          lambda: module.process_reverse_stream(self._render))
        self._delay_zero = _prepared(module, "apm_set_stream_delay", None, lambda: module.set_stream_delay_ms(0))

    def process(self, samples: np.ndarray) -> np.ndarray:
        """The uplink (near end): ``frame`` float samples in, the module's output as new float32 samples."""
        self._load(self._capture_pcm, samples)
        self._process_stream()
        return np.multiply(self._capture_pcm, _OUT_SCALE, dtype=np.float32)

    def process_reverse(self, samples: np.ndarray) -> None:
        """The far end (what the caller's loudspeaker played): ``frame`` float samples, for the canceller."""
        self._load(self._render_pcm, samples)
        self._process_reverse()

    def set_stream_delay_zero(self) -> None:
        """``set_stream_delay_ms(0)``: the echo canceller wants it before each uplink frame."""
        self._delay_zero()

    def _load(self, pcm: np.ndarray, samples: np.ndarray) -> None:
        # Into float32 first, as the clip of a float32 frame gives, then truncated to int16 on assignment.
        np.clip(samples, -1.0, 1.0, out=self._scaled)
        np.multiply(self._scaled, np.float32(32767.0), out=pcm, casting="unsafe")


def _frame(frame_cls: Any, rate: int, frame: int) -> tuple[Any, np.ndarray]:
    """A frame over a buffer of its own, and a writable int16 view of that buffer."""
    buffer = bytearray(frame * 2)
    return frame_cls(buffer, rate, 1, frame), np.frombuffer(buffer, np.int16)


def _prepared(module: Any, field: str, frame: Any, fallback: Callable[[], None]) -> Callable[[], None]:
    try:
        return PreparedCall(module, field, frame)
    except (ImportError, AttributeError, TypeError, ValueError):  # the binding is laid out otherwise
        return fallback


class PreparedCall:
    """One of the module's requests (``field`` of the binding's request message), serialized once: for
    ``frame``'s buffer as it stands (its address does not move), or a stream delay of 0 where ``frame``
    is None. Calling it sends it; a reply other than the success reply seen before is parsed, and its
    error raised as the binding's method raises it."""

    def __init__(self, module: Any, field: str, frame: Any) -> None:
        from livekit.rtc._ffi_client import FfiClient
        from livekit.rtc._proto import ffi_pb2
        from livekit.rtc._utils import get_address

        request = ffi_pb2.FfiRequest()
        body = getattr(request, field)
        body.apm_handle = module._ffi_handle.handle
        if frame is None:
            body.delay_ms = 0
        else:
            body.data_ptr = get_address(frame._data)
            body.size = len(frame._data)
            body.sample_rate = frame.sample_rate
            body.num_channels = frame.num_channels
        self._frame = frame  # its buffer must outlive the request that points at it
        self._field = field
        self._response_cls = ffi_pb2.FfiResponse
        data = request.SerializeToString()
        self._buffer = ctypes.create_string_buffer(data, len(data))
        self._data = ctypes.cast(self._buffer, ctypes.POINTER(ctypes.c_ubyte))
        self._length = len(data)
        self._reply = ctypes.POINTER(ctypes.c_ubyte)()
        self._reply_length = ctypes.c_size_t()
        self._reply_ref, self._reply_length_ref = ctypes.byref(self._reply), ctypes.byref(self._reply_length)
        lib = FfiClient.instance._ffi_lib
        self._request, self._drop = lib.livekit_ffi_request, lib.livekit_ffi_drop_handle
        self._ok: bytes | None = None

    def __call__(self) -> None:
        handle = self._request(self._data, self._length, self._reply_ref, self._reply_length_ref)
        reply = ctypes.string_at(self._reply, self._reply_length.value)
        self._drop(handle)
        if reply == self._ok:
            return
        response = self._response_cls()
        response.ParseFromString(reply)
        error = getattr(response, self._field).error
        if error:
            raise RuntimeError(error)
        self._ok = reply
