"""Lychee-FD (tiny) -> codes -> Token2Wav (tiny) -> PCM through the backend's vocoder seam."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lychee_rtc.engine.base import AudioChunk, CodecTokens, Control, ControlKind, SessionOptions, SlotWindow
from lychee_rtc.engine.lychee.backend import build_lychee_backend
from lychee_rtc.engine.lychee.tiny import write_tiny_checkpoint
from lychee_rtc.engine.lychee.token2wav_slots import Token2WavPool
from lychee_rtc.vocoder.token2wav import write_test_prompt, write_tiny_token2wav


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    lychee = write_tiny_checkpoint(root / "lychee", seed=5)
    t2w = write_tiny_token2wav(root / "token2wav", seed=1)
    prompts = {"alpha": write_test_prompt(root / "alpha.wav", seconds=0.8, seed=1),
               "beta": write_test_prompt(root / "beta.wav", seconds=1.2, sample_rate=16000, seed=2)}
    return lychee, t2w, prompts


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_lychee_codes_become_token2wav_pcm(folders):
    lychee, t2w, prompts = folders
    pool = Token2WavPool.load(t2w, prompts, default_voice="alpha")
    pushed: dict[int, list[int]] = {}
    vocs = {}

    def factory(slot, opts):
        vocs[slot] = pool(slot, opts)
        original = vocs[slot].push

        def push(response_id, codes, final):
            pushed.setdefault(slot, []).extend(codes)
            return original(response_id, codes, final)

        vocs[slot].push = push
        return vocs[slot]

    opts = {"model_root": str(lychee), "dtype": "fp32", "device": "cpu", "max_seq": 512, "torch_threads": 1,
            "progress": False, "strict_codec_range": True}
    be = build_lychee_backend(opts, 2, vocoder_factory=factory)
    be.open_slot(0, SessionOptions(seed=3))
    be.open_slot(1, SessionOptions(seed=4, voice="beta"))
    assert vocs[1].voice_name == "beta"
    rng = np.random.default_rng(0)
    events = {0: [], 1: []}
    for k in range(6):
        controls = (Control(ControlKind.COMMIT, 0),) if k == 0 else ()
        windows = [SlotWindow(s, (0.1 * rng.standard_normal(6400)).astype(np.float32), k, 0, controls) for s in (0, 1)]
        for s, out in zip((0, 1), be.step(windows)):
            events[s] += out
    for s in (0, 1):
        assert not any(isinstance(e, CodecTokens) for e in events[s])
        audio = [e for e in events[s] if isinstance(e, AudioChunk)]
        n = len(pushed.get(s, []))
        if n > 13:
            assert audio, "more than 13 codes must produce the first hop"
            assert audio[0].pcm.dtype == np.float32 and audio[0].pcm.size == 5760
        total = sum(a.pcm.size for a in audio)
        assert total <= 960 * n
    assert any(len(v) > 13 for v in pushed.values()), "the tiny model should speak after COMMIT"
    be.apply_controls(0, [Control(ControlKind.CANCEL, 1)])
    assert vocs[0]._stream is None
    be.close_slot(0)
    be.close_slot(1)


def test_pool_push_many_matches_push(folders):
    _, t2w, prompts = folders
    pool = Token2WavPool.load(t2w, prompts)
    codes = torch.randint(0, 6561, (2, 40), generator=torch.Generator().manual_seed(0)).tolist()
    single = []
    for slot, voice in ((0, "alpha"), (1, "beta")):
        v = pool(slot, SessionOptions(voice=voice, seed=9))
        out = v.push("r", codes[slot][:20], False) + v.push("r", codes[slot][20:], True)
        single.append(np.concatenate(out))
    va, vb = pool(0, SessionOptions(voice="alpha", seed=9)), pool(1, SessionOptions(voice="beta", seed=9))
    first = pool.push_many([(va, "r", codes[0][:20], False), (vb, "r", codes[1][:20], False)])
    second = pool.push_many([(va, "r", codes[0][20:], True), (vb, "r", codes[1][20:], True)])
    for k in range(2):
        got = np.concatenate(first[k] + second[k])
        assert got.size == 960 * 40
        np.testing.assert_allclose(got, single[k], atol=2e-5)


def test_cancel_then_new_response_and_voice_update(folders):
    _, t2w, prompts = folders
    pool = Token2WavPool.load(t2w, prompts)
    v = pool(0, SessionOptions(seed=1))
    assert v.voice_name == "alpha"
    assert [a.size for a in v.push("r1", list(range(14)), False)] == [5760]
    v.cancel()
    assert v.push("r1", list(range(14)), False) == []  # late codes of the cancelled response
    v.update(SessionOptions(voice="beta"))
    assert [a.size for a in v.push("r2", list(range(20)), True)] == [5760, 3840 + 960 * 10]
    assert v._stream.voice.name == "beta"
