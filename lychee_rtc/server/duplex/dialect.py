"""The duplex translator: the GA translator's events, numbered, journaled, and vLLM-Omni's extras.

Every event this dialect writes carries ``server_event_seq`` (the replay cursor) and the session's
``epoch``, and is recorded in the call's journal before it is sent, so a client whose socket broke
gets what it missed after ``session.resume`` (``resume.py``), and ``session.event_ack`` lets the
journal forget what the client has. Two events describe the socket they go to and are not replayed,
so they carry no sequence number: ``session.resumed`` (new socket) and ``session.replaced`` (old one).
Errors use the codes of vLLM-Omni's protocol.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
from typing import Any

from lychee_rtc.engine.base import EngineCapabilities, WindowTiming
from lychee_rtc.jsonio import strict_json_dumps
from lychee_rtc.server.duplex.session_config import audio_format, read_duplex_config
from lychee_rtc.server.openai.dialect import RealtimeTranslator, SocketSide, _Response
from lychee_rtc.server.openai.session_config import RealtimeProfile
from lychee_rtc.session.journal import EventJournal
from lychee_rtc.session.protocol import ProtocolError
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.ws.call import SocketChannel
from lychee_rtc.ws.formats import AudioFormatError, decode_base64

# Our error codes as vLLM-Omni's protocol names them (vllm_omni/protocol/duplex/errors.py).
CODES = {"invalid_event": "bad_event", "message_too_large": "event_too_large", "rate_limited": "input_backpressure",
         "response_cancel_not_active": "response_not_active", "item_retrieve_invalid_item_id": "item_not_found",
         "item_truncate_invalid_item_id": "item_not_found", "unsupported_event": "bad_event",
         "not_implemented": "internal_error", "engine_step_failed": "engine_error"}
RATE_LIMITED = frozenset({"input_backpressure", "resource_exhausted"})
# Our reasons for an ended response, as this dialect says them.
REASONS = {"client_cancel": "client_cancelled", "turn.listen": "client_cancelled", "barge_in": "barge_in",
           "model_barge_in": "barge_in", "superseded": "new_response"}
DECISION_WINDOWS = 2  # engine windows after a commit by which the model has decided (one may be in flight)


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


def capabilities(caps: EngineCapabilities, max_sessions: int) -> dict[str, Any]:
    """What the model can do, as vLLM-Omni's ``session.capabilities`` object says it."""
    model_turns = caps.name not in ("echo", "loopback")
    return {
        "implementation_level": "model_native_duplex" if model_turns else "server_policy",
        "supports_input_append": True, "supports_barge_in": caps.barge_in, "supports_playback_ack": True,
        "supports_session_resume": True, "supports_session_lease": True,
        "supports_multi_session": max_sessions > 1, "supports_multi_session_same_replica": max_sessions > 1,
        "session_admission_mode": "engine_managed", "supports_audio_truncate": True,
        "supports_image_input": False, "supports_text_only_turn": False,
        "supports_client_commit": caps.commit_hint, "supports_external_turn_signal": caps.client_cancel,
        "supports_overlapped_commit": False, "required_input_modalities": ["audio"],
        "optional_input_modalities": [], "chunk_period_ms": 1000 * caps.window_samples // caps.input_rate,
        "input_modes": ["append_audio_chunk"],
        "signal_sources": ["model_native", "client_event"] if model_turns else ["server_policy", "client_event"],
        "target_barge_in_latency_ms": None,
    }


class DuplexTranslator(RealtimeTranslator):
    schema_prefix = "duplex.client."
    unmetered = frozenset({"input_audio_buffer.append", "session.event_ack", "session.heartbeat"})
    aliases = {"input.commit": "input_audio_buffer.commit", "input_text.append": "input.text.append",
               "push_text": "input.text.append", "signal_turn": "turn.signal", "audio.playback_ack": "playback.ack",
               "close_session": "session.close", "close": "session.close"}

    def __init__(self, session: DuplexSession, channel: SocketChannel, profile: RealtimeProfile,
                 socket: SocketSide, journal_bytes: int, max_sessions: int) -> None:
        super().__init__(session, channel, profile, socket=socket)
        self.channel: SocketChannel = channel
        self.journal = EventJournal(journal_bytes)
        self._seq = itertools.count(1)
        self.next_seq = 1
        self.generation = 0  # the current socket's attachment generation
        self._token_digest = b""
        self._capabilities = capabilities(session.capabilities, max_sessions)
        self._turns = 0
        self._decision_due: int | None = None  # windows left before a commit's decision is known
        self._close_reason: str | None = None
        session.window_listeners.append(self._on_window)

    # --- out: numbered and journaled -------------------------------------------------------------------

    def _write(self, event: dict[str, Any], epoch: int | None) -> bool:
        seq = self.next_seq = next(self._seq)
        event["server_event_seq"] = seq
        event.setdefault("epoch", self.session.epoch if epoch is None else epoch)
        text = strict_json_dumps(event)
        self.journal.record(seq, text)
        if not self.channel.attached:
            return True  # kept for the client's resume
        return self.channel.send_tagged(text, epoch, seq)

    def send_unnumbered(self, event_type: str, **fields: Any) -> bool:
        """An event about the socket itself (not replayed, so not numbered)."""
        event = {"type": event_type, "event_id": f"event_{self._prefix}{next(self._ids)}", **fields}
        return self.channel.send_tagged(strict_json_dumps(event))

    def forget_taken_back(self, seqs: list[int | None]) -> None:
        """A cut took these audio events back before they were written: they never were."""
        self.journal.forget(seqs)

    # --- identity, resume credentials --------------------------------------------------------------------

    def new_resume_token(self) -> str:
        token = secrets.token_urlsafe(32)
        self._token_digest = digest(token)
        self.generation += 1
        return token

    def token_matches(self, token: Any) -> bool:
        return isinstance(token, str) and hmac.compare_digest(digest(token), self._token_digest)

    def attach(self) -> None:
        s = self.session
        s.events.add_listener(self.on_event)
        self.attached = True
        token = self.new_resume_token()
        self._out("session.created", session=self._session_object(s.describe()), resume_token=token,
                  attachment_generation=self.generation)
        self._out("session.updated", session=self._session_object(s.describe()))

    def session_object(self) -> dict[str, Any]:
        return self._session_object(self.session.describe())

    def _session_object(self, info: dict[str, Any]) -> dict[str, Any]:
        self._voice = info.get("voice")
        s, side = self.session, self.socket
        assert side is not None
        active = s.responses.active
        record = s.responses.ledger.get(active) or s.responses.ledger.get(self._last_ended)
        return {
            "id": info["id"], "object": "realtime.session", "type": "realtime", "model": self.profile.model,
            "state": "closed" if s.closed else "active", "turn_state": s.state, "epoch": s.epoch,
            "turn_id": self._turns, "active_request_id": None, "active_response_id": active,
            "active_response_turn_id": self._turns if active else None,
            "modalities": ["audio", "text"], "instructions": info.get("instructions") or "", "voice": self._voice,
            "audio": {"input": {"format": {"type": side.input_format.encoding, "rate": side.input_format.rate}},
                      "output": {"format": {"type": side.output_format.encoding, "rate": side.output_format.rate}}},
            "turn_detection": self.profile.turn_detection if self.profile.turn_detection
            and self.profile.turn_detection.get("type") == "server_vad" else None,
            "playback_commit_policy": "commit_all_on_done",
            "playback": self._playback(record),
            "capabilities": self._capabilities,
        }

    def _playback(self, record: Any) -> dict[str, float]:
        if record is None:
            return {"generated_ms": 0.0, "sent_ms": 0.0, "played_ms": 0.0, "committed_ms": 0.0}
        sent = round(record.played_ms, 1)
        played = record.client_played_ms if record.client_played_ms is not None else sent
        return {"generated_ms": sent, "sent_ms": sent, "played_ms": round(played, 1), "committed_ms": round(played, 1)}

    # --- the model's decisions -------------------------------------------------------------------------

    def _announce(self, rid: str) -> _Response:
        state = super()._announce(rid)
        self._turns += 1
        self._decision_due = None
        self._out("response.speak", response_id=rid,
                  metadata={"session_id": self.session.id, "epoch": self.session.epoch, "model_speak": True})
        return state

    def _delta_fields(self, state: _Response, samples: int) -> dict[str, Any]:
        assert self.socket is not None
        rate = self.session.capabilities.output_rate
        return {"format": self.socket.output_format.encoding, "sample_rate_hz": self.socket.output_format.rate,
                "metadata": {"session_id": self.session.id, "epoch": self.session.epoch, "model_speak": True,
                             "end_of_turn": False, "audio_duration_ms": round(1000.0 * state.sent_samples / rate, 1)}}

    def _done_details(self, status: str, reason: str | None) -> dict[str, Any] | None:
        if status == "completed":
            return None
        return {"type": status, "reason": REASONS.get(reason or "", reason or status)}

    def _after_done(self, rid: str, state: _Response, status: str, reason: str | None) -> None:
        self._out("rate_limits.updated", rate_limits=[])

    def _listen(self, reason: str) -> None:
        self._decision_due = None
        self._out("response.listen", response={"status": "listening"},
                  metadata={"session_id": self.session.id, "epoch": self.session.epoch, "reason": reason})

    def _on_turn_state(self, ev: dict[str, Any]) -> None:
        if ev["state"] in ("listening", "held") and ev["reason"] in ("speech_end", "response_done", "model_barge_in"):
            self._listen("model_listen")  # the model yields the floor

    def _on_input_audio_buffer_committed(self, ev: dict[str, Any]) -> None:
        super()._on_input_audio_buffer_committed(ev)
        if self.session.responses.active is None:
            self._decision_due = DECISION_WINDOWS

    def _on_window(self, timing: WindowTiming) -> None:
        if self._decision_due is None:
            return
        self._decision_due -= 1
        if self._decision_due <= 0:
            self._listen("model_listen")  # the model heard the commit and went on listening

    def _on_session_closed(self, ev: dict[str, Any]) -> None:
        self._out("session.closed", session_id=self.session.id, reason=self._close_reason or ev["reason"])
        super()._on_session_closed(ev)

    def _on_error(self, ev: dict[str, Any]) -> None:
        if ev["error"]["code"] == "input_audio_buffer_commit_empty":
            self._listen("silence_commit")  # nothing to answer: the model listens on (not an error here)
            return
        super()._on_error(ev)

    def _error(self, err: ProtocolError) -> None:
        code = CODES.get(err.code, err.code)
        kind = "rate_limit_error" if code in RATE_LIMITED else err.error_type
        self._out("error", error={"type": kind, "code": code, "message": err.message, "param": None,
                                  "event_id": err.event_id})

    # --- client events of this dialect ------------------------------------------------------------------

    def _client_session_update(self, data: dict[str, Any], event_id: str | None) -> None:
        caps = self.session.capabilities
        request = read_duplex_config(data["session"], self.profile, 16000, caps.output_rate, event_id)
        assert self.socket is not None
        self.socket.input_format = request.input_format or self.socket.input_format
        self.socket.output_format = request.output_format or self.socket.output_format
        self._update_in_order(request.changes, request.ignored, event_id)

    def _client_input_audio_buffer_append(self, data: dict[str, Any], event_id: str | None) -> None:
        assert self.socket is not None
        fmt = self.socket.input_format
        encoding = data.get("format", data.get("input_audio_format"))
        if encoding is not None or "sample_rate_hz" in data:
            fmt = audio_format(encoding or fmt.encoding, data.get("sample_rate_hz", fmt.rate), fmt.rate,
                               "input_audio_buffer.append", event_id)
        try:
            self.socket.uplink.append(decode_base64(data["audio"]), fmt)
        except AudioFormatError as exc:
            raise ProtocolError(exc.code, exc.message, event_id) from None
        if data.get("force_barge_in") or data.get("overlap_action") == "barge_in":
            self._in_order(self._barge_in, event_id)

    def _client_input_audio_buffer_commit(self, data: dict[str, Any], event_id: str | None) -> None:
        if data.get("is_speech") is False:  # a declared silence: nothing for the model to answer
            self._in_order(lambda: self._listen("silence_commit"), event_id)
            return
        super()._client_input_audio_buffer_commit(data, event_id)

    def _client_input_cancel(self, data: dict[str, Any], event_id: str | None) -> None:
        assert self.socket is not None
        self.socket.uplink.clear()
        self.session.clear_output_audio()
        self._out("input_audio_buffer.cleared")

    def _client_input_text_append(self, data: dict[str, Any], event_id: str | None) -> None:
        raise ProtocolError("native_text_append_unsupported", "this model takes speech only", event_id)

    def _barge_in(self) -> None:
        if self.session.responses.active is not None:
            self.session.interrupt("barge_in")
        self._out("turn.event", event="barge_in", turn_state=self.session.state)

    def _client_barge_in(self, data: dict[str, Any], event_id: str | None) -> None:
        self._in_order(self._barge_in, event_id)

    def _client_turn_signal(self, data: dict[str, Any], event_id: str | None) -> None:
        if data["event"] != "barge_in":
            raise ProtocolError("bad_event", f"turn.signal event {data['event']!r} is not known here", event_id)
        self._in_order(self._barge_in, event_id)

    def _client_session_heartbeat(self, data: dict[str, Any], event_id: str | None) -> None:
        self._out("session.heartbeat_ack", session_id=self.session.id)

    def _client_session_event_ack(self, data: dict[str, Any], event_id: str | None) -> None:
        self.journal.ack(data["server_event_seq"])

    def _client_session_close(self, data: dict[str, Any], event_id: str | None) -> None:
        self._close_reason = "client_close"
        self._in_order(lambda: self.session.request_close("client_closed"), event_id)

    def _client_session_resume(self, data: dict[str, Any], event_id: str | None) -> None:
        raise ProtocolError("session_exists", "this socket already has a session; resume on a new socket",
                            event_id)

    def _client_playback_ack(self, data: dict[str, Any], event_id: str | None) -> None:
        rid, item_id = data.get("response_id"), data.get("item_id")
        if rid is None and item_id is not None:
            rid = "resp_" + item_id.removeprefix("item_")
        if rid is None:  # no ids: the answer being said, else the last one
            rid = self.session.responses.active or self._last_ended
        if rid is not None and item_id is not None and item_id != f"item_{rid.removeprefix('resp_')}":
            raise ProtocolError("playback_item_mismatch", f"item {item_id!r} is not response {rid!r}'s", event_id)
        record = self.session.responses.ledger.get(rid)
        if record is None:
            raise ProtocolError("playback_item_not_found", f"no response {rid!r} to acknowledge", event_id)
        played = max(float(data["played_ms"]), record.client_played_ms or 0.0)
        truncate = bool(data.get("truncate"))
        if truncate and self.session.responses.active == rid:
            self.session.cancel_response(rid, event_id)
        self.session.ack_playback(rid, played, event_id)
        self._out("playback.acknowledged", event={
            "epoch": self.session.epoch, "response_id": rid, "item_id": f"item_{rid.removeprefix('resp_')}",
            "played_ms": played, "committed_ms": float(data.get("committed_ms", played)), "truncate": truncate,
            "playback": self._playback(record), "history_committed": True})
