"""Checks HTTP responses against signaling/openapi.yaml."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SPEC_PATH = Path(__file__).resolve().parents[1] / "signaling" / "openapi.yaml"


@lru_cache(maxsize=1)
def spec() -> dict[str, Any]:
    return yaml.safe_load(SPEC_PATH.read_text())


def _deref(obj: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in obj and len(obj) == 1:
        node: Any = spec()
        for part in obj["$ref"].lstrip("#/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        obj = node
    return obj


def check_response(path: str, method: str, status: int, headers: Any, body: bytes) -> None:
    """Assert that (status, headers, body) is a documented response of ``method path``."""
    operation = spec()["paths"][path][method.lower()]
    responses = operation["responses"]
    assert str(status) in responses, f"{method} {path}: status {status} is not documented"
    response = _deref(responses[str(status)])
    for name, header in response.get("headers", {}).items():
        if header.get("required"):
            assert name in headers, f"{method} {path} {status}: missing required header {name}"
    content = response.get("content")
    if not content:
        return
    content_type = headers.get("Content-Type", "").split(";")[0].strip()
    assert content_type in content, f"{method} {path} {status}: content type {content_type!r} not documented"
    schema = content[content_type].get("schema")
    if schema is None or schema.get("format") == "binary":  # a file (audio): nothing to validate
        return
    data: Any = json.loads(body) if content_type == "application/json" else body.decode()
    root = dict(spec(), **schema)
    jsonschema.validators.validator_for({"$schema": "https://json-schema.org/draft/2020-12/schema"})(root).validate(data)
