"""GA client events, as the session's typed controls: the input side of the Realtime translator.

Everything an SDK or a framework sends routinely is answered without an ``error``: a
``response.cancel`` that arrives after its response ended (the client's view lags ours) is already
done; ``conversation.item.truncate`` at any length is clamped to what was sent; ``create``,
``delete`` and ``retrieve`` keep the conversation record a client's history mirrors, while the
model, which takes speech only, hears none of a created item (the echo says so). What a client asks
wrongly gets an OpenAI-style error echoing its ``event_id``, and the call goes on.

Over a WebSocket, events that act on the conversation (commit, cancel, truncate, a new
configuration...) wait for the audio the client appended before them (``SocketUplink.then``), so a
client sending a file faster than real time has them applied where it put them.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from collections import deque
from typing import Any, Callable

from lychee_rtc.server.openai.conversation import ConversationRecord, client_item
from lychee_rtc.server.openai.session_config import RealtimeProfile, read_session_config, requested_formats
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.session.protocol import MAX_MESSAGE_BYTES, ProtocolError, check_event, decode_event, load_schema
from lychee_rtc.ws.formats import AudioFormatError, decode_base64

log = logging.getLogger(__name__)

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# Sent in streams whose cost the socket bounds by itself (its input queue stops the reader).
UNMETERED = frozenset({"input_audio_buffer.append"})


@lru_cache(maxsize=4)
def client_catalogue(prefix: str = "oai.client.") -> dict[str, str | None]:
    """A dialect's client event types -> None (handled) or the reason it is refused, from the schema."""
    defs = load_schema()["$defs"]
    return {k[len(prefix):]: v.get("x-refused") for k, v in defs.items() if k.startswith(prefix)}


def response_metadata(raw: Any, event_id: str | None) -> dict[str, str] | None:
    """``response.metadata`` as GA types it: at most 16 string pairs, echoed on the response."""
    if raw is None:
        return None
    if (not isinstance(raw, dict) or len(raw) > MAX_METADATA_PAIRS
            or any(not isinstance(k, str) or not isinstance(v, str) or len(k) > MAX_METADATA_KEY
                   or len(v) > MAX_METADATA_VALUE for k, v in raw.items())):
        raise ProtocolError("invalid_value", f"response.metadata must hold at most {MAX_METADATA_PAIRS} string "
                            f"pairs (keys up to {MAX_METADATA_KEY}, values up to {MAX_METADATA_VALUE} characters)",
                            event_id)
    return dict(raw)


class ClientEvents:
    """The input half of ``RealtimeTranslator``, whose state it uses (declared here)."""

    max_message_bytes = MAX_MESSAGE_BYTES
    schema_prefix = "oai.client."  # where the dialect's client events are defined in the schema
    unmetered = UNMETERED  # events (over a socket) that do not count against the message rate
    aliases: dict[str, str] = {}  # other names a dialect accepts for its events
    session: DuplexSession
    profile: RealtimeProfile
    socket: Any  # dialect.SocketSide, or None on a data channel
    record: ConversationRecord
    _responses: dict[str, Any]
    _finished: deque[str]
    _last_ended: str | None
    _last_heard: str | None
    _pending_metadata: dict[str, str] | None
    _update_ignored: tuple[str, ...] | None
    _clearing: bool
    _out: Callable[..., bool]

    def handle_message(self, raw: str | bytes) -> None:
        try:
            data, etype = decode_event(raw, self.max_message_bytes)
            etype = self.aliases.get(etype, etype)
            if (etype not in self.unmetered or self.socket is None) and not self.session.admit_message():
                return
            self._dispatch(data, etype)
        except ProtocolError as err:
            self._error(err)
        except Exception:  # never let a message take the transport down with it
            log.exception("session %s: failed to handle a GA client message", self.session.id)
            self._error(ProtocolError("internal_error", "the server failed to handle this message",
                                      error_type="server_error"))

    def _error(self, err: ProtocolError) -> None:
        self._out("error", error={"type": err.error_type, "code": err.code, "message": err.message,
                                  "param": None, "event_id": err.event_id})

    def _in_order(self, control: Callable[[], None], event_id: str | None) -> None:
        """Run ``control`` now, or (on a socket) once the audio appended before it reached the model."""
        def run() -> None:
            try:
                control()
            except ProtocolError as err:
                self._error(err)
            except Exception:
                log.exception("session %s: failed to apply a GA client event", self.session.id)
                self._error(ProtocolError("internal_error", "the server failed to apply this event", event_id,
                                          "server_error"))
        if self.socket is None:
            run()
        else:
            self.socket.uplink.then(run)

    def _dispatch(self, data: dict[str, Any], etype: str) -> None:
        catalogue = client_catalogue(self.schema_prefix)
        event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
        if etype not in catalogue:
            raise ProtocolError("unknown_event", f"unknown event type {etype!r}", event_id)
        check_event(f"{self.schema_prefix}{etype}", {**data, "type": etype}, etype)
        refused = catalogue[etype]
        if refused is not None and (self.socket is None or etype != "input_audio_buffer.append"):
            raise ProtocolError("unsupported_event", f"{etype} is not supported by this server: {refused}", event_id)
        handler = getattr(self, "_client_" + etype.replace(".", "_"), None)
        if handler is None:  # the schema and this dispatcher disagree: a server bug, said plainly
            raise ProtocolError("not_implemented", f"event type {etype!r} is not handled", event_id, "server_error")
        handler(data, event_id)

    # --- configuration -------------------------------------------------------------------------------

    def _client_session_update(self, data: dict[str, Any], event_id: str | None) -> None:
        request = read_session_config(data["session"], self.profile, event_id, formats_apply=self.socket is not None)
        if self.socket is not None:  # appends read after this one are in the new format at once
            in_format, out_format = requested_formats(data["session"], event_id)
            self.socket.input_format = in_format or self.socket.input_format
            self.socket.output_format = out_format or self.socket.output_format
        self._update_in_order(request.changes, request.ignored, event_id)

    def _update_in_order(self, changes: dict[str, Any], ignored: tuple[str, ...], event_id: str | None) -> None:
        """Apply a session.update's ``changes`` in order with the audio sent before it; the
        session.updated it causes lists what the request ``ignored``."""
        def apply() -> None:
            self._update_ignored = ignored
            try:
                self.session.update(changes, event_id)
            finally:
                self._update_ignored = None
        self._in_order(apply, event_id)

    # --- audio in --------------------------------------------------------------------------------------

    def _client_input_audio_buffer_append(self, data: dict[str, Any],
                                          event_id: str | None) -> None:
        assert self.socket is not None
        try:
            self.socket.uplink.append(decode_base64(data["audio"]), self.socket.input_format)
        except AudioFormatError as exc:
            raise ProtocolError(exc.code, exc.message, event_id,
                                "rate_limit_error" if exc.code == "input_backpressure" else "invalid_request_error")

    def _client_input_audio_buffer_clear(self, data: dict[str, Any],
                                         event_id: str | None) -> None:
        # Over WebRTC the model has heard every sample already: nothing is waiting to be dropped.
        if self.socket is not None:
            self.socket.uplink.clear()
        self._out("input_audio_buffer.cleared")

    def _client_input_audio_buffer_commit(self, data: dict[str, Any],
                                          event_id: str | None) -> None:
        # A full-duplex model chooses itself when to speak: this asks it to answer now.
        self._in_order(self.session.commit_input, event_id)

    # --- responses -------------------------------------------------------------------------------------

    def _client_response_create(self, data: dict[str, Any], event_id: str | None) -> None:
        metadata = response_metadata((data.get("response") or {}).get("metadata"), event_id)

        def apply() -> None:
            if self.session.responses.active is not None:
                raise ProtocolError("conversation_already_has_active_response",
                                    "Conversation already has an active response in progress", event_id)
            self._pending_metadata = metadata
            self.session.commit_input()
        self._in_order(apply, event_id)

    def _client_response_cancel(self, data: dict[str, Any], event_id: str | None) -> None:
        rid = data.get("response_id")

        def apply() -> None:
            if rid in self._finished or (rid is None and self.session.responses.active is None
                                         and self._last_ended is not None):
                return  # it ended before the client heard so: there is nothing left to cancel
            if self.session.responses.active is None:
                raise ProtocolError("response_cancel_not_active", "Cancellation failed: no active response found",
                                    event_id)
            self.session.cancel_response(rid, event_id)
        self._in_order(apply, event_id)

    def _client_output_audio_buffer_clear(self, data: dict[str, Any],
                                          event_id: str | None) -> None:
        def apply() -> None:
            # Nothing playing: the buffer is already clear, and saying so names the last response
            # heard (OpenAI's event requires a response id; typed clients reject null). Before any
            # response there is nothing to name, and nothing is said.
            self._clearing = True
            try:
                cut = self.session.clear_output_audio()
            finally:
                self._clearing = False
            if not cut and self._last_heard is not None:
                self._out("output_audio_buffer.cleared", response_id=self._last_heard)
        self._in_order(apply, event_id)

    # --- the conversation record -----------------------------------------------------------------------

    def _live_item(self, item_id: str) -> str | None:
        """The response in progress whose item is ``item_id``, if any."""
        return next((rid for rid, st in self._responses.items() if st.item_id == item_id), None)

    def _client_conversation_item_retrieve(self, data: dict[str, Any],
                                           event_id: str | None) -> None:
        item = self.record.get(data["item_id"])
        if item is None:
            raise ProtocolError("item_retrieve_invalid_item_id", f"no recent item {data['item_id']!r} in this "
                                "conversation", event_id)
        self._out("conversation.item.retrieved", item=item)

    def _client_conversation_item_create(self, data: dict[str, Any],
                                         event_id: str | None) -> None:
        try:
            item = client_item(data["item"])
        except ValueError as exc:
            raise ProtocolError("invalid_value", str(exc), event_id) from None
        previous = data.get("previous_item_id") or self.record.last_item_id
        self.record.remember(item)
        # Kept in the record a client's history mirrors; the model, which takes speech only, hears none of it.
        note = {"heard_by_model": False}
        self._out("conversation.item.added", item=item, previous_item_id=previous, lychee_rtc=note)
        self._out("conversation.item.done", item=item, previous_item_id=previous, lychee_rtc=note)

    def _client_conversation_item_delete(self, data: dict[str, Any],
                                         event_id: str | None) -> None:
        item_id = data["item_id"]

        def apply() -> None:
            live = self._live_item(item_id)
            if live is not None:  # the answer being said goes with its item
                self.session.cancel_response(live, event_id)
            self.record.forget(item_id)
            self._out("conversation.item.deleted", item_id=item_id)
        self._in_order(apply, event_id)

    def _client_conversation_item_truncate(self, data: dict[str, Any],
                                           event_id: str | None) -> None:
        item_id, end_ms = data["item_id"], data["audio_end_ms"]

        def apply() -> None:
            item, live = self.record.get(item_id), self._live_item(item_id)
            if item is None and live is None:
                raise ProtocolError("item_truncate_invalid_item_id", f"no recent assistant item {item_id!r}", event_id)
            if item is not None and item.get("role") != "assistant":
                raise ProtocolError("item_truncate_invalid_item_id", f"item {item_id!r} is not an assistant's audio",
                                    event_id)
            if live is not None:  # the client stopped playing it: the rest is never said
                self.session.cancel_response(live, event_id)
            record = self.session.responses.ledger.get("resp_" + item_id.removeprefix("item_"))
            kept = float(end_ms)
            if record is not None:
                kept = min(kept, record.played_ms) if record.rate else kept
                record.client_played_ms = kept
                if record.played_ms > 0:
                    self.record.truncate(item_id, kept / record.played_ms)
            self._out("conversation.item.truncated", item_id=item_id, content_index=data["content_index"],
                      audio_end_ms=int(kept))
        self._in_order(apply, event_id)
