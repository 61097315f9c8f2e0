"""The server's own ``events`` dialect: a translator like any other, whose vocabulary is the session's.

Out, it writes the session's events as they are, in order, with their ``seq``: it is the consumer
that attaches to the event stream's own channel, so it also gets what was emitted before its
channel opened and, after a lost connection, a replay of what it missed (``resume``). In, it checks
each client message against signaling/events.schema.json and turns it into one of the session's
typed controls; a bad message gets an ``error`` event and the session carries on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.protocol import ClientEvent, ProtocolError, parse_client_event
from lychee_rtc.session.session import DuplexSession

log = logging.getLogger(__name__)

EVENTS_LABEL = "events"  # the data-channel label this dialect answers to


class NativeDialect:
    def __init__(self, session: DuplexSession, channel: EventChannel) -> None:
        self.session = session
        self.channel = channel

    # --- lifetime ----------------------------------------------------------------------------------

    def attach(self) -> None:
        """Write the session's events on this channel, starting with those it has not sent yet."""
        self.session.events.attach(self.channel)

    def resume(self, last_seq: int) -> None:
        """Attach as a resumed client that has the events up to ``last_seq``."""
        self.session.resume_channel(self.channel, last_seq)

    def detach(self) -> None:
        self.session.events.detach(self.channel)

    # --- in: client events as the session's typed controls -----------------------------------------

    def handle_message(self, raw: str | bytes) -> None:
        s = self.session
        if s.closed or not s.admit_message():
            return
        try:
            self._dispatch(parse_client_event(raw))
        except ProtocolError as err:
            s.report_error(err)
        except Exception:  # never let a message take the transport down with it
            log.exception("session %s: failed to handle a client message", s.id)
            s.report_error(ProtocolError("internal_error", "the server failed to handle this message",
                                         error_type="server_error"))

    def _dispatch(self, ev: ClientEvent) -> None:
        s, p = self.session, ev.payload
        if ev.type == "response.cancel":
            s.cancel_response(p.get("response_id"), ev.event_id)
        elif ev.type == "input_audio_buffer.commit":
            s.commit_input()
        elif ev.type == "turn.listen":
            s.hold_listening()
        elif ev.type == "turn.release":
            s.release_listening()
        elif ev.type == "session.update":
            s.update(p["session"], ev.event_id)
        elif ev.type == "playback.ack":
            s.ack_playback(p["response_id"], p["played_ms"], ev.event_id)
        elif ev.type == "ping":
            fields: dict[str, Any] = {"server_time": time.time(), "epoch": s.epoch}
            if "client_time" in p:
                fields["client_time"] = p["client_time"]
            s.emit("pong", **fields)
        elif ev.type == "session.close":
            s.request_close("client_closed")
        elif ev.type == "call.transfer":
            s.request_transfer(p["target_uri"], ev.event_id)
        else:  # the schema and this dispatcher disagree: a server bug, said plainly
            raise ProtocolError("not_implemented", f"event type {ev.type!r} is not handled", ev.event_id,
                                "server_error")
