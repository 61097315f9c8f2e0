"""Strict text for values that end up in SIP messages, SDP or HTTP headers.

A value that reaches a line-based protocol must be one line of printable text: a CR or LF in it
starts a header (or an SDP attribute) of the caller's choosing, and a NUL ends the string early
in C code on the way (Janus, Kamailio). So every such value is checked here, whole: a pattern must
match the entire string (``fullmatch``, never ``match`` with ``$``, which also matches before a
final newline), no control character is allowed anywhere (C0, DEL, C1, and Unicode's line and
paragraph separators), and the length is bounded. One checker, so that a new field or route uses
the same rule.
"""

from __future__ import annotations

import re

# C0 controls (CR, LF, NUL, TAB among them), DEL, C1 controls, LINE and PARAGRAPH SEPARATOR.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class UnsafeText(ValueError):
    """A value refused for a line-based protocol (what it is, and why, in the message)."""


def control_characters(text: str) -> list[str]:
    """The control characters in ``text``, as escapes (``['\\n', '\\x00']``), first few only."""
    return [repr(c)[1:-1] for c in dict.fromkeys(CONTROL.findall(text))][:4]


def strict_text(value: object, what: str, max_chars: int, pattern: re.Pattern[str] | None = None) -> str:
    """``value`` if it is a string of 1..``max_chars`` characters with no control character that
    matches ``pattern`` as a whole; else ``UnsafeText`` naming ``what``."""
    if not isinstance(value, str):
        raise UnsafeText(f"{what} must be a string")
    if not value:
        raise UnsafeText(f"{what} must not be empty")
    if len(value) > max_chars:
        raise UnsafeText(f"{what} is longer than {max_chars} characters")
    bad = control_characters(value)
    if bad:
        raise UnsafeText(f"{what} contains control characters ({', '.join(bad)})")
    if pattern is not None and pattern.fullmatch(value) is None:
        raise UnsafeText(f"{what} is not well-formed")
    return value


def is_strict_text(value: object, max_chars: int, pattern: re.Pattern[str] | None = None) -> bool:
    try:
        strict_text(value, "value", max_chars, pattern)
    except UnsafeText:
        return False
    return True


# An HTTP header value (RFC 9110 field-value, restricted to visible ASCII and spaces: what this
# server puts in a header is ids, URLs and credentials it was configured with).
HEADER_VALUE = re.compile(r"[\x20-\x7e]+")
MAX_HEADER_VALUE = 4096


def header_value(value: object, what: str, max_chars: int = MAX_HEADER_VALUE) -> str:
    return strict_text(value, what, max_chars, HEADER_VALUE)
