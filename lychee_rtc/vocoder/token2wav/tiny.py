"""Write a tiny ``token2wav/`` folder in the released layout (random weights).

Same file names and formats as the release, so the real loading code runs on it:
``flow.yaml`` (HyperPyYAML text with the reference's class tags), ``flow.pt`` and ``hift.pt`` (plain
``torch.save`` of fp32 state dicts; HiFT weight-normed in either key spelling, optionally with the
``generator.`` prefix), and two small but valid ONNX graphs with the released models' input and
output shapes: CAM++ (``[1, T, 80]`` fbank -> ``[1, 192]``) and the S3 tokenizer (``[1, 128, T]``
log-mel + ``[1]`` length -> ``[1, N]`` codes in [0, 6561), N = ((T+1)//2+1)//2, the real 4x rate).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .config import DiTConfig, EncoderConfig, FlowConfig, HiftConfig, flow_yaml_text
from .flow import Flow
from .hift import HiFTGenerator
from .loader import hift_wn_module_names

# Small enough for CPU tests (a few ms per hop), every structural feature kept.
TINY_FLOW = FlowConfig(
    input_size=16,
    encoder=EncoderConfig(input_size=16, output_size=16, attention_heads=2, linear_units=32,
                          num_blocks=2, num_up_blocks=1),
    estimator=DiTConfig(hidden_size=16, num_heads=2, head_dim=8, depth=1, mlp_ratio=2.0),
)
TINY_HIFT = replace(HiftConfig(), base_channels=16, cond_channels=8)

# What the reference implementation can stream: its fixed scratch buffers force the DiT to
# 512 wide with 8 x 64 heads (depth <= 16); everything else may be small.
PARITY_FLOW = FlowConfig(
    input_size=64,
    encoder=EncoderConfig(input_size=64, output_size=64, attention_heads=4, linear_units=128,
                          num_blocks=2, num_up_blocks=2),
    estimator=DiTConfig(hidden_size=512, num_heads=8, head_dim=64, depth=1, mlp_ratio=0.5),
)
PARITY_HIFT = replace(HiftConfig(), base_channels=64, cond_channels=32)


def random_flow_state(cfg: FlowConfig, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    flow = Flow(cfg)
    state = {}
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in flow.state_dict().items():
        t = t.clone().float()
        if t.dim() == 1 or name.endswith(("pos_bias_u", "pos_bias_v")):
            t = t + 0.05 * torch.randn(t.shape, generator=g)
        state[name] = t.contiguous()
    return state


def random_hift_state(cfg: HiftConfig, seed: int, spelling: str = "legacy",
                      prefix: str = "") -> dict[str, torch.Tensor]:
    """Random HiFT weights with weight norm split back out (``legacy`` or ``parametrizations``)."""
    torch.manual_seed(seed)
    hift = HiFTGenerator(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    wn = set(hift_wn_module_names(hift))
    names = ("weight_g", "weight_v") if spelling == "legacy" else \
        ("parametrizations.weight.original0", "parametrizations.weight.original1")
    state = {}
    for name, t in hift.state_dict().items():
        t = t.clone().float()
        module = name.rsplit(".", 1)[0]
        if name.endswith(".alpha"):
            t = 0.5 + torch.rand(t.shape, generator=g)
        elif t.dim() == 1:
            t = t + 0.02 * torch.randn(t.shape, generator=g)
        if module in wn and name.endswith(".weight"):
            norm = torch.norm_except_dim(t, 2, 0)
            state[f"{prefix}{module}.{names[0]}"] = (norm * (0.8 + 0.4 * torch.rand(norm.shape, generator=g))).contiguous()
            state[f"{prefix}{module}.{names[1]}"] = t.contiguous()
        else:
            state[f"{prefix}{name}"] = t.contiguous()
    return state


def write_campplus_onnx(path: Path, seed: int, embed_dim: int = 192) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.normal(0, 0.2, (80, embed_dim)).astype(np.float32), "proj.weight")
    b = numpy_helper.from_array(rng.normal(0, 0.1, (embed_dim,)).astype(np.float32), "proj.bias")
    nodes = [
        helper.make_node("ReduceMean", ["fbank"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "proj.weight"], ["proj"]),
        helper.make_node("Add", ["proj", "proj.bias"], ["embedding"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_campplus",
        [helper.make_tensor_value_info("fbank", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, embed_dim])],
        initializer=[w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_tokenizer_onnx(path: Path, seed: int, codebook: int = 6561, width: int = 8) -> None:
    """Two stride-2 convs (the real 100 Hz -> 25 Hz rate) then argmax over a codebook projection."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (width, 128, 3)).astype(np.float32), "conv1.weight"),
        numpy_helper.from_array(rng.normal(0, 0.3, (width, width, 3)).astype(np.float32), "conv2.weight"),
        numpy_helper.from_array(rng.normal(0, 1.0, (width, codebook)).astype(np.float32), "codebook"),
        numpy_helper.from_array(np.array([1], dtype=np.int32), "one"),
        numpy_helper.from_array(np.array([2], dtype=np.int32), "two"),
    ]
    nodes = [
        helper.make_node("Conv", ["feats", "conv1.weight"], ["c1"], strides=[2], pads=[1, 1]),
        helper.make_node("Tanh", ["c1"], ["a1"]),
        helper.make_node("Conv", ["a1", "conv2.weight"], ["c2"], strides=[2], pads=[1, 1]),
        helper.make_node("Transpose", ["c2"], ["h"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h", "codebook"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["idx64"], axis=2, keepdims=0),
        helper.make_node("Cast", ["idx64"], ["indices"], to=TensorProto.INT32),
        helper.make_node("Add", ["feats_length", "one"], ["l1"]),
        helper.make_node("Div", ["l1", "two"], ["l2"]),
        helper.make_node("Add", ["l2", "one"], ["l3"]),
        helper.make_node("Div", ["l3", "two"], ["indices_lens"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_speech_tokenizer_v2",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "N"]),
         helper.make_tensor_value_info("indices_lens", TensorProto.INT32, [1])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_tiny_token2wav(folder: str | Path, seed: int = 0, flow_config: FlowConfig = TINY_FLOW,
                         hift_config: HiftConfig = TINY_HIFT, hift_spelling: str = "legacy",
                         hift_prefix: str = "") -> Path:
    """Write ``flow.yaml``, ``flow.pt``, ``hift.pt``, ``campplus.onnx``,
    ``speech_tokenizer_v2_25hz.onnx`` into ``folder`` (created if needed); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "flow.yaml").write_text(flow_yaml_text(flow_config), encoding="utf-8")
    torch.save(random_flow_state(flow_config, seed), folder / "flow.pt")
    torch.save(random_hift_state(hift_config, seed + 7, hift_spelling, hift_prefix), folder / "hift.pt")
    write_campplus_onnx(folder / "campplus.onnx", seed + 11)
    write_tokenizer_onnx(folder / "speech_tokenizer_v2_25hz.onnx", seed + 13)
    return folder


def write_test_prompt(path: str | Path, seconds: float = 1.0, sample_rate: int = 24000, seed: int = 0) -> Path:
    """A voiced-ish synthetic prompt WAV (16-bit PCM) for tiny voices and tests."""
    from lychee_rtc.pcm import write_wav

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 1.5 * t)
    x = 0.3 * np.sin(2 * np.pi * np.cumsum(f0) / sample_rate) + 0.02 * rng.standard_normal(t.shape)
    return write_wav(path, x, sample_rate)


def write_tiny_vocoder(out: str | Path, seed: int = 0) -> dict:
    """What ``lychee-rtc tiny-checkpoint`` adds: ``<out>/token2wav/`` (released layout) and a
    prompt ``<out>/voices/default.wav``. Returns the ``token2wav`` settings mapping for them."""
    out = Path(out)
    folder = write_tiny_token2wav(out / "token2wav", seed=seed)
    (out / "voices").mkdir(parents=True, exist_ok=True)
    prompt = write_test_prompt(out / "voices" / "default.wav", seconds=1.0, seed=seed)
    return {"folder": str(folder), "voices": {"default": str(prompt)}, "default_voice": "default",
            "device": "cpu", "dtype": "fp32"}
