import json

import pytest

from lychee_rtc.session.protocol import (ProtocolError, client_event_types, load_schema, parse_client_event,
                                         server_event_types)


def test_catalogue_covers_the_architecture_minimum():
    assert set(client_event_types()) >= {"session.update", "response.cancel", "input_audio_buffer.commit",
                                         "turn.listen", "turn.release", "playback.ack", "ping", "session.close"}
    assert set(server_event_types()) >= {
        "session.created", "session.updated", "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped", "turn.state", "response.created",
        "response.output_audio_transcript.delta", "output_audio_buffer.started", "output_audio_buffer.stopped",
        "output_audio_buffer.cleared", "response.done", "metrics", "pong", "error"}


def test_valid_event_parses():
    ev = parse_client_event(json.dumps({"type": "ping", "event_id": "p1", "client_time": 1.5}))
    assert ev.type == "ping" and ev.event_id == "p1"


@pytest.mark.parametrize("raw, code", [
    (b"\xff\xfe", "invalid_json"),
    ("nope", "invalid_json"),
    ('"string"', "invalid_event"),
    ('{"type": "ping", "client_time": "now"}', "invalid_event"),
    ('{"type": "ping", "surprise": 1}', "invalid_event"),
    ('{"type": "turn.hold"}', "unknown_event"),
])
def test_bad_messages(raw, code):
    with pytest.raises(ProtocolError) as info:
        parse_client_event(raw)
    assert info.value.code == code and info.value.message


def test_schema_is_draft_2020_12():
    assert load_schema()["$schema"].endswith("2020-12/schema")


def test_recorded_examples_match_the_schema():
    from pathlib import Path

    from lychee_rtc.session.protocol import validate_server_event

    examples = Path(__file__).resolve().parents[1] / "signaling" / "examples"
    client = [json.loads(line) for line in (examples / "client-events.jsonl").read_text().splitlines()]
    server = [json.loads(line) for line in (examples / "server-events.jsonl").read_text().splitlines()]
    assert {e["type"] for e in client} >= {"session.update", "response.cancel", "turn.listen", "playback.ack"}
    for event in client:
        assert parse_client_event(json.dumps(event)).type == event["type"]
    for event in server:
        validate_server_event(event)
    cleared = next(i for i, e in enumerate(server) if e["type"] == "output_audio_buffer.cleared")
    cancelled = next(i for i, e in enumerate(server)
                     if e["type"] == "response.done" and e["response"]["status"] == "cancelled")
    assert cleared < cancelled and server[cleared]["response_id"] == server[cancelled]["response_id"]
