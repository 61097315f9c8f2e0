"""Server events checked with the ``openai`` package's own pydantic models of the Realtime API.

Our JSON schema (``oai.server.*`` in signaling/events.schema.json) is our reading of OpenAI's
events; a mistake in it would let our events and our checks agree with each other. The SDK's
models (``openai.types.realtime.RealtimeServerEvent``, generated from OpenAI's API description) are
a second, independent reading. The SDK itself builds its event objects without validating them
(``parse_event``), so a client would not notice a wrong field until it used it: the tests validate.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

import pydantic
from openai.types.realtime import RealtimeServerEvent

# RealtimeServerEvent is Annotated[Union[...], <the SDK's own metadata>]: validate the union,
# dispatched on "type" so that an error names the one model the event should have matched.
_EVENTS = pydantic.TypeAdapter(Annotated[get_args(RealtimeServerEvent)[0], pydantic.Field(discriminator="type")])


def assert_openai_server_events(events: list[dict[str, Any]]) -> None:
    """Every event must be a valid Realtime server event as the ``openai`` package models it."""
    for event in events:
        try:
            _EVENTS.validate_python(event)
        except pydantic.ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                 for e in exc.errors(include_url=False))
            raise AssertionError(f"{event.get('type')!r} is not a Realtime server event to the openai "
                                 f"package: {problems}\n{event}") from None
