"""GA Realtime session objects: reading the configuration a client sends, rendering the one it gets.

A client written for OpenAI sends a full GA configuration (model, formats, transcription, turn
detection, tools, ...). What this server can act on becomes typed option changes (instructions,
a voice the engine has); everything else is accepted, and every field whose value differs from
what the session really does is reported back as ignored, so nothing is silently pretended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from lychee_rtc.config import Settings
from lychee_rtc.engine.base import EngineCapabilities, SessionOptions
from lychee_rtc.session.protocol import ProtocolError, validator
from lychee_rtc.ws.formats import PCM16_24K, PCMA, PCMU, SocketAudioFormat

PCM_24K = {"type": "audio/pcm", "rate": 24000}
# GA's three audio formats; ``audio/pcm`` is 24 kHz only (the SDKs' types say so).
GA_FORMATS = {"audio/pcm": PCM16_24K, "audio/pcmu": PCMU, "audio/pcma": PCMA}
FORMAT_PATHS = (("audio", "input", "format"), ("audio", "output", "format"))
# Fields read into options rather than compared (``expires_after`` belongs to a client secret request).
HANDLED = {("type",), ("instructions",), ("audio", "output", "voice"), ("audio", "input", "noise_reduction"),
           ("expires_after",), ("lychee_rtc", "recording")}
# GA ``audio.input.noise_reduction`` as the uplink's processing stages (``audio_processing``): a
# near-field microphone (headset, handset) has noise but no loudspeaker beside it; a far-field one
# (laptop, speakerphone, room) hears the agent too. Gain control is left as it is.
NOISE_REDUCTION = {
    "near_field": {"echo_cancellation": False, "noise_suppression": True, "high_pass_filter": True},
    "far_field": {"echo_cancellation": True, "noise_suppression": True, "high_pass_filter": True},
    None: {"echo_cancellation": False, "noise_suppression": False, "high_pass_filter": False},
}
_MISSING = object()


@dataclass(frozen=True)
class RealtimeProfile:
    """What the GA session object says about this server's engine; fixed for the server's life."""

    model: str
    voices: tuple[str, ...]
    turn_detection: dict[str, Any] | None
    max_duration_s: float

    @classmethod
    def build(cls, settings: Settings, caps: EngineCapabilities) -> "RealtimeProfile":
        return cls(caps.name, caps.voices, _turn_detection(settings, caps), settings.session.max_duration_s)


def _turn_detection(settings: Settings, caps: EngineCapabilities) -> dict[str, Any] | None:
    barge_in = settings.session.vad_barge_in
    if caps.name == "echo":  # a VAD endpoints the user's turn: OpenAI's server_vad, with its real knobs
        echo = settings.engine.echo
        return {"type": "server_vad", "threshold": echo.vad_threshold, "prefix_padding_ms": echo.speech_pad_ms,
                "silence_duration_ms": echo.min_silence_ms, "idle_timeout_ms": None,
                "create_response": True, "interrupt_response": barge_in}
    if caps.name == "loopback":  # no turns at all: the input comes straight back
        return None
    # A full-duplex model decides itself when to speak and when to yield: a model-based detector.
    return {"type": "semantic_vad", "eagerness": "auto", "create_response": True, "interrupt_response": caps.barge_in}


def noise_reduction_of(processing: dict[str, Any] | None) -> dict[str, str] | None:
    """The GA ``noise_reduction`` that describes the uplink's processing (``audio_processing``)."""
    if not processing:
        return None
    if processing.get("echo_cancellation"):
        return {"type": "far_field"}
    if processing.get("noise_suppression"):
        return {"type": "near_field"}
    return None


def ga_format(fmt: SocketAudioFormat) -> dict[str, Any]:
    """A socket's audio format as GA names it."""
    if fmt.encoding == "g711_ulaw":
        return {"type": "audio/pcmu"}
    if fmt.encoding == "g711_alaw":
        return {"type": "audio/pcma"}
    return dict(PCM_24K)


def format_of(raw: dict[str, Any], where: str, event_id: str | None = None) -> SocketAudioFormat:
    """A GA audio format (already schema-checked) as the socket's; ``audio/pcm`` at 24 kHz only."""
    fmt = GA_FORMATS[raw["type"]]
    if raw["type"] == "audio/pcm" and raw.get("rate", 24000) != 24000:
        raise ProtocolError("unsupported_audio_format", f"{where}: audio/pcm is 24000 Hz here (as in OpenAI's API), "
                            f"not {raw['rate']}", event_id)
    return fmt


def requested_formats(raw: dict[str, Any], event_id: str | None = None
                      ) -> tuple[SocketAudioFormat | None, SocketAudioFormat | None]:
    """The input and output formats a socket's client asks for (None: unchanged)."""
    audio = raw.get("audio") or {}
    found: list[SocketAudioFormat | None] = []
    for side in ("input", "output"):
        fmt = (audio.get(side) or {}).get("format")
        found.append(None if fmt is None else format_of(fmt, f"session.audio.{side}.format", event_id))
    return found[0], found[1]


def render_session(profile: RealtimeProfile, *, session_id: str | None, instructions: str | None,
                   voice: str | None, expires_at: int | None,
                   noise_reduction: dict[str, str] | None = None,
                   formats: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The GA session object, describing what the session really does. ``formats``: a socket's
    input and output formats; over WebRTC the PCM the engine works in is described."""
    in_format, out_format = formats or (dict(PCM_24K), dict(PCM_24K))
    session: dict[str, Any] = {"object": "realtime.session", "type": "realtime"}
    if session_id is not None:
        session["id"] = session_id
    session.update({
        "model": profile.model,
        "output_modalities": ["audio"],
        "instructions": instructions or "",
        "audio": {
            "input": {"format": in_format, "transcription": None, "noise_reduction": noise_reduction,
                      "turn_detection": profile.turn_detection},
            "output": {"format": out_format, "voice": voice, "speed": 1.0},
        },
        "tools": [],
        "tool_choice": "auto",
        "max_output_tokens": "inf",
        "tracing": None,
    })
    if expires_at is not None:
        session["expires_at"] = expires_at
    return session


def render_live_session(profile: RealtimeProfile, info: dict[str, Any], created_at_wall: float,
                        formats: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The GA session object of a running session, from the session's own ``describe()``."""
    return render_session(profile, session_id=info["id"], instructions=info.get("instructions"),
                          voice=info.get("voice"), expires_at=int(created_at_wall + profile.max_duration_s),
                          noise_reduction=noise_reduction_of(info.get("audio_processing")), formats=formats)


@dataclass(frozen=True)
class SessionRequest:
    changes: dict[str, Any]  # keys of the session's own ``session_config``: instructions, voice, audio_processing
    ignored: tuple[str, ...]  # dotted paths of requested values this session does not have


def read_session_config(raw: Any, profile: RealtimeProfile, event_id: str | None = None,
                        formats_apply: bool = False) -> SessionRequest:
    """Validate a GA session configuration and split it into changes and ignored fields.

    ``formats_apply``: the audio formats are the socket's (read with ``requested_formats``), not
    descriptive. Raises ProtocolError (code ``invalid_session``) for a malformed configuration.
    """
    errors = sorted(validator("oai.session_config").iter_errors(raw), key=lambda e: list(e.path))
    if errors:
        where = ".".join(str(p) for p in errors[0].path)
        raise ProtocolError("invalid_session", f"session{'.' + where if where else ''}: {errors[0].message}", event_id)
    if raw.get("type", "realtime") != "realtime":
        raise ProtocolError("unsupported_session_type",
                            f"session.type {raw['type']!r} is not supported: only 'realtime' sessions", event_id)
    changes: dict[str, Any] = {}
    ignored: list[str] = []
    if "instructions" in raw:
        changes["instructions"] = raw["instructions"] or None  # empty: the engine's default prompt
    voice = raw.get("audio", {}).get("output", {}).get("voice", _MISSING)
    if voice is not _MISSING and voice is not None:
        if voice in profile.voices:
            changes["voice"] = voice
        else:  # OpenAI's voice names do not exist here; the engine's own voice plays
            ignored.append("audio.output.voice")
    audio_input = raw.get("audio", {}).get("input", {})
    if "noise_reduction" in audio_input:
        wanted = audio_input["noise_reduction"]
        changes["audio_processing"] = dict(NOISE_REDUCTION[None if wanted is None else wanted["type"]])
    extension = raw.get("lychee_rtc", _MISSING)
    if extension is not _MISSING:
        # OpenAI's Realtime API has no recording switch: this server's own field (docs/recording.md).
        if not isinstance(extension, dict) or not isinstance(extension.get("recording", False), bool):
            raise ProtocolError("invalid_session", "session.lychee_rtc must be an object whose `recording` is a "
                                "boolean", event_id)
        if "recording" in extension:
            changes["recording"] = extension["recording"]
    actual = render_session(profile, session_id=None, instructions=None, voice=None, expires_at=None)
    ignored += _differences(raw, actual, (), FORMAT_PATHS if formats_apply else ())
    return SessionRequest(changes, tuple(ignored))


def _differences(requested: dict[str, Any], actual: Any, path: tuple[str, ...],
                 handled: tuple[tuple[str, ...], ...] = ()) -> list[str]:
    out: list[str] = []
    for key, value in requested.items():
        here = path + (key,)
        if here in HANDLED or here in handled:
            continue
        have = actual.get(key, _MISSING) if isinstance(actual, dict) else _MISSING
        if isinstance(value, dict) and isinstance(have, dict):
            out += _differences(value, have, here, handled)
        elif value != have:
            out.append(".".join(here))
    return out


def merge_configs(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``, nested objects merged key by key."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_configs(out[key], value)
        else:
            out[key] = value
    return out


def requested_processing(request: SessionRequest) -> dict[str, bool] | None:
    return request.changes.get("audio_processing")


def session_options(request: SessionRequest) -> SessionOptions:
    return SessionOptions(instructions=request.changes.get("instructions"), voice=request.changes.get("voice"))


def wall_clock_of(monotonic_then: float, monotonic_now: float) -> float:
    """The unix time of a past monotonic instant."""
    return time.time() - (monotonic_now - monotonic_then)
