"""The duplex dialect's ``session.update``: GA's fields, the beta spellings, and vLLM-Omni's own.

A duplex client names its audio as an encoding (``pcm16``, ``pcm_s16le``, ``s16le``, ``pcm_f32le``,
``g711_ulaw``, ``g711_alaw``) and a rate (top-level ``sample_rate_hz``, ``audio.input.sample_rate_hz``),
or as GA format objects. Turn detection is the model's own (``null``) or ``server_vad`` that cuts an
answer on speech (``interrupt_response`` true); anything else is refused
(``unsupported_turn_detection``), as vLLM-Omni does. Model-specific keys (``extra_body``, ``ref_audio``,
overlap and playback policies, ...) are accepted and reported back as not applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lychee_rtc.server.openai.session_config import GA_FORMATS, RealtimeProfile
from lychee_rtc.session.protocol import ProtocolError
from lychee_rtc.ws.formats import AudioFormatError, SocketAudioFormat

ENCODINGS = {"pcm16": "pcm16", "pcm_s16le": "pcm16", "s16le": "pcm16", "pcm_f32le": "pcm_f32le",
             "g711_ulaw": "g711_ulaw", "g711_alaw": "g711_alaw"}
APPLIED = {"model", "modalities", "output_modalities", "instructions", "voice", "input_audio_format",
           "output_audio_format", "sample_rate_hz", "audio", "turn_detection", "type"}


@dataclass(frozen=True)
class DuplexRequest:
    changes: dict[str, Any]  # the session's own option changes (instructions, voice)
    input_format: SocketAudioFormat | None
    output_format: SocketAudioFormat | None
    ignored: tuple[str, ...]  # keys accepted but not applied


def audio_format(encoding: Any, rate: Any, default_rate: int, where: str,
                 event_id: str | None = None) -> SocketAudioFormat:
    """A duplex encoding name (or a GA format object) and a rate, as the socket's format."""
    try:
        if isinstance(encoding, dict):
            if encoding.get("type") not in GA_FORMATS:
                raise AudioFormatError("unsupported_audio_format", f"unknown format type {encoding.get('type')!r}")
            fmt = GA_FORMATS[encoding["type"]]
            rate = encoding.get("rate", rate)
            encoding = fmt.encoding
            default_rate = fmt.rate
        if encoding not in ENCODINGS:
            raise AudioFormatError("unsupported_audio_format", f"encoding {encoding!r} is not one of "
                                   f"{sorted(ENCODINGS)}")
        name = ENCODINGS[encoding]
        if rate is None:
            rate = 8000 if name.startswith("g711") else default_rate
        if isinstance(rate, bool) or not isinstance(rate, int):
            raise AudioFormatError("unsupported_audio_format", "the sample rate must be an integer (Hz)")
        return SocketAudioFormat(name, rate)  # type: ignore[arg-type]
    except AudioFormatError as exc:
        raise ProtocolError(exc.code, f"{where}: {exc.message}", event_id) from None


def read_duplex_config(raw: Any, profile: RealtimeProfile, input_rate: int, output_rate: int,
                       event_id: str | None = None) -> DuplexRequest:
    if not isinstance(raw, dict):
        raise ProtocolError("bad_event", "session must be an object", event_id)
    changes: dict[str, Any] = {}
    if "instructions" in raw:
        if raw["instructions"] is not None and not isinstance(raw["instructions"], str):
            raise ProtocolError("bad_event", "session.instructions must be a string", event_id)
        changes["instructions"] = raw["instructions"] or None
    ignored = [key for key in raw if key not in APPLIED]
    voice = raw.get("voice")
    if voice is not None:
        if voice in profile.voices:
            changes["voice"] = voice
        else:
            ignored.append("voice")
    audio = raw.get("audio") if isinstance(raw.get("audio"), dict) else {}
    side_in = audio.get("input") if isinstance(audio.get("input"), dict) else {}
    side_out = audio.get("output") if isinstance(audio.get("output"), dict) else {}
    in_encoding = side_in.get("format", raw.get("input_audio_format"))
    in_rate = side_in.get("sample_rate_hz", raw.get("sample_rate_hz"))
    out_encoding = side_out.get("format", raw.get("output_audio_format"))
    out_rate = side_out.get("sample_rate_hz")
    input_format = None if in_encoding is None and in_rate is None else audio_format(
        in_encoding or "pcm16", in_rate, input_rate, "session.input_audio_format", event_id)
    output_format = None if out_encoding is None and out_rate is None else audio_format(
        out_encoding or "pcm16", out_rate, output_rate, "session.output_audio_format", event_id)
    if "turn_detection" in raw:
        check_turn_detection(raw["turn_detection"], event_id)
    return DuplexRequest(changes, input_format, output_format, tuple(ignored))


def check_turn_detection(value: Any, event_id: str | None) -> None:
    """``null`` (the model's own turns) or ``server_vad`` that cuts an answer on speech."""
    if value is None:
        return
    if isinstance(value, dict) and value.get("type") == "server_vad" and value.get("interrupt_response", True):
        return
    raise ProtocolError("unsupported_turn_detection", "turn_detection must be null (the model decides) or "
                        "server_vad with interrupt_response true", event_id)
