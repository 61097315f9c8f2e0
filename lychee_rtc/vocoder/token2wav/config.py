"""Hyperparameters of the Token2Wav checkpoint folder.

``flow.yaml`` is HyperPyYAML: every mapping carries a ``!new:<python.class>`` tag that would
instantiate the reference classes. We only need the numbers, so the file is read with a plain YAML
loader that turns each tagged mapping into a dict (the tag kept under ``__class__``). That avoids
hyperpyyaml (which breaks with ruamel.yaml >= 0.19) and never imports reference code.

HiFT has no config file: the reference builds ``HiFTGenerator()`` with class defaults. The two
widths (``base_channels`` and the F0 predictor's ``cond_channels``) are read from the checkpoint
shapes so tiny test checkpoints can use the same loader; everything else is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class CheckpointError(ValueError):
    """The token2wav folder does not match the expected layout (names the offending item)."""


@dataclass(frozen=True)
class EncoderConfig:
    """``UpsampleConformerEncoderV2`` (flow.yaml ``flow.encoder``)."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    up_stride: int = 2
    up_scale_factor: float = 2.0
    key_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.output_size // self.attention_heads


@dataclass(frozen=True)
class DiTConfig:
    """The CFM velocity estimator (flow.yaml ``flow.decoder.estimator``)."""

    in_channels: int = 320
    out_channels: int = 80
    mlp_ratio: float = 4.0
    depth: int = 16
    num_heads: int = 8
    head_dim: int = 64
    hidden_size: int = 512

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


@dataclass(frozen=True)
class FlowConfig:
    """``CausalMaskedDiffWithXvec`` (flow.yaml ``flow``)."""

    input_size: int = 512
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: DiTConfig = field(default_factory=DiTConfig)
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10  # a call argument in the reference; token2wav passes 10 everywhere
    noise_frames: int = 30000  # CFM noise buffer length (600 s at 50 Hz)

    @property
    def up_rate(self) -> int:
        return self.encoder.up_stride

    @property
    def pre_lookahead_len(self) -> int:
        return self.encoder.pre_lookahead_len

    def validate(self) -> None:
        enc, dit = self.encoder, self.estimator
        checks = [
            (enc.input_size == enc.output_size == self.input_size,
             "flow.input_size, flow.encoder.input_size and flow.encoder.output_size must be equal"),
            (enc.output_size % enc.attention_heads == 0,
             "flow.encoder.output_size must be divisible by attention_heads"),
            (dit.in_channels == 4 * self.output_size,
             "flow.decoder.estimator.in_channels must be 4 x flow.output_size (x, mu, spk, cond)"),
            (dit.out_channels == self.output_size,
             "flow.decoder.estimator.out_channels must equal flow.output_size"),
            (enc.pre_lookahead_len >= 1, "flow.encoder.pre_lookahead_len must be >= 1"),
            (float(enc.up_scale_factor) == float(enc.up_stride),
             "flow.encoder.up_scale_factor must equal up_stride"),
            (self.inference_cfg_rate > 0, "flow.decoder.inference_cfg_rate must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise CheckpointError(f"flow.yaml: {message}")


@dataclass(frozen=True)
class HiftConfig:
    """``HiFTGenerator`` class defaults (no file in the folder)."""

    in_channels: int = 80
    base_channels: int = 512
    cond_channels: int = 512  # ConvRNNF0Predictor width
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[int, ...] = (1, 3, 5)
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_layers: int = 5

    @property
    def samples_per_frame(self) -> int:
        n = self.hop_len
        for r in self.upsample_rates:
            n *= r
        return n  # 480 at 24 kHz


# ---------------------------------------------------------------------------------------------
# flow.yaml reading


class _TagIgnoringLoader(yaml.SafeLoader):
    """SafeLoader that accepts any ``!tag`` and keeps the mapping/scalar underneath."""


def _construct_tagged(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        data = loader.construct_mapping(node, deep=True)
        data = dict(data)
        data["__class__"] = tag_suffix
        return data
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_TagIgnoringLoader.add_multi_constructor("!", _construct_tagged)


def _pick(section: dict, name: str, where: str, kind: type, default: Any) -> Any:
    if name not in section:
        return default
    value = section[name]
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        return kind(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"flow.yaml: {where}.{name} = {value!r} is not a valid {kind.__name__}")


def parse_flow_yaml(text: str) -> FlowConfig:
    try:
        doc = yaml.load(text, Loader=_TagIgnoringLoader)
    except yaml.YAMLError as exc:
        raise CheckpointError(f"flow.yaml: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("flow"), dict):
        raise CheckpointError("flow.yaml: missing the top-level 'flow' mapping")
    flow = doc["flow"]
    for key in ("encoder", "decoder"):
        if not isinstance(flow.get(key), dict):
            raise CheckpointError(f"flow.yaml: missing flow.{key}")
    enc_d = flow["encoder"]
    dec_d = flow["decoder"]
    if not isinstance(dec_d.get("estimator"), dict):
        raise CheckpointError("flow.yaml: missing flow.decoder.estimator")
    est_d = dec_d["estimator"]
    if enc_d.get("input_layer", "linear") != "linear":
        raise CheckpointError("flow.yaml: flow.encoder.input_layer must be 'linear'")
    if enc_d.get("pos_enc_layer_type", "rel_pos_espnet") != "rel_pos_espnet":
        raise CheckpointError("flow.yaml: flow.encoder.pos_enc_layer_type must be 'rel_pos_espnet'")
    if enc_d.get("selfattention_layer_type", "rel_selfattn") != "rel_selfattn":
        raise CheckpointError("flow.yaml: flow.encoder.selfattention_layer_type must be 'rel_selfattn'")
    if not bool(enc_d.get("normalize_before", True)):
        raise CheckpointError("flow.yaml: flow.encoder.normalize_before must be true")
    d = EncoderConfig()
    encoder = EncoderConfig(
        input_size=_pick(enc_d, "input_size", "flow.encoder", int, d.input_size),
        output_size=_pick(enc_d, "output_size", "flow.encoder", int, d.output_size),
        attention_heads=_pick(enc_d, "attention_heads", "flow.encoder", int, d.attention_heads),
        linear_units=_pick(enc_d, "linear_units", "flow.encoder", int, d.linear_units),
        num_blocks=_pick(enc_d, "num_blocks", "flow.encoder", int, d.num_blocks),
        num_up_blocks=_pick(enc_d, "num_up_blocks", "flow.encoder", int, d.num_up_blocks),
        pre_lookahead_len=_pick(enc_d, "pre_lookahead_len", "flow.encoder", int, d.pre_lookahead_len),
        up_stride=_pick(enc_d, "up_stride", "flow.encoder", int, d.up_stride),
        up_scale_factor=_pick(enc_d, "up_scale_factor", "flow.encoder", float, d.up_scale_factor),
        key_bias=_pick(enc_d, "key_bias", "flow.encoder", bool, d.key_bias),
    )
    e = DiTConfig()
    estimator = DiTConfig(
        in_channels=_pick(est_d, "in_channels", "flow.decoder.estimator", int, e.in_channels),
        out_channels=_pick(est_d, "out_channels", "flow.decoder.estimator", int, e.out_channels),
        mlp_ratio=_pick(est_d, "mlp_ratio", "flow.decoder.estimator", float, e.mlp_ratio),
        depth=_pick(est_d, "depth", "flow.decoder.estimator", int, e.depth),
        num_heads=_pick(est_d, "num_heads", "flow.decoder.estimator", int, e.num_heads),
        head_dim=_pick(est_d, "head_dim", "flow.decoder.estimator", int, e.head_dim),
        hidden_size=_pick(est_d, "hidden_size", "flow.decoder.estimator", int, e.hidden_size),
    )
    f = FlowConfig()
    if flow.get("output_type", "mel") != "mel":
        raise CheckpointError("flow.yaml: flow.output_type must be 'mel'")
    config = FlowConfig(
        input_size=_pick(flow, "input_size", "flow", int, f.input_size),
        output_size=_pick(flow, "output_size", "flow", int, f.output_size),
        spk_embed_dim=_pick(flow, "spk_embed_dim", "flow", int, f.spk_embed_dim),
        vocab_size=_pick(flow, "vocab_size", "flow", int, f.vocab_size),
        encoder=encoder,
        estimator=estimator,
        inference_cfg_rate=_pick(dec_d, "inference_cfg_rate", "flow.decoder", float, f.inference_cfg_rate),
    )
    config.validate()
    return config


def load_flow_config(folder: str | Path) -> FlowConfig:
    path = Path(folder) / "flow.yaml"
    if not path.is_file():
        raise CheckpointError(f"token2wav folder {folder}: missing flow.yaml")
    return parse_flow_yaml(path.read_text(encoding="utf-8"))


def flow_yaml_text(config: FlowConfig) -> str:
    """The flow.yaml the reference would read for ``config`` (used by the tiny writer)."""
    enc, dit = config.encoder, config.estimator
    return f"""flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: {config.input_size}
    output_size: {config.output_size}
    spk_embed_dim: {config.spk_embed_dim}
    output_type: 'mel'
    vocab_size: {config.vocab_size}
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: {enc.input_size}
        output_size: {enc.output_size}
        input_layer: 'linear'
        pre_lookahead_len: {enc.pre_lookahead_len}
        num_blocks: {enc.num_blocks}
        num_up_blocks: {enc.num_up_blocks}
        up_stride: {enc.up_stride}
        up_scale_factor: {enc.up_scale_factor}
        attention_heads: {enc.attention_heads}
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        key_bias: {str(enc.key_bias).lower()}
        linear_units: {enc.linear_units}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: {config.inference_cfg_rate}
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: {dit.in_channels}
            out_channels: {dit.out_channels}
            mlp_ratio: {dit.mlp_ratio}
            depth: {dit.depth}
            num_heads: {dit.num_heads}
            head_dim: {dit.head_dim}
            hidden_size: {dit.hidden_size}
"""
