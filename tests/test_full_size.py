"""The full-size rehearsal's parts, checked at a size a test can afford.

* ``random_checkpoint``: the streamed safetensors writer reads back through ``safetensors`` and the
  real loader, is deterministic from the seed whatever the sharding, applies the decision bias per
  block exactly as on whole tensors, and plans the released layout (982 tensors, 6 shards) without
  writing it;
* ``inventory``: a folder is checked from headers, and every kind of damage is named;
* ``memory_plan``: its KV-cache and vocoder-cache sizes are what the runner and the vocoder really
  allocate (measured on tiny models), and the released figures follow from the released config;
* ``streamed_step``: one layer at a time gives the runner's own decision and logits;
* ``lychee-rtc check`` and ``lychee-rtc random-checkpoint`` end to end on the command line.

The full-size figures themselves (25.6 GB written, a step in a few GB of memory) are measured by
the commands and recorded in docs/lychee_fd.md, not in tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lychee_rtc.engine.lychee import random_checkpoint as rc
from lychee_rtc.engine.lychee.checkpoint import load_model
from lychee_rtc.engine.lychee.config import load_config, parse_config
from lychee_rtc.engine.lychee.inventory import RELEASED_TENSORS, InventoryError, verify_model_folder
from lychee_rtc.engine.lychee.memory_plan import (
    GIB,
    activation_bytes,
    context_bytes,
    kv_bytes_per_row,
    lm_weight_bytes,
    plan,
)
from lychee_rtc.engine.lychee.tiny import TinySpec, bias_decisions, tiny_config
from lychee_rtc.vocoder.token2wav.config import CheckpointError
from lychee_rtc.vocoder.token2wav.inventory import verify_token2wav_folder

ROOT = Path(__file__).resolve().parents[1]


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("random")
    rc.write_random_checkpoint(out, size="tiny", seed=7, dtype=torch.float32, progress=False)
    return out


# -- the writer ------------------------------------------------------------------------------------


def test_the_written_checkpoint_loads_and_is_deterministic_whatever_the_sharding(tiny, tmp_path, monkeypatch):
    model = tiny / "lychee_full_duplex"
    load_model(model, dtype="fp32", progress=False)  # the real loader, strict inventory
    report = verify_model_folder(model, released=False)
    assert report.dtype == "F32" and report.tensors == len(rc.checkpoint_entries(json.loads(
        (model / "config.json").read_text())))
    # Blocks of a few rows and another shard count: the same values.
    monkeypatch.setattr(rc, "BLOCK_ELEMENTS", 1000)
    rc.write_random_checkpoint(tmp_path / "again", size="tiny", seed=7, dtype=torch.float32, shards=2,
                               vocoder=False, progress=False)
    first, second = read_all(model), read_all(tmp_path / "again" / "lychee_full_duplex")
    assert len(list((tmp_path / "again" / "lychee_full_duplex").glob("model-*.safetensors"))) == 2
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    rc.write_random_checkpoint(tmp_path / "other", size="tiny", seed=8, dtype=torch.float32, vocoder=False,
                               progress=False)
    other = read_all(tmp_path / "other" / "lychee_full_duplex")
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])


def test_streamed_safetensors_read_back_as_written(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 5, generator=g).to(torch.bfloat16), "b.bias": torch.randn(3, generator=g),
               "c": torch.randn(4, 3, 2, generator=g).to(torch.float16)}
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        entries = [rc.TensorEntry(k, tuple(v.shape)) for k, v in tensors.items()]
        path = tmp_path / f"{dtype}.safetensors"
        # Tensors arrive in blocks of rows, as the writer makes them.
        size = rc.write_safetensors(path, entries, dtype, lambda e: iter(tensors[e.name].to(dtype).split(2)))
        assert path.stat().st_size == size
        with safe_open(str(path), framework="pt") as f:
            for k, v in tensors.items():
                assert torch.equal(f.get_tensor(k), v.to(dtype)), (dtype, k)
        # safetensors' own writer holds the same tensors, byte for byte in the data.
        save_file({k: v.to(dtype) for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"))
        with safe_open(str(tmp_path / "ref.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == sorted(tensors)


def test_decision_bias_per_block_equals_the_whole_tensor_edit(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "BLOCK_ELEMENTS", 64 * 40)  # lm_head and the embedding come in several blocks
    spec_plain, spec_biased = TinySpec(shards=1), TinySpec(shards=1, decision_bias=4.0)
    rc.write_model(tmp_path / "plain", spec=spec_plain, seed=3, dtype=torch.float32, device=torch.device("cpu"),
                   progress=False)
    rc.write_model(tmp_path / "biased", spec=spec_biased, seed=3, dtype=torch.float32, device=torch.device("cpu"),
                   progress=False)
    plain, biased = read_all(tmp_path / "plain"), read_all(tmp_path / "biased")
    raw = json.loads((tmp_path / "biased" / "config.json").read_text())
    bias_decisions(plain, raw, 4.0)
    for name in plain:
        assert torch.equal(plain[name], biased[name]), name


def test_the_released_layout_is_planned_without_writing_it():
    raw = tiny_config(rc.RELEASED_SPEC)
    entries = rc.checkpoint_entries(raw)
    assert len(entries) == RELEASED_TENSORS == 982
    shapes = {e.name: e.shape for e in entries}
    assert shapes["model.embed_tokens.weight"] == shapes["merge_model.embed_tokens.weight"] == (158363, 3584)
    assert shapes["model.layers.27.self_attn.k_proj.weight"] == (512, 3584)
    assert shapes["control_model.layers.3.mlp.down_proj.weight"] == (3584, 18944)
    assert shapes["encoder.blocks.31.mlp.0.weight"] == (5120, 1280)
    assert shapes["adapter.linear2.weight"] == (3584, 2048)
    shards = rc.split_shards(entries, 6, 2)
    assert len(shards) == 6 and sum(len(s) for s in shards) == 982
    sizes = [sum(e.numel for e in s) * 2 for s in shards]
    assert sum(sizes) == 12_812_043_520 * 2 and max(sizes) < 5 * 10**9  # 12.8 B parameters in bf16
    # Every block of the largest tensor stays within the bound the writer's memory rests on.
    largest = max(entries, key=lambda e: e.numel)
    per_row = largest.numel // largest.shape[0]
    assert all(rows * per_row <= rc.BLOCK_ELEMENTS for _, rows in rc.row_blocks(largest.shape))
    assert sum(rows for _, rows in rc.row_blocks(largest.shape)) == largest.shape[0]


# -- inventory -------------------------------------------------------------------------------------


def test_inventory_names_what_is_wrong(tiny, tmp_path):
    src = tiny / "lychee_full_duplex"
    with pytest.raises(InventoryError, match="is not the released layout .* 982 tensors"):
        verify_model_folder(src)

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    gone = copy("gone")
    (gone / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(InventoryError, match="shard model-00002-of-00003.safetensors named in .* does not exist"):
        verify_model_folder(gone, released=False)
    mixed = copy("mixed")
    shard = mixed / "model-00003-of-00003.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    odd = sorted(state)[0]
    state[odd] = state[odd].to(torch.float16)
    save_file(state, str(shard))
    # A mix of float dtypes loads (each tensor is converted) and is reported as what it is...
    assert verify_model_folder(mixed, released=False).dtype == "171 F32 + 1 F16"
    # ...a tensor that is no float is named.
    state[odd] = state[odd].to(torch.int32)
    save_file(state, str(shard))
    with pytest.raises(InventoryError, match=f"cannot read as weights: {odd} \\(I32\\)"):
        verify_model_folder(mixed, released=False)
    reshaped = copy("reshaped")
    shard = reshaped / "model-00001-of-00003.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    name = sorted(k for k in state if state[k].dim() == 2)[0]
    state[name] = state[name][:-1].contiguous()
    save_file(state, str(shard))
    with pytest.raises(InventoryError, match=f"wrong shape: {name}"):
        verify_model_folder(reshaped, released=False)
    no_tok = copy("no_tok")
    (no_tok / "merges.txt").unlink()
    with pytest.raises(InventoryError, match="no tokenizer: neither tokenizer.json nor merges.txt"):
        verify_model_folder(no_tok, released=False)


def test_vocoder_inventory_names_what_is_wrong(tiny, tmp_path):
    src = tiny / "token2wav"
    report = verify_token2wav_folder(src, released=False)
    assert report.hift_tensors == 328 and report.layout == "other"
    with pytest.raises(CheckpointError, match="flow.pt: .* tensors with .* parameters; the release has 605"):
        verify_token2wav_folder(src)
    broken = tmp_path / "t2w"
    shutil.copytree(src, broken)
    state = torch.load(broken / "flow.pt", weights_only=True)
    del state["encoder.after_norm.bias"]
    torch.save(state, broken / "flow.pt")
    with pytest.raises(CheckpointError, match="flow.pt: missing tensors encoder.after_norm.bias"):
        verify_token2wav_folder(broken, released=False)
    (broken / "campplus.onnx").unlink()
    with pytest.raises(CheckpointError, match="missing or empty campplus.onnx"):
        verify_token2wav_folder(broken, released=False)


# -- memory plan -----------------------------------------------------------------------------------


def test_plan_sizes_are_what_the_code_allocates(tiny):
    """KV rows as the runner allocates them; estimator caches as a primed voice holds them."""
    from lychee_rtc.engine.lychee.check import vocoder_geometry
    from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings
    from lychee_rtc.engine.lychee.tokenizer import Tokenizer
    from lychee_rtc.vocoder.token2wav.model import Token2Wav
    from lychee_rtc.vocoder.token2wav.voices import BUILTIN_VOICE

    root = tiny / "lychee_full_duplex"
    model = load_model(root, dtype="fp32", progress=False)
    for sliding in (False, True):  # with context slides: a staging row per slot and its stored features
        runner = LycheeRunner(model, Tokenizer.from_dir(root), 3,
                              RunnerSettings(max_seq=512, cuda_graphs="off", context_window=None if sliding else 0))
        caches = [layer.self_attn.kv_cache for stack in (model.model, model.stoken_model, model.control_model,
                                                         model.merge_model) for layer in stack.layers]
        allocated = sum(c.k_cache.numel() * 4 + c.v_cache.numel() * 4 for c in caches)
        allocated += runner.rule_rows.history.numel() * 8
        allocated += runner.store.feats.numel() * 4 if sliding else 0
        assert allocated == context_bytes(model.cfg, 3, 512, 4, sliding)
        if not sliding:
            assert allocated == 4 * kv_bytes_per_row(model.cfg, 512, 4)  # 3 slots + scratch row
    assert lm_weight_bytes(model.cfg, 4) == sum(p.numel() * 4 for p in model.parameters())

    geometry = vocoder_geometry(tiny / "token2wav", {"voices": {"default": "builtin"}, "dtype": "fp32", "hop": 10})
    vocoder = Token2Wav.load(tiny / "token2wav")
    voice = vocoder.prepare_voice("v", BUILTIN_VOICE)
    state = vocoder.prime(voice)
    att = state.estimator.att
    assert att.numel() * att.element_size() == state.prompt_frames * geometry.frame_bytes
    kv = state.encoder.kv
    up = state.encoder.up_kv
    assert (kv.numel() + up.numel()) * kv.element_size() == state.prompt_frames // 2 * geometry.token_bytes
    assert abs(geometry.prompt_tokens[0] - state.prompt_frames // 2) <= 2


def test_released_plan_figures():
    cfg = parse_config(tiny_config(rc.RELEASED_SPEC))
    assert lm_weight_bytes(cfg, 2) == 11_109_324_544 * 2  # the 982 tensors less the three side tables
    assert kv_bytes_per_row(cfg, 8192, 2) == 40 * 2 * 4 * 8192 * 128 * 2 + 8192 * 8
    rows = [plan(cfg, sessions=c, max_seq=8192, lm_value_bytes=2, vocoder=None, gpu_gib=140.4) for c in (1, 2, 4, 8)]
    assert [r.kv_cache_gib * GIB for r in rows] == [context_bytes(cfg, c, 8192, 2, True) for c in (1, 2, 4, 8)]
    fixed = [plan(cfg, sessions=c, max_seq=8192, lm_value_bytes=2, vocoder=None, sliding=False) for c in (1, 2, 4, 8)]
    assert [r.kv_cache_gib * GIB for r in fixed] == [(c + 1) * kv_bytes_per_row(cfg, 8192, 2) for c in (1, 2, 4, 8)]
    assert all(a.total_gib < b.total_gib for a, b in zip(rows, rows[1:]))
    assert all(r.fits for r in rows)
    n = rows[0].max_sessions_that_fit
    assert plan(cfg, sessions=n, max_seq=8192, lm_value_bytes=2, vocoder=None, gpu_gib=140.4).fits
    assert not plan(cfg, sessions=n + 1, max_seq=8192, lm_value_bytes=2, vocoder=None, gpu_gib=140.4).fits
    assert activation_bytes(cfg, 8, 8192, 2) > activation_bytes(cfg, 1, 8192, 2)


# -- the streamed step -----------------------------------------------------------------------------


def test_a_layer_at_a_time_gives_the_runners_decision_and_logits(tiny):
    from lychee_rtc.engine.lychee.audio import encode_windows, mel_filterbank
    from lychee_rtc.engine.lychee.decode import DecodeRules, listen_window, prefill
    from lychee_rtc.engine.lychee.model import StepContext
    from lychee_rtc.engine.lychee.streamed_step import DEFAULT_SYSTEM, run_streamed, step_inputs
    from lychee_rtc.engine.lychee.tokenizer import Tokenizer

    root = tiny / "lychee_full_duplex"
    window = (0.1 * np.random.default_rng(1).standard_normal(6400)).astype(np.float32)
    out, report = run_streamed(root, window=window)
    assert report.positions == 9 and report.modules_loaded == 1 + 2 + 2 + 4 + 3 * 2 + 4  # stem, blocks, norm, adapter, layers, norms
    model = load_model(root, dtype="fp32", progress=False)
    tokenizer = Tokenizer.from_dir(root)
    tok = model.cfg.resolve_tokens(tokenizer)
    ids = tokenizer.encode(DEFAULT_SYSTEM)
    assert report.prefix_tokens == len(ids)
    text, stoken, control = step_inputs(tok)
    with torch.no_grad():
        # The runner's decode functions: prefill, then the listening window.
        model.setup_caches(2, 128)
        prefill(model, ids, 0, tok.text_pad)
        rules = DecodeRules.build(model.cfg, tok, torch.device("cpu"), stoken_delay_num=None,
                                  strict_codec_range=False, start_speak_factor=1.2, start_listen_factor=1.2,
                                  end_speak_factor=1.0, max_text_tokens=128, max_speech_tokens=1000,
                                  no_repeat_ngram=4)
        feats = encode_windows(model.encoder, model.adapter, mel_filterbank(), torch.from_numpy(window)[None])[0]
        audio = torch.stack([feats[p // 2] if p % 2 == 0 else model.embed_tokens.weight[tok.audio_pad]
                             for p in range(9)])[None]
        pos = torch.arange(len(ids), len(ids) + 9)[None]
        _, probs = listen_window(model, rules, torch.tensor([text]), torch.tensor([stoken]), torch.tensor([control]),
                                 audio, pos, torch.tensor([0]))
        # The heads at the last position, from the full model in memory.
        x = torch.cat([model.embed_tokens(torch.tensor([ids])),
                       model.embed_channels(torch.tensor([text]), torch.tensor([stoken]), torch.tensor([control]),
                                            audio)], dim=1)
        nxt = model.embed_tokens(torch.tensor([ids[1:] + [tok.text_pad] * 10]))
        model.setup_caches(1, x.shape[1])
        full = model.forward_positions(x, nxt, StepContext.build(torch.arange(x.shape[1])[None], None, x.shape[1]))
        text_logits = model.head(full.text_hidden[0, -1])
        speech_logits = model.head(full.speech_hidden[0, -1], slice(model.cfg.stoken_token_ids_min,
                                                                    model.cfg.stoken_token_ids_max))
    assert torch.allclose(out.probs, probs[0], atol=1e-5)
    assert torch.allclose(out.text_logits, text_logits, atol=1e-4)
    assert torch.allclose(out.speech_logits, speech_logits, atol=1e-4)
    assert report.text_token == int(text_logits.argmax())


# -- the commands ----------------------------------------------------------------------------------


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lychee_rtc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(400)
def test_random_checkpoint_and_check_on_the_command_line(tmp_path):
    written = cli("random-checkpoint", str(tmp_path / "ck"), "--size", "tiny", "--seed", "2", "--decision-bias", "4",
                  "--json", str(tmp_path / "write.json"))
    assert written.returncode == 0, written.stderr
    report = json.loads((tmp_path / "write.json").read_text())
    assert report["tensors"] == 172 and report["shards"] == 3 and report["vocoder_bytes"] > 0
    checked = cli("check", "--dir", str(tmp_path / "ck"), "--layout", "any", "--config", "lychee-c4", "--step",
                  "--threads", "1", "--json", str(tmp_path / "check.json"))
    assert checked.returncode == 0, checked.stderr
    out = json.loads((tmp_path / "check.json").read_text())
    assert [r["sessions"] for r in out["plan"]["rows"]] == [1, 2, 4, 8]
    assert out["plan"]["dtype"] == "bf16" and out["plan"]["max_seq"] == 8192
    assert out["model"]["tensors"] == 172 and out["token2wav"]["hift_tensors"] == 328
    assert out["step"]["decision"] in ("S-S", "K-L") and out["step"]["peak_rss_mib"] > 0
    assert "| C4 |" in checked.stdout and "one window step on the CPU" in checked.stdout
    # The profile's context sizes are null: they follow its max_seq (8192) for this tokenizer's prompt.
    assert out["context"] == {"mode": "sliding", "sink": 37, "window": 6500, "step": 1630, "budget": 205}
    assert "rolling context (sliding): sink 37 positions" in checked.stdout
    # The released layout is asked for by default; a tiny folder is named as what it is.
    strict = cli("check", "--dir", str(tmp_path / "ck"))
    assert strict.returncode == 1 and "is not the released layout" in strict.stderr
    missing = cli("check", "--dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "nowhere/lychee_full_duplex: no such folder" in missing.stderr
    # decision bias: the written model keeps listening at its first window, as the benchmarks need.
    assert out["step"]["decision"] == "K-L"
