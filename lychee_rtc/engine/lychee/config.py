"""Parse and validate a Lychee-FD ``config.json``.

The released checkpoint (``HIT-TMG/Lychee-FD``) is read exactly as written: nested Qwen2 dicts for
the four decoder stacks, ``control_branch_layer`` counted from the top of the main stack, an
``audio_encoder_config`` for the Whisper-style encoder, and one ``*_token_id`` field per duplex
special token. Every structural value comes from the file; nothing about the released sizes is
hard-coded, so a tiny checkpoint in the same layout loads through the same code.

Anything missing or inconsistent raises :class:`ConfigError` naming the field, before any tensor
is allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# ``model_type`` values written by the training code (new name) and by every checkpoint saved
# before the rename, including the released one.
MODEL_TYPES = ("step_audio_2_full_duplex", "lychee_full_duplex")
# Architecture names used by the reference, its vLLM integration and vLLM-Omni for one model.
ARCHITECTURES = (
    "StepAudio2FullDuplex",
    "LycheeFD",
    "LycheeFullDuplex",
    "LycheeFullDuplexForConditionalGeneration",
)

# Duplex token ids that must be present as ints (``text_sleep_token_id`` is written as null by the
# training code and never used, so it is not required).
REQUIRED_TOKEN_FIELDS = (
    "start_speaking_token_id",
    "start_listening_token_id",
    "keep_listening_token_id",
    "keep_speaking_token_id",
    "detect_token_id",
    "sleep_token_id",
    "text_pad_token_id",
    "stoken_pad_token_id",
    "audio_pad_token_id",
    "stoken_delay_token_id",
    "start_bc_token_id",
    "keep_bc_token_id",
    "end_bc_token_id",
)
# Base-vocabulary tokens the runtime looks up by string in the reference. vLLM-Omni writes them into
# config.json; the public checkpoint may not, so the tokenizer is the fallback (see ``resolve``).
BASE_TOKEN_FIELDS = {
    "audio_patch_token_id": "<audio_patch>",
    "tts_start_token_id": "<tts_start>",
    "tts_end_token_id": "<tts_end>",
    "tts_pad_token_id": "<tts_pad>",
    "stoken_audio_token_id_min": "<audio_0>",
    "text_eos_token_id": "<|EOT|>",
}

DECODER_SECTIONS = ("text_config", "stoken_layer_config", "control_layer_config", "merge_layer_config")


class ConfigError(ValueError):
    """config.json is missing a field or holds an inconsistent value; the message names it."""


@dataclass(frozen=True)
class DecoderConfig:
    """One Qwen2 decoder stack (the main backbone or a branch)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class AudioEncoderConfig:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    llm_dim: int
    kernel_size: int
    adapter_stride: int


@dataclass(frozen=True)
class SpecialTokens:
    """Every token id the runner needs, fully resolved."""

    start_speaking: int  # <|S-S|>
    start_listening: int  # <|S-L|>
    keep_listening: int  # <|K-L|>
    keep_speaking: int  # <|K-S|>
    detect: int
    sleep: int
    text_pad: int
    stoken_pad: int
    audio_pad: int
    stoken_delay: int
    start_bc: int
    keep_bc: int
    end_bc: int
    audio_patch: int
    tts_start: int
    tts_end: int
    tts_pad: int
    audio_code_min: int  # id of <audio_0>; codec c <-> audio_code_min + c
    text_eos: int  # <|EOT|>


@dataclass(frozen=True)
class LycheeConfig:
    model_type: str
    architectures: tuple[str, ...]
    text: DecoderConfig
    stoken: DecoderConfig
    control: DecoderConfig
    merge: DecoderConfig
    control_branch_layer: int  # counted from the top of the main stack
    audio: AudioEncoderConfig
    control_token_chunk_size: int
    stoken_delay_num: int
    stoken_token_ids_min: int
    stoken_token_ids_max: int
    control_token_ids_min: int
    control_token_ids_max: int
    stoken_codec_vocab_size: int
    torch_dtype: str | None
    # Raw id fields; base-vocabulary ones may be None until resolved against the tokenizer.
    token_fields: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def stoken_branch_index(self) -> int:
        """Residual stream after this many main layers feeds the stoken branch."""
        return self.text.num_hidden_layers - self.stoken.num_hidden_layers

    @property
    def control_branch_index(self) -> int:
        """Residual stream after this many main layers feeds the control branch (20 released)."""
        return self.text.num_hidden_layers - self.control_branch_layer

    def resolve_tokens(self, lookup: "TokenLookup | None" = None) -> SpecialTokens:
        """Fill base-vocabulary ids missing from config.json from the tokenizer, then check them."""
        ids: dict[str, int] = {}
        for name, value in self.token_fields.items():
            if value is not None:
                ids[name] = int(value)
        for name, string in BASE_TOKEN_FIELDS.items():
            if name in ids:
                continue
            found = lookup.token_to_id(string) if lookup is not None else None
            if found is None:
                raise ConfigError(
                    f"config.json: '{name}' is missing and the tokenizer has no token {string!r}"
                )
            ids[name] = int(found)
        vocab = self.text.vocab_size
        for name, value in ids.items():
            if not 0 <= value < vocab:
                raise ConfigError(f"config.json: '{name}' = {value} is outside the vocabulary [0, {vocab})")
        if not (
            ids["tts_start_token_id"]
            < ids["tts_end_token_id"]
            < ids["tts_pad_token_id"]
            < ids["stoken_audio_token_id_min"]
            < self.stoken_token_ids_max
        ):
            raise ConfigError(
                "config.json: expected tts_start_token_id < tts_end_token_id < tts_pad_token_id < "
                "stoken_audio_token_id_min < stoken_token_ids_max, got "
                f"{ids['tts_start_token_id']}, {ids['tts_end_token_id']}, {ids['tts_pad_token_id']}, "
                f"{ids['stoken_audio_token_id_min']}, {self.stoken_token_ids_max}"
            )
        if ids["stoken_audio_token_id_min"] + self.stoken_codec_vocab_size > self.stoken_token_ids_max:
            raise ConfigError(
                "config.json: 'stoken_codec_vocab_size' reaches past 'stoken_token_ids_max'"
            )
        return SpecialTokens(
            start_speaking=ids["start_speaking_token_id"],
            start_listening=ids["start_listening_token_id"],
            keep_listening=ids["keep_listening_token_id"],
            keep_speaking=ids["keep_speaking_token_id"],
            detect=ids["detect_token_id"],
            sleep=ids["sleep_token_id"],
            text_pad=ids["text_pad_token_id"],
            stoken_pad=ids["stoken_pad_token_id"],
            audio_pad=ids["audio_pad_token_id"],
            stoken_delay=ids["stoken_delay_token_id"],
            start_bc=ids["start_bc_token_id"],
            keep_bc=ids["keep_bc_token_id"],
            end_bc=ids["end_bc_token_id"],
            audio_patch=ids["audio_patch_token_id"],
            tts_start=ids["tts_start_token_id"],
            tts_end=ids["tts_end_token_id"],
            tts_pad=ids["tts_pad_token_id"],
            audio_code_min=ids["stoken_audio_token_id_min"],
            text_eos=ids["text_eos_token_id"],
        )


class TokenLookup:  # pragma: no cover - protocol documentation only
    def token_to_id(self, token: str) -> int | None: ...


# ---------------------------------------------------------------------------------------------


def _int(d: Mapping[str, Any], key: str, where: str) -> int:
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json: '{where}{key}' is missing")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json: '{where}{key}' must be an integer, got {value!r}")
    return value


def _num(d: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    if key not in d or d[key] is None:
        if default is None:
            raise ConfigError(f"config.json: '{where}{key}' is missing")
        return default
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.json: '{where}{key}' must be a number, got {value!r}")
    return float(value)


def _decoder(raw: Mapping[str, Any], section: str, fallback: Mapping[str, Any]) -> DecoderConfig:
    """Parse one decoder section.

    ``text_config`` is serialised compactly (fields equal to Qwen2 defaults dropped) while the layer
    configs are full copies of it with their own layer count, so a value absent from text_config is
    taken from a layer config; ``num_hidden_layers`` never falls back.
    """
    where = f"{section}."

    def get(key: str) -> Any:
        if key in raw and raw[key] is not None:
            return raw[key]
        if key != "num_hidden_layers" and key in fallback:
            return fallback[key]
        return None

    merged = {k: get(k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "rope_theta", "rms_norm_eps", "max_position_embeddings",
        "num_attention_groups", "hidden_act",
    )}
    cfg = DecoderConfig(
        vocab_size=_int(merged, "vocab_size", where),
        hidden_size=_int(merged, "hidden_size", where),
        intermediate_size=_int(merged, "intermediate_size", where),
        num_hidden_layers=_int(merged, "num_hidden_layers", where),
        num_attention_heads=_int(merged, "num_attention_heads", where),
        num_key_value_heads=_int(merged, "num_key_value_heads", where),
        rope_theta=_num(merged, "rope_theta", where),
        # Same default in Qwen2Config and StepAudio2TextConfig, so a compact file may omit it.
        rms_norm_eps=_num(merged, "rms_norm_eps", where, default=1e-6),
        max_position_embeddings=int(_num(merged, "max_position_embeddings", where, default=8192)),
    )
    if cfg.num_hidden_layers <= 0:
        raise ConfigError(f"config.json: '{where}num_hidden_layers' must be > 0")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(f"config.json: '{where}hidden_size' is not divisible by num_attention_heads")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"config.json: '{where}num_attention_heads' is not a multiple of num_key_value_heads"
        )
    if (cfg.hidden_size // cfg.num_attention_heads) % 2:
        raise ConfigError(f"config.json: '{where}' head_dim must be even for RoPE")
    groups = merged.get("num_attention_groups")
    if groups is not None and groups != cfg.num_key_value_heads:
        raise ConfigError(f"config.json: '{where}num_attention_groups' must equal num_key_value_heads")
    act = merged.get("hidden_act")
    if act is not None and act != "silu":
        raise ConfigError(f"config.json: '{where}hidden_act' must be 'silu', got {act!r}")
    return cfg


def parse_config(raw: Mapping[str, Any]) -> LycheeConfig:
    """Validate a config.json dict and return the typed config."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"config.json: 'model_type' must be one of {MODEL_TYPES}, got {model_type!r}")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ConfigError("config.json: 'architectures' is missing")
    if not any(a in ARCHITECTURES for a in archs):
        raise ConfigError(f"config.json: 'architectures' {archs} names none of {ARCHITECTURES}")

    sections: dict[str, Mapping[str, Any]] = {}
    for name in DECODER_SECTIONS:
        value = raw.get(name)
        if not isinstance(value, Mapping):
            raise ConfigError(f"config.json: '{name}' is missing")
        sections[name] = value
    fallback = {k: v for k, v in sections["stoken_layer_config"].items() if v is not None}
    text = _decoder(sections["text_config"], "text_config", fallback)
    stoken = _decoder(sections["stoken_layer_config"], "stoken_layer_config", {})
    control = _decoder(sections["control_layer_config"], "control_layer_config", {})
    merge = _decoder(sections["merge_layer_config"], "merge_layer_config", {})
    for name, sub in (("stoken_layer_config", stoken), ("control_layer_config", control),
                      ("merge_layer_config", merge)):
        for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(sub, key) != getattr(text, key):
                raise ConfigError(
                    f"config.json: '{name}.{key}' = {getattr(sub, key)} differs from "
                    f"text_config.{key} = {getattr(text, key)}"
                )
    if stoken.num_hidden_layers > text.num_hidden_layers:
        raise ConfigError("config.json: 'stoken_layer_config.num_hidden_layers' exceeds the main stack")

    branch = _int(raw, "control_branch_layer", "")
    if not 0 < branch <= text.num_hidden_layers:
        raise ConfigError(
            f"config.json: 'control_branch_layer' = {branch} must be in [1, "
            f"{text.num_hidden_layers}] (counted from the top of the main stack)"
        )

    audio_raw = raw.get("audio_encoder_config")
    if not isinstance(audio_raw, Mapping):
        raise ConfigError("config.json: 'audio_encoder_config' is missing")
    w = "audio_encoder_config."
    audio = AudioEncoderConfig(
        n_mels=_int(audio_raw, "n_mels", w),
        n_audio_ctx=_int(audio_raw, "n_audio_ctx", w),
        n_audio_state=_int(audio_raw, "n_audio_state", w),
        n_audio_head=_int(audio_raw, "n_audio_head", w),
        n_audio_layer=_int(audio_raw, "n_audio_layer", w),
        llm_dim=_int(audio_raw, "llm_dim", w),
        kernel_size=_int(audio_raw, "kernel_size", w),
        adapter_stride=_int(audio_raw, "adapter_stride", w),
    )
    if audio.llm_dim != text.hidden_size:
        raise ConfigError(
            f"config.json: 'audio_encoder_config.llm_dim' = {audio.llm_dim} must equal "
            f"text_config.hidden_size = {text.hidden_size}"
        )
    if audio.n_mels != 128:
        raise ConfigError("config.json: 'audio_encoder_config.n_mels' must be 128 (the front-end is fixed)")
    if audio.n_audio_state % audio.n_audio_head:
        raise ConfigError("config.json: 'audio_encoder_config.n_audio_state' not divisible by n_audio_head")
    if audio.n_audio_ctx < 21:
        raise ConfigError("config.json: 'audio_encoder_config.n_audio_ctx' must cover a 400 ms window (21)")
    if audio.kernel_size != 3 or audio.adapter_stride != 2:
        # The 10-positions-per-window layout (5 features per 400 ms) depends on these two.
        raise ConfigError("config.json: 'audio_encoder_config' kernel_size must be 3 and adapter_stride 2")

    chunk = _int(raw, "control_token_chunk_size", "")
    if chunk != 10:
        raise ConfigError(f"config.json: 'control_token_chunk_size' must be 10, got {chunk}")
    delay = _int(raw, "stoken_delay_num", "")
    if delay < 0:
        raise ConfigError("config.json: 'stoken_delay_num' must be >= 0")

    vocab = text.vocab_size
    s_min = _int(raw, "stoken_token_ids_min", "")
    s_max = _int(raw, "stoken_token_ids_max", "")
    c_min = _int(raw, "control_token_ids_min", "")
    c_max = _int(raw, "control_token_ids_max", "")
    if not 0 <= s_min < s_max <= vocab:
        raise ConfigError("config.json: need 0 <= stoken_token_ids_min < stoken_token_ids_max <= vocab_size")
    if not 0 <= c_min < c_max <= vocab:
        raise ConfigError("config.json: need 0 <= control_token_ids_min < control_token_ids_max <= vocab_size")

    token_fields: dict[str, int | None] = {}
    for name in REQUIRED_TOKEN_FIELDS:
        token_fields[name] = _int(raw, name, "")
    for name in BASE_TOKEN_FIELDS:
        if name == "text_eos_token_id":
            continue  # only the tokenizer's <|EOT|> is authoritative (eos_token_id may be a list)
        if raw.get(name) is not None:
            token_fields[name] = _int(raw, name, "")
    codec = raw.get("stoken_codec_vocab_size", 6561)
    if isinstance(codec, bool) or not isinstance(codec, int) or codec <= 0:
        raise ConfigError("config.json: 'stoken_codec_vocab_size' must be a positive integer")
    for name in REQUIRED_TOKEN_FIELDS:
        if not 0 <= token_fields[name] < vocab:  # type: ignore[operator]
            raise ConfigError(f"config.json: '{name}' = {token_fields[name]} is outside [0, {vocab})")

    dtype = raw.get("torch_dtype", raw.get("dtype"))
    return LycheeConfig(
        model_type=str(model_type),
        architectures=tuple(archs),
        text=text,
        stoken=stoken,
        control=control,
        merge=merge,
        control_branch_layer=branch,
        audio=audio,
        control_token_chunk_size=chunk,
        stoken_delay_num=delay,
        stoken_token_ids_min=s_min,
        stoken_token_ids_max=s_max,
        control_token_ids_min=c_min,
        control_token_ids_max=c_max,
        stoken_codec_vocab_size=codec,
        torch_dtype=str(dtype) if dtype is not None else None,
        token_fields=token_fields,
    )


def load_config(model_root: str | Path) -> LycheeConfig:
    path = Path(model_root) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config.json not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be an object")
    return parse_config(raw)
