"""The vocoder section of a profile, validated, and the pool built from it.

Profile shape (proposed key ``engine.lychee.token2wav``; any mapping works)::

    token2wav:
      folder: hf://stepfun-ai/Step-Audio-2-mini/token2wav   # or a folder
      device: cuda            # or cpu / cuda:1 / auto
      dtype: fp32             # flow dtype: fp32 | fp16 | bf16 (HiFT is always fp32)
      hop: 10                 # codes per hop (look-ahead is fixed at 3)
      voices:                 # name -> prompt WAV (any sample rate, <= 17.6 s), or builtin
        default: builtin
        default_male: /models/voices/default_male.wav
      default_voice: default
      max_cached_voices: 4
      long_stream: extend     # or error (see docs/token2wav.md)
      cuda_graphs: auto       # the flow's per-hop solve as CUDA graphs: auto (on CUDA) | on | off

Errors name the key (``<prefix>.voices.default_male``), like the rest of the settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from lychee_rtc.vocoder.token2wav.voices import BUILTIN_VOICE

from .hub import HubReferenceError, resolve_folder


class VocoderSettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Token2WavSettings:
    folder: Path
    voices: dict[str, Path] = field(default_factory=dict)
    default_voice: str | None = None
    device: str = "auto"
    dtype: str = "fp32"
    hop: int = 10
    max_cached_voices: int = 4
    long_stream: str = "extend"
    cuda_graphs: str = "auto"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "engine.lychee.token2wav") -> "Token2WavSettings":
        known = {"folder", "voices", "default_voice", "device", "dtype", "hop", "max_cached_voices", "long_stream",
                 "cuda_graphs"}
        for key in data:
            if key not in known:
                raise VocoderSettingsError(f"{prefix}.{key}: unknown key")
        if "folder" not in data:
            raise VocoderSettingsError(f"{prefix}.folder: required")
        try:  # a folder, or an hf:// reference found in the Hugging Face cache
            folder = resolve_folder(str(data["folder"]), f"{prefix}.folder", "token2wav")
        except HubReferenceError as exc:
            raise VocoderSettingsError(str(exc)) from None
        for name in ("flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx"):
            if not (folder / name).is_file():
                raise VocoderSettingsError(f"{prefix}.folder: {folder} has no {name}")
        voices_raw = data.get("voices") or {}
        if not isinstance(voices_raw, Mapping) or not voices_raw:
            raise VocoderSettingsError(f"{prefix}.voices: a mapping of voice name -> prompt WAV is required")
        voices = {}
        for name, path in voices_raw.items():
            p = BUILTIN_VOICE if str(path) == "builtin" else Path(str(path))
            if not p.is_file():
                raise VocoderSettingsError(f"{prefix}.voices.{name}: no such file {p}")
            voices[str(name)] = p
        default = data.get("default_voice")
        if default is not None and default not in voices:
            raise VocoderSettingsError(f"{prefix}.default_voice: {default!r} is not in voices")
        dtype = str(data.get("dtype", "fp32"))
        if dtype not in ("fp32", "fp16", "bf16"):
            raise VocoderSettingsError(f"{prefix}.dtype: must be fp32, fp16 or bf16")
        device = str(data.get("device", "auto"))
        if not (device in ("auto", "cpu") or device.startswith("cuda")):
            raise VocoderSettingsError(f"{prefix}.device: must be auto, cpu or cuda[:N]")
        try:
            hop = int(data.get("hop", 10))
            cached = int(data.get("max_cached_voices", 4))
        except (TypeError, ValueError) as exc:
            raise VocoderSettingsError(f"{prefix}: hop and max_cached_voices must be integers") from exc
        if not 4 <= hop <= 25:
            raise VocoderSettingsError(f"{prefix}.hop: must be in 4..25")
        if cached < 1:
            raise VocoderSettingsError(f"{prefix}.max_cached_voices: must be >= 1")
        long_stream = str(data.get("long_stream", "extend"))
        if long_stream not in ("extend", "error"):
            raise VocoderSettingsError(f"{prefix}.long_stream: must be extend or error")
        cuda_graphs = data.get("cuda_graphs", "auto")
        if isinstance(cuda_graphs, bool):  # YAML reads an unquoted on/off as a boolean
            cuda_graphs = "on" if cuda_graphs else "off"
        if cuda_graphs not in ("auto", "on", "off"):
            raise VocoderSettingsError(f"{prefix}.cuda_graphs: must be auto, on or off")
        if cuda_graphs == "on" and device == "cpu":
            raise VocoderSettingsError(f"{prefix}.cuda_graphs: on needs a CUDA device (device is cpu)")
        return cls(folder, voices, default, device, dtype, hop, cached, long_stream, cuda_graphs)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def build_token2wav_pool(settings: Token2WavSettings | Mapping[str, Any]):
    """Load the model and voices; the result is the lychee backend's ``vocoder_factory``."""
    from .token2wav_slots import Token2WavPool

    if not isinstance(settings, Token2WavSettings):
        settings = Token2WavSettings.from_mapping(settings)
    return Token2WavPool.load(settings.folder, settings.voices, settings.default_voice,
                              device=settings.resolved_device(), dtype=settings.dtype,
                              max_cached_voices=settings.max_cached_voices, hop=settings.hop,
                              long_stream=settings.long_stream, cuda_graphs=settings.cuda_graphs)
