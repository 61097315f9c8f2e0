"""What every section of the settings is, and the error a bad value raises (``config.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from lychee_rtc.strict_text import control_characters


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="after")
    @classmethod
    def _one_line(cls, value: Any) -> Any:
        """No setting is multi-line text: a control character (CR, LF, NUL, ...) in one would reach a
        SIP message (Janus), an HTTP header (ICE servers' Link, CORS) or a URL as it is."""
        texts = value if isinstance(value, list) else list(value.items()) if isinstance(value, dict) else [value]
        for text in texts:
            for part in text if isinstance(text, tuple) else (text,):
                if isinstance(part, str) and (bad := control_characters(part)):
                    raise ValueError(f"contains control characters ({', '.join(bad)})")
        return value
