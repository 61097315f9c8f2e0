"""What the GA dialect remembers of a conversation: the recent items, as the SDKs keep their history.

The model's own memory is its context, which no client event edits; this record is what the GA
events name (``conversation.item.*``): the user's turns the engine endpointed, the answers with their
transcripts, and items a client created. It answers ``retrieve``, ``delete`` and ``truncate`` the way
an SDK's history expects, and is bounded (``MAX_ITEMS``, ``MAX_TRANSCRIPT_CHARS``).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from typing import Any

MAX_ITEMS = 64  # recent items kept for conversation.item.retrieve
MAX_TRANSCRIPT_CHARS = 32_000
# Content parts an echoed client item keeps, with the fields each may carry.
CONTENT_FIELDS = {
    "input_text": ("text",), "input_audio": ("transcript",), "text": ("text",), "output_text": ("text",),
    "output_audio": ("transcript",), "audio": ("transcript",), "input_image": ("image_url", "detail"),
}
ROLES = ("user", "assistant", "system")


def user_audio_item(item_id: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_audio", "transcript": None}]}


def assistant_item(item_id: str, status: str, transcript: str | None) -> dict[str, Any]:
    content = [] if transcript is None else [{"type": "output_audio", "transcript": transcript}]
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant", "status": status,
            "content": content}


def client_item(raw: dict[str, Any]) -> dict[str, Any]:
    """A client's ``conversation.item.create`` item in GA shape (its id kept, or one given), or
    ValueError naming what makes it no item a GA conversation holds."""
    item_id = raw.get("id")
    if item_id is None:
        item_id = "item_" + secrets.token_hex(8)
    if not isinstance(item_id, str) or not 0 < len(item_id) <= 128 or not item_id.isprintable():
        raise ValueError("item.id must be a string of 1 to 128 printable characters")
    kind = raw.get("type", "message")
    if kind == "message":
        role = raw.get("role")
        if role not in ROLES:
            raise ValueError(f"item.role must be one of {list(ROLES)}")
        content = raw.get("content", [])
        if not isinstance(content, list):
            raise ValueError("item.content must be a list")
        parts = []
        for part in content[:16]:
            if not isinstance(part, dict) or part.get("type") not in CONTENT_FIELDS:
                raise ValueError(f"item.content parts must be objects whose type is one of {sorted(CONTENT_FIELDS)}")
            parts.append({"type": part["type"], **{k: part[k] for k in CONTENT_FIELDS[part["type"]]
                                                  if isinstance(part.get(k), str)}})
        return {"id": item_id, "object": "realtime.item", "type": "message", "role": role, "status": "completed",
                "content": parts}
    if kind == "function_call_output":
        call_id, output = raw.get("call_id"), raw.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str):
            raise ValueError("a function_call_output item needs string call_id and output")
        return {"id": item_id, "object": "realtime.item", "type": "function_call_output", "call_id": call_id,
                "output": output, "status": "completed"}
    raise ValueError("item.type must be message or function_call_output")


class ConversationRecord:
    def __init__(self) -> None:
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.last_item_id: str | None = None

    def remember(self, item: dict[str, Any]) -> None:
        self._items[item["id"]] = item
        self._items.move_to_end(item["id"])
        self.last_item_id = item["id"]
        while len(self._items) > MAX_ITEMS:
            self._items.popitem(last=False)

    def get(self, item_id: str) -> dict[str, Any] | None:
        return self._items.get(item_id)

    def forget(self, item_id: str) -> None:
        self._items.pop(item_id, None)
        if self.last_item_id == item_id:
            self.last_item_id = next(reversed(self._items), None)

    def truncate(self, item_id: str, kept_share: float) -> None:
        """Keep the leading ``kept_share`` of an answer's transcript: with no word timings, the text
        is cut in proportion to the audio kept."""
        item = self._items.get(item_id)
        if item is None or not item.get("content"):
            return
        part = item["content"][0]
        text = part.get("transcript")
        if isinstance(text, str) and kept_share < 1.0:
            part["transcript"] = text[:int(len(text) * max(0.0, kept_share))]
