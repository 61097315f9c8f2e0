"""Token2Wav checkpoint folder: strict loading, key-spelling quirks, released inventory sizes."""

from __future__ import annotations

import shutil

import pytest
import torch

from lychee_rtc.vocoder.token2wav.config import (CheckpointError, FlowConfig, HiftConfig, flow_yaml_text,
                                                  load_flow_config, parse_flow_yaml)
from lychee_rtc.vocoder.token2wav.flow import Flow
from lychee_rtc.vocoder.token2wav.hift import HiFTGenerator
from lychee_rtc.vocoder.token2wav.loader import hift_wn_module_names, load_flow, load_hift
from lychee_rtc.vocoder.token2wav.model import Token2Wav
from lychee_rtc.vocoder.token2wav.tiny import TINY_FLOW, TINY_HIFT, random_hift_state, write_tiny_token2wav


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_token2wav(tmp_path_factory.mktemp("t2w") / "token2wav", seed=3)


def test_released_inventory_sizes():
    """Our module trees reproduce the released tensor counts and parameter totals exactly."""
    with torch.device("meta"):
        flow = Flow(FlowConfig())
        hift = HiFTGenerator(HiftConfig())
    sd = flow.state_dict()
    assert len(sd) == 605
    assert sum(v.numel() for v in sd.values()) == 155_802_352
    hs = hift.state_dict()
    wn = hift_wn_module_names(hift)
    modules = dict(hift.named_modules())
    # each weight-normed conv stores g and v instead of one weight
    assert len(hs) + len(wn) == 328
    assert sum(v.numel() for v in hs.values()) + sum(modules[n].weight.shape[0] for n in wn) == 20_821_295


def test_flow_yaml_roundtrip_and_released_defaults():
    assert parse_flow_yaml(flow_yaml_text(FlowConfig())) == FlowConfig()
    assert parse_flow_yaml(flow_yaml_text(TINY_FLOW)) == TINY_FLOW
    with pytest.raises(CheckpointError, match="flow.encoder"):
        parse_flow_yaml("flow: !new:x.Y\n  decoder: {estimator: {}}\n")


def test_tiny_folder_layout_and_load(tiny_folder):
    names = sorted(p.name for p in tiny_folder.iterdir())
    assert names == ["campplus.onnx", "flow.pt", "flow.yaml", "hift.pt", "speech_tokenizer_v2_25hz.onnx"]
    model = Token2Wav.load(tiny_folder)
    assert model.flow.dtype == torch.float32
    assert model.frontend.tokenizer_backend == "onnxruntime"
    assert model.hift.cfg.base_channels == TINY_HIFT.base_channels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flow_dtype_selectable(tiny_folder, dtype):
    flow = load_flow(tiny_folder, load_flow_config(tiny_folder), dtype=dtype)
    assert flow.input_embedding.weight.dtype == dtype
    assert flow.decoder.rand_noise.dtype == dtype


def test_weight_norm_spellings_and_prefix_give_same_weights(tmp_path, tiny_folder):
    ref = load_hift(tiny_folder).state_dict()
    legacy = torch.load(tiny_folder / "hift.pt", weights_only=True)
    assert any(k.endswith("weight_g") for k in legacy)
    for spelling, prefix in (("parametrizations", ""), ("legacy", "generator."), ("parametrizations", "generator.")):
        folder = tmp_path / f"{spelling}{prefix}"
        shutil.copytree(tiny_folder, folder)
        torch.save(random_hift_state(TINY_HIFT, 3 + 7, spelling, prefix), folder / "hift.pt")
        got = load_hift(folder).state_dict()
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)


def _edit(folder, file, fn):
    state = torch.load(folder / file, weights_only=True)
    fn(state)
    torch.save(state, folder / file)


@pytest.mark.parametrize("file,edit,message", [
    ("flow.pt", lambda s: s.pop("encoder.after_norm.bias"), "missing tensor 'encoder.after_norm.bias'"),
    ("flow.pt", lambda s: s.__setitem__("encoder.extra", torch.zeros(1)), "unexpected tensor 'encoder.extra'"),
    ("flow.pt", lambda s: s.__setitem__("encoder_proj.bias", torch.zeros(81)), "'encoder_proj.bias' has shape"),
    ("hift.pt", lambda s: s.pop("conv_post.weight_v"), "conv_post.weight_v"),
    ("hift.pt", lambda s: s.__setitem__("ups.0.weight_g", torch.zeros(3, 1, 1)), "'ups.0.weight_g' has shape"),
    ("hift.pt", lambda s: s.pop("m_source.l_linear.bias"), "missing tensor 'm_source.l_linear.bias'"),
    ("hift.pt", lambda s: s.__setitem__("resblocks.0.activations1.0.alpha", torch.ones(8, 1)), "alpha' has shape"),
])
def test_strict_errors_name_the_tensor(tmp_path, tiny_folder, file, edit, message):
    folder = tmp_path / "bad"
    shutil.copytree(tiny_folder, folder)
    _edit(folder, file, edit)
    with pytest.raises(CheckpointError) as err:
        Token2Wav.load(folder)
    assert message in str(err.value)


def test_missing_files_are_named(tmp_path, tiny_folder):
    for name in ("flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx"):
        folder = tmp_path / name
        shutil.copytree(tiny_folder, folder)
        (folder / name).unlink()
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            Token2Wav.load(folder)
