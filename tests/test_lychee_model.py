"""Lychee-FD config, loader, model and teacher-forced scoring on a tiny random checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lychee_rtc.engine.lychee.audio import encode_windows, log_mel, mel_filterbank
from lychee_rtc.engine.lychee.checkpoint import CheckpointError, expected_inventory, load_model
from lychee_rtc.engine.lychee.config import ConfigError, load_config, parse_config
from lychee_rtc.engine.lychee.model import LycheeFD, checkpoint_targets
from lychee_rtc.engine.lychee.scoring import score_teacher_forced
from lychee_rtc.engine.lychee.tiny import TinySpec, tiny_config, write_tiny_checkpoint
from lychee_rtc.engine.lychee.tokenizer import SYSTEM_PREFIX, IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lychee") / "tiny", seed=0)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype="fp32", progress=False)


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(ckpt, dst)
    return dst


# -- config -------------------------------------------------------------------------------------


def test_config_parses_released_style_fields(ckpt):
    cfg = load_config(ckpt)
    assert cfg.model_type == "step_audio_2_full_duplex"
    assert cfg.control_branch_index == cfg.text.num_hidden_layers - cfg.control_branch_layer
    # text_config is compact (rms_norm_eps dropped): the value comes from the layer configs
    assert cfg.text.rms_norm_eps == 1e-6
    tokens = cfg.resolve_tokens(Tokenizer.from_dir(ckpt))
    assert tokens.text_eos == Tokenizer.from_dir(ckpt).token_to_id("<|EOT|>")


@pytest.mark.parametrize("model_type,arch", [("lychee_full_duplex", "LycheeFD"),
                                             ("step_audio_2_full_duplex", "LycheeFullDuplexForConditionalGeneration"),
                                             ("step_audio_2_full_duplex", "LycheeFullDuplex")])
def test_config_accepts_aliases(model_type, arch):
    canonical = parse_config(tiny_config(TinySpec()))
    raw = tiny_config(TinySpec())
    raw["model_type"], raw["architectures"] = model_type, [arch]
    cfg = parse_config(raw)
    assert cfg.model_type == model_type and cfg.architectures == (arch,)
    # an alias names the same model: every other field is the canonical config's
    assert dataclasses.replace(cfg, model_type=canonical.model_type, architectures=canonical.architectures) == canonical
    raw["architectures"] = [arch + "V2"]
    with pytest.raises(ConfigError, match="architectures"):
        parse_config(raw)


@pytest.mark.parametrize("mutate,field", [
    (lambda r: r.pop("detect_token_id"), "detect_token_id"),
    (lambda r: r.pop("merge_layer_config"), "merge_layer_config"),
    (lambda r: r["stoken_layer_config"].update(hidden_size=48), "stoken_layer_config.hidden_size"),
    (lambda r: r.update(control_branch_layer=99), "control_branch_layer"),
    (lambda r: r.update(model_type="qwen2"), "model_type"),
    (lambda r: r.update(architectures=["Qwen2ForCausalLM"]), "architectures"),
    (lambda r: r["audio_encoder_config"].update(llm_dim=7), "llm_dim"),
    (lambda r: r.update(control_token_chunk_size=8), "control_token_chunk_size"),
    (lambda r: r.update(stoken_delay_num=-1), "stoken_delay_num"),
    (lambda r: r.update(sleep_token_id=10**7), "sleep_token_id"),
    (lambda r: r["text_config"].pop("num_hidden_layers"), "text_config.num_hidden_layers"),
])
def test_config_errors_name_the_field(mutate, field):
    raw = tiny_config(TinySpec())
    mutate(raw)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(raw)


class _Lookup:
    def token_to_id(self, token: str) -> int:
        return 258


def test_token_order_is_checked():
    raw = tiny_config(TinySpec())
    raw["tts_end_token_id"], raw["tts_pad_token_id"] = raw["tts_pad_token_id"], raw["tts_end_token_id"]
    with pytest.raises(ConfigError, match="tts_end_token_id"):
        parse_config(raw).resolve_tokens(_Lookup())


def test_released_layout_has_982_tensors():
    spec = TinySpec(main_layers=28, branch_layers=4, control_branch_layer=8, audio_layers=32)
    cfg = parse_config(tiny_config(spec))
    with torch.device("meta"):
        m = LycheeFD(cfg)
    assert len(expected_inventory(m)) == 982
    assert cfg.control_branch_index == 20


# -- loader -------------------------------------------------------------------------------------


def test_targets_cover_every_parameter_once(model):
    targets = checkpoint_targets(model)
    assert sum(t.numel() for t in targets.values()) == sum(p.numel() for p in model.parameters())


def test_loader_reads_shards_and_skips_side_tables(ckpt, model):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    # the weights we hold are the checkpoint's (fused q/k/v included), side tables are not held
    state = {}
    for shard in set(index["weight_map"].values()):
        state.update(load_file(str(ckpt / shard)))
    for name, t in checkpoint_targets(model).items():
        assert torch.equal(t, state[name]), name
    held = sum(p.numel() for p in model.parameters())
    on_disk = sum(t.numel() for t in state.values())
    side = 3 * model.cfg.text.vocab_size * model.cfg.text.hidden_size
    assert held == on_disk - side


def _edit_shard(root: Path, edit) -> None:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    state = load_file(str(root / shard))
    edit(state, index, shard)
    save_file(state, str(root / shard))
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor_is_named(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)

    def drop(state, index, shard):
        name = next(k for k in state if "self_attn.k_proj.bias" in k)
        drop.name = name
        del state[name]
        del index["weight_map"][name]

    _edit_shard(root, drop)
    with pytest.raises(CheckpointError, match=r"missing tensors: .*" + drop.name.replace(".", r"\.")):
        load_model(root, dtype="fp32", progress=False)


def test_unexpected_and_misshaped_tensors_are_named(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    _edit_shard(root, lambda s, i, sh: (s.__setitem__("model.extra.weight", torch.zeros(2)),
                                        i["weight_map"].__setitem__("model.extra.weight", sh)))
    with pytest.raises(CheckpointError, match="unexpected tensors: model.extra.weight"):
        load_model(root, dtype="fp32", progress=False)

    root2 = _copy(ckpt, tmp_path / "b")

    def reshape(state, index, shard):
        name = next(k for k in state if k.endswith("norm.weight"))
        reshape.name = name
        state[name] = torch.ones(3)

    _edit_shard(root2, reshape)
    with pytest.raises(CheckpointError, match="wrong shape: " + reshape.name.replace(".", r"\.")):
        load_model(root2, dtype="fp32", progress=False)


@pytest.mark.parametrize("dtype,expected", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_is_selectable(ckpt, dtype, expected):
    m = load_model(ckpt, dtype=dtype, progress=False)
    assert {p.dtype for p in m.parameters()} == {expected}


# -- audio front-end ----------------------------------------------------------------------------


def test_front_end_shapes_and_per_window_normalisation(model):
    rng = np.random.default_rng(0)
    loud = torch.from_numpy(rng.standard_normal((1, 6400)).astype(np.float32))
    quiet = loud * 1e-3
    filters = mel_filterbank()
    mel = log_mel(torch.cat([loud, quiet]), filters)
    assert mel.shape == (2, 128, 42)
    # each window is normalised on its own: batching never lets the loud window's max floor the
    # quiet one (the reference encodes one window per call)
    alone = log_mel(quiet, filters)
    assert torch.equal(mel[1], alone[0])
    assert mel[1].min() < mel[0].min()
    feats = encode_windows(model.encoder, model.adapter, filters, torch.cat([loud, quiet]))
    assert feats.shape == (2, 5, model.cfg.text.hidden_size)


def test_mel_filters_are_slaney():
    fb = mel_filterbank()
    assert fb.shape == (128, 201)
    # Slaney-normalised triangles: area normalisation makes high filters lower and wider
    assert fb[10].max() > fb[120].max()


# -- scoring ------------------------------------------------------------------------------------


def test_teacher_forced_scoring_is_causal(model, ckpt):
    tok = Tokenizer.from_dir(ckpt)
    st = model.cfg.resolve_tokens(tok)
    prefix = tok.encode(SYSTEM_PREFIX)
    rng = np.random.default_rng(1)
    audio = (0.1 * rng.standard_normal(12800)).astype(np.float32)
    text = [st.text_pad] * 20
    stoken = [st.stoken_pad] * 20
    control = [st.detect if i % 10 == 8 else st.sleep for i in range(20)]
    a = score_teacher_forced(model, st, prefix, text, stoken, control, audio)
    assert a.text_logits.shape == (len(prefix) + 20, model.cfg.text.vocab_size)
    control2 = list(control)
    control2[15] = st.start_speaking
    b = score_teacher_forced(model, st, prefix, text, stoken, control2, audio)
    cut = len(prefix) + 15
    assert torch.equal(a.control_logits[:cut], b.control_logits[:cut])
    assert not torch.equal(a.control_logits[cut:], b.control_logits[cut:])
    # the merge branch sees the *next* text token: changing text at 15 changes speech logits at 14
    text2 = list(text)
    text2[15] = 65
    c = score_teacher_forced(model, st, prefix, text2, stoken, control, audio)
    assert torch.equal(a.text_logits[:cut], c.text_logits[:cut])
    assert torch.equal(a.speech_logits[:cut - 1], c.speech_logits[:cut - 1])
    assert not torch.equal(a.speech_logits[cut - 1], c.speech_logits[cut - 1])


# -- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_prefix_and_incremental_utf8(ckpt):
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode(SYSTEM_PREFIX)
    assert ids[0] == tok.token_to_id("<|BOT|>") and ids[-1] == tok.token_to_id("<|EOT|>")
    assert tok.decode(ids) == SYSTEM_PREFIX
    byte_ids = tok.encode("héllo ✓")
    inc = IncrementalDetokenizer(tok)
    text = "".join(inc.push([i]) for i in byte_ids) + inc.flush()
    assert text == "héllo ✓"


def test_truncated_shard_and_broken_index_are_named(ckpt, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=shard.name + ": not a readable safetensors file"):
        load_model(broken, dtype="fp32", progress=False)
    (broken / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a readable JSON index"):
        load_model(broken, dtype="fp32", progress=False)


# -- attention over open keys (a slide's re-prefill) ----------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_open_prefix_attention_equals_one_masked_attention(dtype, tol):
    """Rows whose queries start at different positions (a batched re-prefill, the shorter rows
    padded past their end), grouped-query heads: unmasked open keys merged with the masked tail
    give what one attention over the whole boolean mask gives."""
    from lychee_rtc.engine.lychee.model import OpenPrefixMask, StepContext, attend_open_prefix

    g = torch.Generator().manual_seed(0)
    starts, t, key_len = [2700, 2655, 2690], 41, 2741
    pos = torch.stack([torch.arange(s, s + t) for s in starts])
    ctx = StepContext.build(pos, None, key_len, open_keys=int(pos.min()))
    mask = ctx.attention_mask(dtype)
    assert isinstance(mask, OpenPrefixMask) and mask.open == 2655 and mask.tail.shape == (3, 1, t, key_len - 2655)
    q = torch.randn(3, 4, t, 16, generator=g).to(dtype)
    k, v = (torch.randn(3, 2, key_len, 16, generator=g).to(dtype) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=ctx.mask,
                                                            enable_gqa=True)
    got = attend_open_prefix(q, k, v, mask)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # A key the mask hides changes nothing; one it shows changes the row's output.
    k2 = k.clone()
    k2[1, :, 2655 + 5] += 3.0  # row 1: query 5 and later see it, queries 0..4 do not
    again = attend_open_prefix(q, k2, v, mask)
    assert torch.equal(again[1, :, :5], got[1, :, :5])
    assert not torch.allclose(again[1, :, 5:].float(), got[1, :, 5:].float())


def test_open_keys_are_skipped_only_where_they_outnumber_the_tail():
    """A forward whose open keys are few (a short context) keeps the single masked attention,
    as do window programs (no open keys); the mask is additive either way, made once per dtype."""
    from lychee_rtc.engine.lychee.model import OpenPrefixMask, StepContext

    pos = torch.arange(1500, 1541)[None]
    short = StepContext.build(pos, None, 1541, open_keys=1500)
    made = short.attention_mask(torch.float32)
    assert isinstance(made, torch.Tensor) and made.dtype == torch.float32 and made.shape == (1, 1, 41, 1541)
    assert torch.equal(made == 0, short.mask) and short.attention_mask(torch.float32) is made
    window = StepContext.build(torch.arange(5000, 5010)[None], None, 8192)
    assert isinstance(window.attention_mask(torch.float32), torch.Tensor)
    long = StepContext.build(torch.arange(5000, 5041)[None], None, 5041, open_keys=5000)
    assert isinstance(long.attention_mask(torch.float32), OpenPrefixMask)
