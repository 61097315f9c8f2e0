"""One typed settings object for the whole server (ARCHITECTURE section 7).

Precedence, lowest first: the model defaults here, a profile YAML from ``configs/``, environment
variables ``LYCHEE_RTC_<SECTION>__<KEY>`` (double underscore descends one level, values parsed as
YAML scalars or lists), then CLI flags. Any invalid value stops start-up with a message naming the
dotted key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "LYCHEE_RTC_"
PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent
DEFAULT_PROFILE = REPO_ROOT / "configs" / "echo.yaml"


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IceServer(_Section):
    urls: list[str] = Field(min_length=1)
    username: str | None = None
    credential: str | None = None

    @field_validator("urls", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("urls")
    @classmethod
    def _scheme(cls, urls: list[str]) -> list[str]:
        from aiortc.rtcicetransport import parse_stun_turn_uri

        for url in urls:
            if not url.startswith(("stun:", "stuns:", "turn:", "turns:")):
                raise ValueError(f"ICE server url {url!r} must start with stun:, stuns:, turn: or turns:")
            try:  # the same parser the ICE agent uses, so a bad URL fails here, not on every call
                parse_stun_turn_uri(url)
            except ValueError as exc:
                raise ValueError(f"ICE server url {url!r} is malformed: {exc}") from None
        return urls


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # Browser WHIP clients live on other origins; "*" allows any.
    cors_origins: list[str] = Field(default_factory=lambda: ["*"])
    # When set, signaling requires "Authorization: Bearer <token>".
    auth_token: str | None = None
    web_root: Path | None = None  # defaults to the repository's web/ folder
    max_sdp_bytes: int = Field(64 * 1024, ge=1024)
    # At shutdown, calls get this long to close cleanly (final event, slot released); then forced.
    shutdown_grace_s: float = Field(5.0, gt=0, le=300)


class RtcSettings(_Section):
    # Always explicit: an empty list means host candidates only (no implicit public STUN server).
    ice_servers: list[IceServer] = Field(default_factory=list)
    codecs: list[Literal["opus", "PCMU", "PCMA"]] = Field(default_factory=lambda: ["opus", "PCMU", "PCMA"], min_length=1)
    # Inbound jitter handling: "lowlatency" is ours, "aiortc" keeps the library default.
    jitter_buffer: Literal["lowlatency", "aiortc"] = "lowlatency"
    jitter_target_ms: int = Field(40, ge=20, le=400)
    # ICE consent (RFC 7675): the media path is given up when no consent check was answered this long.
    ice_consent_timeout_s: float = Field(30.0, ge=2, le=300)


class SessionSettings(_Section):
    max_sessions: int = Field(4, ge=1, le=256)
    connect_timeout_s: float = Field(20.0, gt=0)
    # A peer that stops sending media (vanished without closing) is closed after this long.
    media_timeout_s: float = Field(10.0, gt=0)
    max_duration_s: float = Field(3600.0, gt=0)
    # How long past its nominal end a window waits for late uplink samples before silence fills it.
    window_grace_ms: float = Field(120.0, ge=0, le=2000)
    max_pending_windows: int = Field(3, ge=1, le=50)
    playout_max_s: float = Field(30.0, gt=0, le=600)
    # Server VAD barge-in: user speech during audible playback interrupts the response.
    vad_barge_in: bool = True
    event_buffer: int = Field(256, ge=8, le=65536)
    # Resume: after the media path is lost, a new offer with the session's token may re-attach within
    # this long (0: a lost path ends the session); the last events are kept for it to replay.
    resume_window_s: float = Field(30.0, ge=0, le=3600)
    resume_journal_events: int = Field(512, ge=16, le=65536)
    retry_after_s: int = Field(5, ge=1)


class EchoSettings(_Section):
    mode: Literal["echo", "loopback"] = "echo"
    vad_threshold: float = Field(0.5, gt=0, lt=1)
    min_speech_ms: int = Field(200, ge=0)
    min_silence_ms: int = Field(600, ge=32)
    speech_pad_ms: int = Field(96, ge=0)
    max_utterance_s: float = Field(15.0, gt=0, le=120)
    # Chunks sent with the first step of a response, so playout has slack against window jitter.
    prebuffer_chunks: int = Field(2, ge=1, le=10)
    loopback_window_ms: int = Field(20, ge=10, le=400)


class EngineSettings(_Section):
    name: Literal["echo", "lychee"] = "echo"
    echo: EchoSettings = Field(default_factory=EchoSettings)
    # Backend-specific settings for the lychee engine, validated by that backend when it loads.
    lychee: dict[str, Any] = Field(default_factory=dict)


class MetricsSettings(_Section):
    enabled: bool = True


class Settings(_Section):
    server: ServerSettings = Field(default_factory=ServerSettings)
    rtc: RtcSettings = Field(default_factory=RtcSettings)
    session: SessionSettings = Field(default_factory=SessionSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)

    @model_validator(mode="after")
    def _web_root_exists(self) -> "Settings":
        root = self.server.web_root
        if root is not None and not root.is_dir():
            raise ValueError(f"server.web_root {str(root)!r} is not a directory")
        return self

    @property
    def web_root(self) -> Path:
        return self.server.web_root or REPO_ROOT / "web"


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``LYCHEE_RTC_SERVER__PORT=9000`` -> ``{"server": {"port": 9000}}``."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        if not all(path):
            raise ConfigError(f"environment variable {name}: empty key segment")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"environment variable {name}: not a valid value ({exc})") from exc
        _set_path(tree, path, value)
    return tree


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def read_profile(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def load_settings(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the settings: profile file, then environment, then ``overrides`` (CLI flags)."""
    environ = os.environ if environ is None else environ
    if path is None and environ.get(ENV_PREFIX + "CONFIG"):
        path = environ[ENV_PREFIX + "CONFIG"]
    profile = Path(path) if path is not None else DEFAULT_PROFILE
    data = read_profile(profile) if (path is not None or profile.exists()) else {}
    data = _merge(data, env_overrides(environ))
    if overrides:
        data = _merge(data, overrides)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, str(profile))) from None
