"""The OpenAI Realtime GA dialect: the ``oai-events`` channel, the sideband and the realtime WebSocket.

A translator is one consumer of one call, an ``EventDialect`` (``session/dialect.py``) like the
native one. It listens to the session's own event stream and writes, through its
``EventChannel``, the GA events a client written for OpenAI expects (string ``event_id`` on every
event, GA session, response and item objects); it reads GA client events and turns them into the
session's typed controls (``client_events.py``). It keeps only what the GA shapes need beyond the
session's events (item ids, the transcript of the response in progress, a bounded record of recent
items, ``conversation.py``). What maps to what is written down in signaling/events.schema.json
(``oai.*``).

Over a WebSocket (``socket`` given) the audio itself travels in events: the client's
``input_audio_buffer.append`` goes to the call's uplink, the answer leaves as
``response.output_audio.delta`` (``audio_delta``, called by the call's sender), in the formats the
client chose; ``output_audio_buffer.*`` events, which OpenAI sends over WebRTC only, are not sent.

``input_audio_buffer.speech_started`` means "barge-in" to every framework, so it is only said when
the floor really changes: when nothing is being answered, or when the user's speech (or the model's
own decision) cut the answer; speech over an answer that goes on is not announced.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from lychee_rtc.jsonio import strict_json_dumps
from lychee_rtc.server.openai.client_events import ClientEvents
from lychee_rtc.server.openai.conversation import (MAX_TRANSCRIPT_CHARS, ConversationRecord, assistant_item,
                                                   user_audio_item)
from lychee_rtc.server.openai.session_config import RealtimeProfile, ga_format, render_live_session, wall_clock_of
from lychee_rtc.session.dialect import DialectFactory
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.ws.formats import PCM16_24K, OutputEncoder, SocketAudioFormat, encode_base64
from lychee_rtc.ws.uplink import SocketUplink

log = logging.getLogger(__name__)

OAI_EVENTS_LABEL = "oai-events"
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
TURN_TAKEN = frozenset(r for r, ga in GA_REASONS.items() if ga == "turn_detected")


@dataclass
class SocketSide:
    """What a translator on a WebSocket has that one on a data channel has not: audio in events."""

    uplink: SocketUplink
    input_format: SocketAudioFormat = PCM16_24K
    output_format: SocketAudioFormat = PCM16_24K
    encoder: OutputEncoder = field(default_factory=lambda: OutputEncoder(24000))


@dataclass
class _Response:
    item_id: str
    previous_item_id: str | None
    metadata: dict[str, str] | None = None
    transcript: list[str] = field(default_factory=list)
    chars: int = 0
    sent_samples: int = 0  # audio sent in events (a socket), at the engine's output rate


class RealtimeTranslator(ClientEvents):
    def __init__(self, session: DuplexSession, channel: EventChannel, profile: RealtimeProfile,
                 on_closed: Callable[[], None] | None = None, socket: SocketSide | None = None) -> None:
        """``on_closed``: called when the session closes (a sideband then closes its socket)."""
        self.session = session
        self.channel = channel
        self.profile = profile
        self.socket = socket
        if socket is not None:
            socket.encoder = OutputEncoder(session.capabilities.output_rate)
        self._on_closed = on_closed
        self._prefix = secrets.token_hex(3)
        self._ids = itertools.count(1)
        self.record = ConversationRecord()
        self._user_item: str | None = None
        self._speech_said = False  # speech_started was sent for the user's turn in progress
        self._held_speech: tuple[str, int] | None = None  # speech over a live answer, said only if it cuts it
        self._responses: dict[str, _Response] = {}
        self._finished: deque[str] = deque(maxlen=8)  # ended responses, never announced again
        self._update_ignored: tuple[str, ...] | None = None  # set while this consumer's update runs
        self._pending_metadata: dict[str, str] | None = None  # from response.create, for the next response
        self._voice: str | None = None
        self._last_heard: str | None = None  # the last response whose audio reached the output buffer
        self._last_ended: str | None = None  # the last response that ended (a late cancel names it)
        self._created_at_wall = 0.0
        self._clearing = False  # answering the client's own output_audio_buffer.clear
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

    # --- out ---------------------------------------------------------------------------------------

    def _out(self, event_type: str, *, epoch: int | None = None, **fields: Any) -> bool:
        """Write one GA event; ``epoch`` tags audio a cut may take back. False if it was dropped."""
        event = {"type": event_type, "event_id": f"event_{self._prefix}{next(self._ids)}", **fields}
        if self._write(event, epoch):
            return True
        self.events_dropped += 1
        return False

    def _write(self, event: dict[str, Any], epoch: int | None) -> bool:
        if not self.channel.has_room():  # the peer is not reading at all
            return False
        text = strict_json_dumps(event)
        if epoch is not None and hasattr(self.channel, "send_tagged"):
            return self.channel.send_tagged(text, epoch)
        return self.channel.send(text)  # closed under us: its close path detaches us

    def _session_object(self, info: dict[str, Any]) -> dict[str, Any]:
        self._voice = info.get("voice")
        formats = (ga_format(self.socket.input_format), ga_format(self.socket.output_format)) if self.socket else None
        return render_live_session(self.profile, info, self._created_at_wall, formats)

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

    # --- the user's turns ------------------------------------------------------------------------------

    def _on_input_audio_buffer_speech_started(self, ev: dict[str, Any]) -> None:
        ms = int(ev["audio_start_ms"])
        self._user_item = f"item_in{ms}"  # from the audio position: every consumer names it alike
        if self._live_response() is not None:
            self._held_speech = (self._user_item, ms)  # said only if it cuts the answer
        else:
            self._say_speech_started(self._user_item, ms)

    def _say_speech_started(self, item_id: str, ms: int) -> None:
        self._held_speech = None
        self._speech_said = True
        self._out("input_audio_buffer.speech_started", item_id=item_id, audio_start_ms=ms)

    def _on_input_audio_buffer_speech_stopped(self, ev: dict[str, Any]) -> None:
        ms = int(ev["audio_end_ms"])
        item_id = self._user_item or f"item_in{ms}"
        if self._held_speech is not None and not self._speech_said:
            self._held_speech = None  # spoken over an answer that went on: nothing to announce
            return
        self._close_user_turn(item_id, ms)

    def _close_user_turn(self, item_id: str, ms: int) -> None:
        if self._speech_said:
            self._speech_said = False
            self._out("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms)
        self._commit_user_item(item_id)  # the engine endpointed the turn: OpenAI's server VAD commits here

    def _on_input_audio_buffer_committed(self, ev: dict[str, Any]) -> None:
        self._commit_user_item(self._user_item or f"item_commit{ev['seq']}")

    def _commit_user_item(self, item_id: str) -> None:
        self._user_item = None
        previous = self.record.last_item_id
        self._out("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        item = user_audio_item(item_id)
        self.record.remember(item)
        self._out("conversation.item.added", item=item, previous_item_id=previous)
        self._out("conversation.item.done", item=item, previous_item_id=previous)

    def _input_ms(self) -> int:
        clock = self.session.window_clock
        return int(1000 * clock.position / clock.sample_rate)

    # --- responses -------------------------------------------------------------------------------------

    def _on_response_created(self, ev: dict[str, Any]) -> None:
        self._announce(ev["response_id"])

    def _live_response(self) -> str | None:
        return next(iter(self._responses), None)

    def _state(self, rid: str) -> _Response | None:
        """The response's state; one that began before this consumer attached (a sideband joining
        mid-answer) is announced on its first event, so that its ``response.done`` still comes."""
        state = self._responses.get(rid)
        if state is None and rid not in self._finished:
            state = self._announce(rid)
        return state

    def _delta_fields(self, state: _Response, samples: int) -> dict[str, Any]:
        """What a dialect adds to an audio delta (nothing, in GA's)."""
        return {}

    def _done_details(self, status: str, reason: str | None) -> dict[str, Any] | None:
        """``status_details`` of an ended response: GA names only a few reasons."""
        if status == "completed":
            return None
        details: dict[str, Any] = {"type": status}
        if reason in GA_REASONS:
            details["reason"] = GA_REASONS[reason]
        return details

    def _after_done(self, rid: str, state: _Response, status: str, reason: str | None) -> None:
        """Called once a response's end has been said (a dialect may add its own events)."""

    def _announce(self, rid: str) -> _Response:
        if self._speech_said:  # the model took the floor: the user's turn is over for it
            self._close_user_turn(self._user_item or f"item_in{self._input_ms()}", self._input_ms())
        state = _Response(f"item_{rid.removeprefix('resp_')}", self.record.last_item_id, self._pending_metadata)
        self._pending_metadata = None
        while self._responses:  # at most one is live; an older one was lost with its done event
            oldest = next(iter(self._responses))
            del self._responses[oldest]
            self._finished.append(oldest)
        self._responses[rid] = state
        item = assistant_item(state.item_id, "in_progress", None)
        self.record.remember(item)
        self._out("response.created", response=self._response(rid, state, "in_progress", None, []))
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

    def audio_delta(self, epoch: int, rid: str, pcm: np.ndarray) -> bool:
        """The call's sender: ``pcm`` of response ``rid`` leaves now, as a delta in the client's format."""
        state = self._state(rid) if epoch == self.session.epoch else None
        if state is None or self.socket is None:
            return False
        data = self.socket.encoder.encode(pcm, self.socket.output_format)
        state.sent_samples += len(pcm)
        if not self._out("response.output_audio.delta", epoch=epoch, response_id=rid, item_id=state.item_id,
                         output_index=0, content_index=0, delta=encode_base64(data),
                         **self._delta_fields(state, len(pcm))):
            state.sent_samples -= len(pcm)
            return False
        return True

    def _on_output_audio_buffer_started(self, ev: dict[str, Any]) -> None:
        self._last_heard = ev["response_id"]
        if self.socket is None:  # OpenAI sends the output buffer's events over WebRTC only
            self._out("output_audio_buffer.started", response_id=ev["response_id"])

    def _on_output_audio_buffer_stopped(self, ev: dict[str, Any]) -> None:
        if self.socket is None:
            self._out("output_audio_buffer.stopped", response_id=ev["response_id"])

    def _on_output_audio_buffer_cleared(self, ev: dict[str, Any]) -> None:
        if self.socket is None or self._clearing:
            self._out("output_audio_buffer.cleared", response_id=ev["response_id"])

    def _on_response_done(self, ev: dict[str, Any]) -> None:
        rid = ev["response_id"]
        state = self._state(rid)
        if state is None:
            return
        status = ev["response"]["status"]
        reason = (ev["response"].get("status_details") or {}).get("reason")
        if status == "cancelled" and reason in TURN_TAKEN and not self._speech_said:
            # The user's turn took the floor: said now, while the answer is still live for the client.
            item_id, ms = self._held_speech or (f"item_in{self._input_ms()}", self._input_ms())
            self._user_item = item_id
            self._say_speech_started(item_id, ms)
        del self._responses[rid]
        self._finished.append(rid)
        self._last_ended = rid
        item = assistant_item(state.item_id, "completed" if status == "completed" else "incomplete",
                              "".join(state.transcript))
        self.record.remember(item)
        pos = {"response_id": rid, "item_id": state.item_id, "output_index": 0, "content_index": 0}
        transcript = item["content"][0]["transcript"]
        self._out("response.output_audio.done", **pos)
        self._out("response.output_audio_transcript.done", **pos, transcript=transcript)
        self._out("response.content_part.done", **pos, part={"type": "audio", "transcript": transcript})
        self._out("response.output_item.done", response_id=rid, output_index=0, item=item)
        self._out("conversation.item.done", item=item, previous_item_id=state.previous_item_id)
        self._out("response.done", response=self._response(rid, state, status, self._done_details(status, reason),
                                                           [item]))
        self._after_done(rid, state, status, reason)
        if self._held_speech is not None:  # spoken over an answer that has now ended: the user's turn
            self._say_speech_started(*self._held_speech)

    def _on_error(self, ev: dict[str, Any]) -> None:
        err = ev["error"]
        self._out("error", error={"type": err["type"], "code": err["code"], "message": err["message"],
                                  "param": None, "event_id": err.get("event_id")})

    def _response(self, rid: str, state: _Response, status: str, details: dict[str, Any] | None,
                  output: list[dict[str, Any]]) -> dict[str, Any]:
        fmt = ga_format(self.socket.output_format) if self.socket else ga_format(PCM16_24K)
        return {"object": "realtime.response", "id": rid, "status": status, "status_details": details,
                "output": output, "conversation_id": None, "output_modalities": ["audio"],
                "audio": {"output": {"format": fmt, "voice": self._voice}},
                "usage": None, "metadata": state.metadata, "max_output_tokens": "inf"}


def realtime_dialect(profile: RealtimeProfile) -> DialectFactory:
    """The factory a transport uses for an ``oai-events`` channel."""
    return lambda session, channel: RealtimeTranslator(session, channel, profile)
