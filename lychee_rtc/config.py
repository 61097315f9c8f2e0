"""One typed settings object for the whole server.

Precedence, lowest first: the model defaults here, a profile YAML from ``configs/``, environment
variables ``LYCHEE_RTC_<SECTION>__<KEY>`` (double underscore descends one level, values parsed as
YAML scalars or lists), then CLI flags. Any invalid value stops start-up with a message naming the
dotted key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from lychee_rtc.config_base import ConfigError
from lychee_rtc.config_base import Section as _Section
from lychee_rtc.config_transports import TelephonySettings, WebSocketSettings
from lychee_rtc.resources import shared_path, shipped_profile

__all__ = ["ConfigError", "Settings", "TelephonySettings", "WebSocketSettings", "load_settings"]

ENV_PREFIX = "LYCHEE_RTC_"
DEFAULT_PROFILE = shared_path("configs") / "echo.yaml"


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
    web_root: Path | None = None  # defaults to the web client shipped with the server
    max_sdp_bytes: int = Field(64 * 1024, ge=1024)
    # SIGTERM to exit: calls close cleanly (final event, slot released, recording finished) within
    # this, then are forced; waits on clients (bodies, WebSockets) end at once or by then.
    shutdown_grace_s: float = Field(5.0, gt=0, le=300)
    # A request body must arrive within this (408 after): a client that sends half a body holds nothing.
    body_timeout_s: float = Field(10.0, gt=0, le=300)


class RtcSettings(_Section):
    # Always explicit: an empty list means host candidates only (no implicit public STUN server).
    ice_servers: list[IceServer] = Field(default_factory=list)
    codecs: list[Literal["opus", "PCMU", "PCMA"]] = Field(default_factory=lambda: ["opus", "PCMU", "PCMA"], min_length=1)
    # Inbound jitter handling: "lowlatency" is ours, "aiortc" keeps the library default.
    jitter_buffer: Literal["lowlatency", "aiortc"] = "lowlatency"
    jitter_target_ms: int = Field(40, ge=20, le=400)
    # Packet time (docs/benchmarks.md has what each costs and saves): the audio per RTP packet this
    # server sends, and the a=ptime its answers ask peers to send (null: the peer's own choice).
    send_frame_ms: Literal[10, 20] = 20
    receive_ptime_ms: Literal[10, 20] | None = None
    # A passthrough engine (loopback): how early a frame whose audio is there may leave before its
    # slot of the send clock. 0 sends on the clock exactly (regular packets, up to a frame held).
    passthrough_lead_ms: float = Field(15.0, ge=0, le=20)
    # A passthrough engine: "arrival" sends a frame as soon as its audio is there (within the lead),
    # "steady" at one point of its slot just after recent arrivals (rtc/send_phase.py), which keeps
    # the uplink's arrival jitter off the downlink.
    passthrough_pacing: Literal["arrival", "steady"] = "arrival"
    # libopus's application for what this server sends: "lowdelay" (CELT only) has 2.5 ms of
    # algorithmic delay against 6.5 ms for "voip" and "audio". CELT is Opus's mode for high bit
    # rates such as the 96 kbit/s aiortc sends; it gives up SILK's speech coding at low bit rates.
    opus_application: Literal["voip", "audio", "lowdelay"] = "voip"
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


class AudioProcessing(_Section):
    """The uplink's processing stages (WebRTC's audio processing module, ``media/audio_processing.py``)."""

    echo_cancellation: bool = False
    noise_suppression: bool = False
    high_pass_filter: bool = False
    auto_gain_control: bool = False

    @property
    def active(self) -> bool:
        return self.echo_cancellation or self.noise_suppression or self.high_pass_filter or self.auto_gain_control


# A loudspeaker near the microphone: what a phone on speaker, a desk unit or a kiosk sends. The echo
# canceller adds 8 ms to mouth-to-ear, noise suppression another 6 ms (docs/benchmarks.md), so noise
# suppression is asked for where the room needs it. Gain control stays off: it pumps the level
# under the model's own loudness handling.
_PHONE_LEG = {"echo_cancellation": True, "high_pass_filter": True}


class AudioProcessingSettings(_Section):
    """The processing each ingress starts with; a session may change its own (``session.update``)."""

    # Browsers cancel their own loudspeaker's echo and suppress noise before they send.
    webrtc: AudioProcessing = Field(default_factory=AudioProcessing)
    whip: AudioProcessing = Field(default_factory=lambda: AudioProcessing(**_PHONE_LEG))
    sip: AudioProcessing = Field(default_factory=lambda: AudioProcessing(**_PHONE_LEG))  # the SIP gateway's legs
    carrier: AudioProcessing = Field(default_factory=lambda: AudioProcessing(**_PHONE_LEG))  # media streams
    # Audio in WebSocket events (the OpenAI Realtime and vLLM-Omni dialects): the application
    # captured and cleaned it; when the listener hears the answer is not known here.
    websocket: AudioProcessing = Field(default_factory=AudioProcessing)

    def for_ingress(self, ingress: str) -> AudioProcessing:
        return getattr(self, ingress)


class EchoSettings(_Section):
    mode: Literal["echo", "loopback"] = "echo"
    vad_threshold: float = Field(0.5, gt=0, lt=1)
    min_speech_ms: int = Field(200, ge=0)
    min_silence_ms: int = Field(600, ge=32)
    speech_pad_ms: int = Field(96, ge=0)
    max_utterance_s: float = Field(15.0, gt=0, le=120)
    # Chunks sent with the first step of a response, so playout has slack against window jitter.
    prebuffer_chunks: int = Field(2, ge=1, le=10)
    # Each answer plays the utterance this many times: a short question makes a long answer, for
    # measuring what the agent hears of itself while it speaks (echo cancellation).
    answer_repeats: int = Field(1, ge=1, le=100)
    loopback_window_ms: int = Field(20, ge=10, le=400)


class EngineSettings(_Section):
    name: Literal["echo", "lychee"] = "echo"
    echo: EchoSettings = Field(default_factory=EchoSettings)
    # Backend-specific settings for the lychee engine, validated by that backend when it loads.
    lychee: dict[str, Any] = Field(default_factory=dict)


class MetricsSettings(_Section):
    enabled: bool = True


class ClusterSettings(_Section):
    """``lychee-rtc cluster serve``: one signaling entry in front of worker processes placed by Ray."""

    # Where the Ray cluster is: null starts a local Ray inside the entry; "auto" or "host:port" joins one.
    address: str | None = None
    namespace: str = Field("lychee-rtc", min_length=1)
    # "auto": one worker per GPU (worker_gpus > 0), else one per unit of worker_resource in the cluster.
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    worker_gpus: float = Field(0.0, ge=0)
    worker_cpus: float = Field(1.0, ge=0)
    # On CPU nodes, `ray start --resources '{"lychee_rtc_worker": N}'` says how many workers a node hosts.
    worker_resource: str = Field("lychee_rtc_worker", min_length=1)
    # The address each worker's own HTTP port listens on (default: its Ray node's IP), and the ports
    # it may take ([first, last], both included; null: any free port).
    worker_host: str | None = None
    worker_ports: tuple[int, int] | None = None
    # Ray restarts a dead worker this many times (-1: always).
    max_restarts: int = Field(-1, ge=-1)
    poll_interval_s: float = Field(0.5, gt=0, le=60)
    status_timeout_s: float = Field(2.0, gt=0, le=60)
    connect_timeout_s: float = Field(2.0, gt=0, le=60)
    forward_timeout_s: float = Field(30.0, gt=0, le=600)
    drain_timeout_s: float = Field(600.0, gt=0)
    # Object store of a local Ray started by the entry (address: null); signaling moves little data.
    local_object_store_mb: int = Field(128, ge=75)

    @field_validator("worker_ports")
    @classmethod
    def _port_range(cls, ports: tuple[int, int] | None) -> tuple[int, int] | None:
        if ports is not None and not (1 <= ports[0] <= ports[1] <= 65535):
            raise ValueError("worker_ports must be [first, last] with 1 <= first <= last <= 65535")
        return ports


class JanusGatewaySettings(_Section):
    """Phone calls through a Janus media gateway (its SIP plugin), see docs/telephony.md."""

    enabled: bool = False
    url: str = Field("ws://127.0.0.1:8188", pattern=r"^wss?://")  # Janus WebSocket API
    api_secret: str | None = None
    # The SIP identity the bot registers; callers dial it through the registrar.
    sip_uri: str = Field("sip:lychee@127.0.0.1", pattern=r"^sips?:[^@\s]+@\S+$")
    # Janus insists on a secret even when the registrar never challenges.
    secret: str = Field("lychee", min_length=1)
    registrar: str = Field("sip:127.0.0.1:5060", pattern=r"^sips?:\S+$")
    # Shown to callers in the Contact; None leaves it out (some user agents mishandle it).
    display_name: str | None = None
    register_ttl_s: int = Field(300, ge=5, le=86400)
    # Janus takes one call per plugin handle; default: session capacity + 1, so that the call
    # after the last free session still reaches us and is refused with 486 Busy Here.
    lines: int | None = Field(None, ge=1, le=257)
    reconnect_max_s: float = Field(5.0, gt=0, le=300)
    request_timeout_s: float = Field(10.0, gt=0, le=120)
    # OpenAI-style SIP call control: with a URL, each incoming call is announced to it by a signed
    # realtime.call.incoming webhook and waits (ringing) for POST /v1/realtime/calls/{id}/accept or
    # /reject; without one, calls are answered at once. The secret is OpenAI's whsec_<base64> form.
    webhook_url: str | None = Field(None, pattern=r"^https?://\S+$")
    webhook_secret: str | None = Field(None, pattern=r"^whsec_[A-Za-z0-9+/]+={0,2}$")
    webhook_timeout_s: float = Field(5.0, gt=0, le=60)
    # How long a call announced by the webhook rings before it is declined (480) for want of an answer.
    decision_timeout_s: float = Field(30.0, gt=0, le=300)
    # A placed call rings this long by default before it counts as not answered (the request may say).
    ring_timeout_s: float = Field(30.0, ge=1, le=300)
    # A configured transfer rule: a key the caller presses -> where the call is transferred (blind),
    # e.g. {"0": "sip:operator@pbx.example.com"} for "press 0 for a person".
    transfer_keys: dict[str, str] = Field(default_factory=dict)
    # Music on hold: a WAV file played, looped, to a held caller (hold then defaults to a=sendonly);
    # None: silence (a=inactive).
    hold_audio: Path | None = None

    @model_validator(mode="after")
    def _webhook_needs_secret(self) -> "JanusGatewaySettings":
        if self.webhook_url is not None and self.webhook_secret is None:
            raise ValueError("gateway.janus.webhook_url needs webhook_secret (whsec_<base64>) to sign its webhooks")
        for key, target in self.transfer_keys.items():
            if len(key) != 1 or key.upper() not in "0123456789*#ABCD":
                raise ValueError(f"gateway.janus.transfer_keys: {key!r} is not a keypad key")
            if not re.fullmatch(r"sips?:[^@\s<>\"]+@[^\s<>\"]+|tel:\+?[0-9*#][0-9*#().-]*", target):
                raise ValueError(f"gateway.janus.transfer_keys[{key!r}]: {target!r} is not a sip: or tel: URI")
        if self.hold_audio is not None and not self.hold_audio.is_file():
            raise ValueError(f"gateway.janus.hold_audio {str(self.hold_audio)!r} is not a file")
        return self


class RecordingS3Settings(_Section):
    """Finished recordings are also uploaded here (any S3-compatible store; needs the ``s3`` extra)."""

    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = ""  # object keys: <prefix><session_id>/audio.ogg, events.jsonl, meta.json
    endpoint_url: str | None = Field(None, pattern=r"^https?://")
    region: str | None = None
    # Unset: the usual AWS credential chain (environment, shared files, instance role).
    access_key_id: str | None = None
    secret_access_key: str | None = None


class RecordingSettings(_Section):
    """Call recording (docs/recording.md): the caller and what the caller heard, Ogg/Opus + a sidecar."""

    # Record every session from its start; otherwise only sessions that ask (session.update).
    enabled: bool = False
    # Whether a client may turn its session's recording on, pause or resume it with session.update.
    client_control: bool = True
    directory: Path = Path("recordings")
    bitrate: int = Field(32000, ge=12000, le=256000)  # both channels together, bits per second
    # libopus's complexity (0-10). 10, its default, spends 2-4 times the CPU of 5 on this audio at
    # this bitrate for no measurable gain; a call's own Opus on a phone runs at about 5 too.
    complexity: int = Field(5, ge=0, le=10)
    # Retention, enforced at start-up and whenever a recording ends: older or beyond the total go first.
    max_age_s: float = Field(30 * 86400.0, gt=0)
    max_total_bytes: int = Field(10 * 2**30, ge=2**20)
    # Items (20 ms frames, events) waiting for the writer thread; beyond it they are dropped and counted.
    queue_items: int = Field(2000, ge=50, le=100000)
    s3: RecordingS3Settings | None = None


class GatewaySettings(_Section):
    janus: JanusGatewaySettings = Field(default_factory=JanusGatewaySettings)


class Settings(_Section):
    server: ServerSettings = Field(default_factory=ServerSettings)
    rtc: RtcSettings = Field(default_factory=RtcSettings)
    session: SessionSettings = Field(default_factory=SessionSettings)
    audio_processing: AudioProcessingSettings = Field(default_factory=AudioProcessingSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    telephony: TelephonySettings = Field(default_factory=TelephonySettings)
    websocket: WebSocketSettings = Field(default_factory=WebSocketSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    recording: RecordingSettings = Field(default_factory=RecordingSettings)

    @model_validator(mode="after")
    def _web_root_exists(self) -> "Settings":
        root = self.server.web_root
        if root is not None and not root.is_dir():
            raise ValueError(f"server.web_root {str(root)!r} is not a directory")
        return self

    @property
    def web_root(self) -> Path:
        return self.server.web_root or shared_path("web")


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


def _has_path(tree: Mapping[str, Any], path: tuple[Any, ...]) -> bool:
    node: Any = tree
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _env_name(path: tuple[Any, ...], environ: Mapping[str, str]) -> str:
    """The environment variable that set ``path`` (or one of its parents), as the user spelled it."""
    for depth in range(len(path), 0, -1):
        want = [str(p).lower() for p in path[:depth]]
        for name in environ:
            if name.startswith(ENV_PREFIX) and [p.lower() for p in name[len(ENV_PREFIX):].split("__")] == want:
                return name
    return ENV_PREFIX + "__".join(str(p).upper() for p in path)


def _format_validation_error(exc: ValidationError, profile: str, env: Mapping[str, Any],
                             environ: Mapping[str, str], overrides: Mapping[str, Any]) -> str:
    """One line per bad key, each naming where its value came from: flag, environment or file."""
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        # The value of a key comes from the highest layer that has it (or a parent of it).
        prefixes = [loc[:n] for n in range(len(loc), 0, -1)]
        if any(_has_path(overrides, p) for p in prefixes):
            origin = "command line"
        elif any(_has_path(env, p) for p in prefixes):
            origin = f"environment variable {_env_name(loc, environ)}"
        else:
            origin = profile
        problems.append(f"{key}: {msg} (from {origin})")
    return "invalid configuration: " + "; ".join(problems)


def resolve_profile(path: str | Path) -> Path:
    """A profile path as given; a bare name (``loopback``) that is no file names a shipped profile."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    shipped = shipped_profile(str(path))
    return shipped if shipped is not None else candidate


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
    profile = resolve_profile(path) if path is not None else DEFAULT_PROFILE
    data = read_profile(profile) if (path is not None or profile.exists()) else {}
    env = env_overrides(environ)
    overrides = overrides or {}
    data = _merge(_merge(data, env), overrides)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, f"config file {profile}", env, environ, overrides)) from None
