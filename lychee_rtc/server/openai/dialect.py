"""The OpenAI Realtime GA dialect: the ``oai-events`` channel and the sideband WebSocket.

A translator is one consumer of one call, an ``EventDialect`` (``session/dialect.py``) like the
native one. It listens to the session's own event stream and writes, through its
``EventChannel``, the GA events a client written for OpenAI expects (string ``event_id`` on every
event, GA session, response and item objects); it reads GA client events and turns them into the
session's typed controls. It keeps only what the GA shapes need beyond the session's events (item ids, the
transcript of the response in progress, a few recent items for ``conversation.item.retrieve``),
all bounded. What maps to what is written down in signaling/events.schema.json (``oai.*``).
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from lychee_rtc.server.openai.session_config import (
    PCM_24K,
    RealtimeProfile,
    read_session_config,
    render_live_session,
    wall_clock_of,
)
from lychee_rtc.jsonio import strict_json_dumps
from lychee_rtc.session.dialect import DialectFactory
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.protocol import ProtocolError, check_event, decode_event, load_schema
from lychee_rtc.session.session import DuplexSession

log = logging.getLogger(__name__)

OAI_EVENTS_LABEL = "oai-events"
MAX_ITEMS = 64  # recent items kept for conversation.item.retrieve
MAX_TRANSCRIPT_CHARS = 32_000
# Our reasons for the end of a response, as GA's status_details.reason where GA has one. GA names
# only these (a new turn from the caller, or the client's cancel); a response ended by a hang-up, a
# lost connection, a shutdown or a newer response carries no reason, as GA's clients expect.
GA_REASONS = {
    "client_cancel": "client_cancelled",
    "turn.listen": "client_cancelled",
    "barge_in": "turn_detected",
    "model_barge_in": "turn_detected",
    "dtmf": "turn_detected",  # a key press is the caller's turn, like speech
}


@lru_cache(maxsize=1)
def client_catalogue() -> dict[str, str | None]:
    """GA client event type -> None (handled) or the reason it is refused, from the schema."""
    defs = load_schema()["$defs"]
    prefix = "oai.client."
    return {k[len(prefix):]: v.get("x-refused") for k, v in defs.items() if k.startswith(prefix)}


@dataclass
class _Response:
    item_id: str
    previous_item_id: str | None
    transcript: list[str] = field(default_factory=list)
    chars: int = 0


class RealtimeTranslator:
    def __init__(self, session: DuplexSession, channel: EventChannel, profile: RealtimeProfile,
                 on_closed: Callable[[], None] | None = None) -> None:
        """``on_closed``: called when the session closes (a sideband then closes its socket)."""
        self.session = session
        self.channel = channel
        self.profile = profile
        self._on_closed = on_closed
        self._prefix = secrets.token_hex(3)
        self._ids = itertools.count(1)
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._last_item_id: str | None = None
        self._user_item: str | None = None
        self._responses: dict[str, _Response] = {}
        self._finished: deque[str] = deque(maxlen=8)  # ended responses, never announced again
        self._update_ignored: tuple[str, ...] | None = None  # set while this consumer's update runs
        self._voice: str | None = None
        self._last_heard: str | None = None  # the last response whose audio reached the output buffer
        self._created_at_wall = 0.0
        self.events_dropped = 0
        self.attached = False

    # --- lifetime ----------------------------------------------------------------------------------

    def attach(self) -> None:
        """Start receiving the session's events; the first one sent is ``session.created``."""
        s = self.session
        self._created_at_wall = wall_clock_of(s.created_at, s.clock())
        s.events.add_listener(self.on_event)
        self.attached = True
        self._out("session.created", session=self._session_object(s.describe()))

    def detach(self) -> None:
        self.session.events.remove_listener(self.on_event)
        self.attached = False

    # --- out: the session's events as GA events ----------------------------------------------------

    def _out(self, event_type: str, **fields: Any) -> None:
        if not self.channel.has_room():  # the peer is not reading at all
            self.events_dropped += 1
            return
        event = {"type": event_type, "event_id": f"event_{self._prefix}{next(self._ids)}", **fields}
        if not self.channel.send(strict_json_dumps(event)):  # closed under us; its close path detaches us
            self.events_dropped += 1

    def _session_object(self, info: dict[str, Any]) -> dict[str, Any]:
        self._voice = info.get("voice")
        return render_live_session(self.profile, info, self._created_at_wall)

    def on_event(self, ev: dict[str, Any]) -> None:
        handler = getattr(self, "_on_" + ev["type"].replace(".", "_"), None)
        if handler is not None:
            handler(ev)

    def _on_session_updated(self, ev: dict[str, Any]) -> None:
        note: dict[str, Any] = {"instructions": ev.get("instructions_effect", "unchanged")}
        if self._update_ignored is not None:
            note["ignored"] = list(self._update_ignored)
        if "recording" in ev["session"]:  # the lychee_rtc.recording extension: the call's recording state
            note["recording"] = ev["session"]["recording"]
        self._out("session.updated", session=self._session_object(ev["session"]), lychee_rtc=note)

    def _on_session_closed(self, ev: dict[str, Any]) -> None:
        if self._on_closed is not None:
            self._on_closed()

    def _on_input_audio_buffer_speech_started(self, ev: dict[str, Any]) -> None:
        ms = int(ev["audio_start_ms"])
        self._user_item = f"item_in{ms}"  # from the audio position: every consumer names it alike
        self._out("input_audio_buffer.speech_started", item_id=self._user_item, audio_start_ms=ms)

    def _on_input_audio_buffer_speech_stopped(self, ev: dict[str, Any]) -> None:
        ms = int(ev["audio_end_ms"])
        item_id = self._user_item or f"item_in{ms}"
        self._out("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms)
        self._commit_user_item(item_id)  # the engine endpointed the turn: OpenAI's server VAD commits here

    def _on_input_audio_buffer_committed(self, ev: dict[str, Any]) -> None:
        self._commit_user_item(self._user_item or f"item_commit{ev['seq']}")

    def _commit_user_item(self, item_id: str) -> None:
        self._user_item = None
        previous = self._last_item_id
        self._out("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_audio", "transcript": None}]}
        self._remember(item)
        self._out("conversation.item.added", item=item, previous_item_id=previous)
        self._out("conversation.item.done", item=item, previous_item_id=previous)

    def _on_response_created(self, ev: dict[str, Any]) -> None:
        self._announce(ev["response_id"])

    def _state(self, rid: str) -> _Response | None:
        """The response's state; one that began before this consumer attached (a sideband joining
        mid-answer) is announced on its first event, so that its ``response.done`` still comes."""
        state = self._responses.get(rid)
        if state is None and rid not in self._finished:
            state = self._announce(rid)
        return state

    def _announce(self, rid: str) -> _Response:
        state = _Response(f"item_{rid.removeprefix('resp_')}", self._last_item_id)
        if len(self._responses) >= 4:  # at most one is live; anything older was lost with its done event
            oldest = next(iter(self._responses))
            del self._responses[oldest]
            self._finished.append(oldest)
        self._responses[rid] = state
        item = self._item(state, "in_progress", with_content=False)
        self._remember(item)
        self._out("response.created", response=self._response(rid, "in_progress", None, []))
        self._out("response.output_item.added", response_id=rid, output_index=0, item=item)
        self._out("conversation.item.added", item=item, previous_item_id=state.previous_item_id)
        self._out("response.content_part.added", response_id=rid, item_id=state.item_id, output_index=0,
                  content_index=0, part={"type": "audio", "transcript": ""})
        return state

    def _on_response_output_audio_transcript_delta(self, ev: dict[str, Any]) -> None:
        rid = ev["response_id"]
        state = self._state(rid)
        if state is None:
            return
        if state.chars < MAX_TRANSCRIPT_CHARS:
            state.transcript.append(ev["delta"])
            state.chars += len(ev["delta"])
        self._out("response.output_audio_transcript.delta", response_id=rid, item_id=state.item_id,
                  output_index=0, content_index=0, delta=ev["delta"])

    def _on_output_audio_buffer_started(self, ev: dict[str, Any]) -> None:
        self._last_heard = ev["response_id"]
        self._out("output_audio_buffer.started", response_id=ev["response_id"])

    def _on_output_audio_buffer_stopped(self, ev: dict[str, Any]) -> None:
        self._out("output_audio_buffer.stopped", response_id=ev["response_id"])

    def _on_output_audio_buffer_cleared(self, ev: dict[str, Any]) -> None:
        self._out("output_audio_buffer.cleared", response_id=ev["response_id"])

    def _on_response_done(self, ev: dict[str, Any]) -> None:
        rid = ev["response_id"]
        state = self._state(rid)
        if state is None:
            return
        del self._responses[rid]
        self._finished.append(rid)
        status = ev["response"]["status"]
        reason = (ev["response"].get("status_details") or {}).get("reason")
        item = self._item(state, "completed" if status == "completed" else "incomplete")
        self._remember(item)
        pos = {"response_id": rid, "item_id": state.item_id, "output_index": 0, "content_index": 0}
        transcript = item["content"][0]["transcript"]
        self._out("response.output_audio.done", **pos)
        self._out("response.output_audio_transcript.done", **pos, transcript=transcript)
        self._out("response.content_part.done", **pos, part={"type": "audio", "transcript": transcript})
        self._out("response.output_item.done", response_id=rid, output_index=0, item=item)
        self._out("conversation.item.done", item=item, previous_item_id=state.previous_item_id)
        details = None
        if status != "completed":
            details = {"type": status}
            if reason in GA_REASONS:
                details["reason"] = GA_REASONS[reason]
        self._out("response.done", response=self._response(rid, status, details, [item]))

    def _on_error(self, ev: dict[str, Any]) -> None:
        err = ev["error"]
        self._out("error", error={"type": err["type"], "code": err["code"], "message": err["message"],
                                  "param": None, "event_id": err.get("event_id")})

    # --- GA objects --------------------------------------------------------------------------------

    def _item(self, state: _Response, status: str, with_content: bool = True) -> dict[str, Any]:
        content = [{"type": "output_audio", "transcript": "".join(state.transcript)}] if with_content else []
        return {"id": state.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": content}

    def _response(self, rid: str, status: str, details: dict[str, Any] | None,
                  output: list[dict[str, Any]]) -> dict[str, Any]:
        return {"object": "realtime.response", "id": rid, "status": status, "status_details": details,
                "output": output, "conversation_id": None, "output_modalities": ["audio"],
                "audio": {"output": {"format": dict(PCM_24K), "voice": self._voice}},
                "usage": None, "metadata": None, "max_output_tokens": "inf"}

    def _remember(self, item: dict[str, Any]) -> None:
        self._items[item["id"]] = item
        self._items.move_to_end(item["id"])
        self._last_item_id = item["id"]
        while len(self._items) > MAX_ITEMS:
            self._items.popitem(last=False)

    # --- in: GA client events as the session's typed controls --------------------------------------

    def handle_message(self, raw: str | bytes) -> None:
        if not self.session.admit_message():
            return
        try:
            self._dispatch(*decode_event(raw))
        except ProtocolError as err:
            self._error(err)
        except Exception:  # never let a message take the transport down with it
            log.exception("session %s: failed to handle a GA client message", self.session.id)
            self._error(ProtocolError("internal_error", "the server failed to handle this message",
                                      error_type="server_error"))

    def _error(self, err: ProtocolError) -> None:
        self._out("error", error={"type": err.error_type, "code": err.code, "message": err.message,
                                  "param": None, "event_id": err.event_id})

    def _dispatch(self, data: dict[str, Any], etype: str) -> None:
        catalogue = client_catalogue()
        event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
        if etype not in catalogue:
            raise ProtocolError("unknown_event", f"unknown event type {etype!r}", event_id)
        check_event(f"oai.client.{etype}", data, etype)
        refused = catalogue[etype]
        if refused is not None:
            raise ProtocolError("unsupported_event", f"{etype} is not supported by this server: {refused}", event_id)
        s = self.session
        if etype == "session.update":
            request = read_session_config(data["session"], self.profile, event_id)
            self._update_ignored = request.ignored
            try:
                s.update(request.changes, event_id)
            finally:
                self._update_ignored = None
        elif etype == "response.cancel":
            s.cancel_response(data.get("response_id"), event_id)
        elif etype == "output_audio_buffer.clear":
            # Nothing playing: the buffer is already clear, and saying so names the last response
            # heard (OpenAI's event requires a response id; typed clients reject null). Before any
            # response there is nothing to name, and nothing is said.
            if not s.clear_output_audio() and self._last_heard is not None:
                self._out("output_audio_buffer.cleared", response_id=self._last_heard)
        elif etype in ("input_audio_buffer.commit", "response.create"):
            # A full-duplex model chooses itself when to speak: both ask it to answer now.
            s.commit_input()
        elif etype == "conversation.item.retrieve":
            item = self._items.get(data["item_id"])
            if item is None:
                raise ProtocolError("item_not_found", f"no recent item {data['item_id']!r} in this call", event_id)
            self._out("conversation.item.retrieved", item=item)
        else:  # the schema and this dispatcher disagree: a server bug, said plainly
            raise ProtocolError("not_implemented", f"event type {etype!r} is not handled", event_id, "server_error")


def realtime_dialect(profile: RealtimeProfile) -> DialectFactory:
    """The factory a transport uses for an ``oai-events`` channel."""
    return lambda session, channel: RealtimeTranslator(session, channel, profile)
