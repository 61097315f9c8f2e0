"""The data-channel protocol: client messages validated against signaling/events.schema.json.

The schema is the single definition of the wire format; this module turns a raw message into a
checked ``ClientEvent`` or a ``ProtocolError`` with an OpenAI-style error class and code, and
checks server events against their definitions (the event stream, ``session/event_stream.py``,
gives them their ``seq``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonschema

from lychee_rtc.jsonio import JsonError, strict_json_loads
from lychee_rtc.resources import shared_path

log = logging.getLogger(__name__)

SCHEMA_PATH = shared_path("signaling") / "events.schema.json"
MAX_MESSAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class ClientEvent:
    type: str
    payload: dict[str, Any]

    @property
    def event_id(self) -> str | None:
        return self.payload.get("event_id")


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, event_id: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id
        self.error_type = error_type


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


@lru_cache(maxsize=64)
def validator(definition: str) -> jsonschema.protocols.Validator:
    schema = load_schema()
    sub = {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": f"#/$defs/{definition}"}
    cls = jsonschema.validators.validator_for(schema)
    return cls(sub)


def client_event_types() -> list[str]:
    return sorted(k[len("client."):] for k in load_schema()["$defs"] if k.startswith("client."))


def server_event_types() -> list[str]:
    return sorted(k[len("server."):] for k in load_schema()["$defs"] if k.startswith("server."))


def decode_event(raw: str | bytes, limit: int = MAX_MESSAGE_BYTES) -> tuple[dict[str, Any], str]:
    """A message as a JSON object with a string ``type`` (any dialect); returns it and the type."""
    if isinstance(raw, bytes):
        if len(raw) > limit:
            raise ProtocolError("message_too_large", f"message of {len(raw)} bytes exceeds {limit}")
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("invalid_json", "binary message is not UTF-8 JSON") from None
    if len(raw) > limit:
        raise ProtocolError("message_too_large", f"message of {len(raw)} characters exceeds {limit}")
    try:
        data = strict_json_loads(raw)
    except JsonError as exc:
        raise ProtocolError("invalid_json", f"message is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("invalid_event", "an event must be a JSON object")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    etype = data.get("type")
    if not isinstance(etype, str):
        raise ProtocolError("invalid_event", "missing string field 'type'", event_id)
    return data, etype


def check_event(definition: str, data: dict[str, Any], etype: str) -> None:
    """Raise ProtocolError naming the first field of ``data`` that breaks its schema definition."""
    errors = sorted(validator(definition).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.path) or "<event>"
        event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
        raise ProtocolError("invalid_event", f"{etype}: {where}: {err.message}", event_id)


def parse_client_event(raw: str | bytes) -> ClientEvent:
    data, etype = decode_event(raw)
    if etype not in client_event_types():
        event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
        raise ProtocolError("unknown_event", f"unknown event type {etype!r}", event_id)
    check_event(f"client.{etype}", data, etype)
    return ClientEvent(etype, data)


def validate_server_event(event: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError if ``event`` does not match its server definition."""
    validator(f"server.{event['type']}").validate(event)


def error_body(err: ProtocolError) -> dict[str, Any]:
    body: dict[str, Any] = {"type": err.error_type, "code": err.code, "message": err.message}
    if err.event_id is not None:
        body["event_id"] = err.event_id
    return body
