"""Strict JSON for every edge: nothing non-finite in or out, one exception type for bad text.

A browser's ``JSON.parse`` rejects NaN and Infinity, and Python's ``json`` accepts and writes them;
every reader and writer of client, carrier or HTTP JSON goes through these two functions.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

log = logging.getLogger(__name__)


class JsonError(ValueError):
    """Text that is not strict JSON: malformed, nested too deeply, or with a non-finite number."""


def _reject_constant(name: str) -> Any:
    raise JsonError(f"non-finite number {name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"number {text[:40]} is out of range")
    return value


def strict_json_loads(text: str | bytes) -> Any:
    """``json.loads`` that never lets NaN, Infinity or an overflowing float in, and fails only with JsonError."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except JsonError:
        raise
    except json.JSONDecodeError as exc:
        raise JsonError(f"{exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise JsonError("nested too deeply") from None
    except ValueError as exc:  # an integer beyond Python's digit limit, and the like
        raise JsonError(str(exc)) from None


def strict_json_dumps(value: Any) -> str:
    """Compact JSON that a browser's JSON.parse accepts: a non-finite float becomes null (and is logged)."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError:
        log.warning("non-finite number in outgoing JSON replaced by null: %r", value)
        return json.dumps(_finite(value), separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
