"""What every section of the settings is, and the error a bad value raises (``config.py``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
