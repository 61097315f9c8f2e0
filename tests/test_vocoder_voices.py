"""Voice preparation from prompt WAVs and the bounded voice cache."""

from __future__ import annotations

import pytest
import torch

from lychee_rtc.vocoder.token2wav import PromptTooLong, Token2Wav, UnknownVoice, VoiceBank, write_test_prompt, write_tiny_token2wav
from lychee_rtc.vocoder.token2wav.frontend import prompt_mel, read_audio


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Token2Wav.load(write_tiny_token2wav(tmp_path_factory.mktemp("t2w") / "token2wav", seed=9))


def test_prompt_features_any_rate(model, tmp_path):
    for rate in (24000, 16000, 44100):
        voice = model.prepare_voice("v", write_test_prompt(tmp_path / f"p{rate}.wav", seconds=1.2, sample_rate=rate))
        f = voice.features
        assert f.tokens.dtype == torch.int32 and f.tokens.shape == (1, 30)  # 25 Hz
        assert int(f.tokens.min()) >= 0 and int(f.tokens.max()) < 6561
        assert f.embedding.shape == (1, 192)
        assert f.mel.shape == (1, 60, 80) and torch.isfinite(f.mel).all()


def test_prompt_mel_frames_and_resize():
    wav = torch.randn(24000) * 0.1
    assert prompt_mel(wav).shape == (1, 50, 80)  # n24 // 480 frames
    assert prompt_mel(wav, 26).shape == (1, 52, 80)  # replicated last frame
    m = prompt_mel(wav, 20)
    assert m.shape == (1, 40, 80) and torch.equal(m, prompt_mel(wav)[:, :40])


def test_prompt_length_limit(model, tmp_path):
    path = write_test_prompt(tmp_path / "long.wav", seconds=18.0, sample_rate=8000)
    with pytest.raises(PromptTooLong, match="limit is 17.6 s"):
        model.prepare_voice("long", path)


def test_read_audio_stereo(tmp_path):
    import wave

    import numpy as np

    pcm = (np.stack([np.full(800, 0.5), np.full(800, -0.25)], axis=1) * 32767).astype("<i2")
    with wave.open(str(tmp_path / "s.wav"), "wb") as w:
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(8000), w.writeframes(pcm.tobytes())
    wav, rate = read_audio(tmp_path / "s.wav")
    assert rate == 8000 and wav.shape == (2, 800)
    assert abs(float(wav[0, 10]) - 0.5) < 1e-3 and abs(float(wav[1, 10]) + 0.25) < 1e-3


def test_voice_bank_bound_and_selection(model, tmp_path):
    paths = {n: write_test_prompt(tmp_path / f"{n}.wav", seconds=0.6, seed=i) for i, n in enumerate("abc")}
    bank = VoiceBank(model, paths, default="b", max_cached=2)
    assert bank.names == ("a", "b", "c")
    vb = bank.get(None)
    assert vb.name == "b" and vb.primed is not None
    assert bank.get("b") is vb  # cached
    bank.get("a")
    bank.get("c")
    assert bank.cached() == ("a", "c")  # b evicted (LRU, bound 2)
    with pytest.raises(UnknownVoice):
        bank.get("zzz")
    with pytest.raises(FileNotFoundError):
        VoiceBank(model, {"x": tmp_path / "missing.wav"})


def test_released_tokenizer_goes_through_s3tokenizer(tmp_path, monkeypatch):
    """A graph with the released initializer names is run by s3tokenizer (mocked here: the real
    graph is 496 MB); the glue passes [1,128,T] log-mel + lengths and trims to the code length."""
    import s3tokenizer

    from lychee_rtc.vocoder.token2wav import frontend as fe

    seen = {}

    class FakeS3:
        def to(self, device):
            return self

        def eval(self):
            return self

        def quantize(self, mels, lens):
            seen["mels"], seen["lens"] = mels.shape, lens.tolist()
            n = ((int(lens[0]) + 1) // 2 + 1) // 2
            return torch.arange(n + 3, dtype=torch.int32).view(1, -1) % 6561, torch.tensor([n], dtype=torch.int32)

    folder = write_tiny_token2wav(tmp_path / "token2wav", seed=1)
    monkeypatch.setattr(fe.PromptFrontend, "_is_released_tokenizer", staticmethod(lambda path: True))
    monkeypatch.setattr(s3tokenizer, "load_model", lambda path: FakeS3())
    front = fe.PromptFrontend(folder)
    assert front.tokenizer_backend == "s3tokenizer"
    tokens = front.speech_tokens(torch.zeros(16000))
    assert seen["mels"][:2] == (1, 128) and seen["lens"] == [100]
    assert tokens.dtype == torch.int32 and tokens.shape == (1, 25)
