"""A call's recording as its session controls it: started with the call (``recording.enabled``) or
when the client asks (``session.update`` with ``recording``), paused and resumed, closed with it.

It wires the taps: the session's caller tap, the sink's ``sent_tap`` (the transport says what left
for the caller and when it is heard), and the session's event stream for the sidecar.
"""

from __future__ import annotations

import logging
from typing import Any

from lychee_rtc.config import RecordingSettings
from lychee_rtc.media.epoch_sink import EpochSink
from lychee_rtc.media.recording.recorder import CallRecorder
from lychee_rtc.media.recording.store import RecordingStore
from lychee_rtc.session.protocol import ProtocolError
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.session.sink import AudioSink

log = logging.getLogger(__name__)


class CallRecording:
    def __init__(self, store: RecordingStore, settings: RecordingSettings, session: DuplexSession,
                 token: str | None, transport: str) -> None:
        self.store = store
        self.settings = settings
        self.session = session
        self.token = token
        self.transport = transport
        self.recorder: CallRecorder | None = None
        self.failed: str | None = None

    @property
    def tap(self) -> CallRecorder | None:
        r = self.recorder
        return r if r is not None and not r.paused and not r.closed else None

    def state(self) -> str:
        if self.failed is not None:
            return "failed"
        if self.recorder is None:
            return "off"
        return self.recorder.status()["state"]

    def set_recording(self, on: bool, event_id: str | None = None) -> None:
        if not self.settings.client_control:
            raise ProtocolError("recording_not_allowed",
                                "this server decides what is recorded: recording.client_control is off", event_id)
        if self.recorder is None:
            if on:
                self.start()
                if self.failed is not None:
                    raise ProtocolError("recording_failed", f"the recording could not start: {self.failed}",
                                        event_id, "server_error")
            return
        self.recorder.set_paused(not on)

    def start(self) -> None:
        """Start recording now; a failure (a full disk, a bad directory) is reported, the call goes on."""
        if self.recorder is not None or self.failed is not None:
            return
        header: dict[str, Any] = {"transport": self.transport, "engine": self.session.engine_name,
                                  "input_rate": self.session.capabilities.input_rate}
        if self.session.origin:
            header["origin"] = self.session.origin
        try:
            self.recorder = self.store.open(self.session.id, self.token, header)
        except (OSError, ValueError) as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("session %s: recording could not start: %s", self.session.id, self.failed)
            return
        self.session.events.add_listener(self.recorder.event)
        self.rebind(self.session.sink)

    def rebind(self, sink: AudioSink) -> None:
        if self.recorder is not None and isinstance(sink, EpochSink):
            sink.sent_tap = self.recorder
            self.recorder.codec_delay_s = sink.codec_delay_s
            self.recorder.transit = sink.transit

    def close(self, reason: str) -> None:
        if self.recorder is None:
            return
        self.session.events.remove_listener(self.recorder.event)
        sink = self.session.sink
        if isinstance(sink, EpochSink) and sink.sent_tap is self.recorder:
            sink.sent_tap = None
        self.recorder.close(reason)

    def snapshot(self) -> dict[str, Any]:
        if self.recorder is None:
            return {"state": self.state(), **({"error": self.failed} if self.failed else {})}
        return self.recorder.status()
