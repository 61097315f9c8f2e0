"""The ``lychee`` StepBackend: profile validation, capabilities, events, the vocoder seam."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lychee_rtc.engine.base import (
    AudioChunk,
    CodecTokens,
    Control,
    ControlKind,
    EngineError,
    ResponseDone,
    ResponseStarted,
    SessionOptions,
    SlotWindow,
    WindowTiming,
)
from lychee_rtc.engine.lychee.backend import LycheeEngineSettings, SettingsError, build_lychee_backend
from lychee_rtc.engine.lychee.tiny import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lychee-be") / "tiny", seed=5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def options(ckpt, **over):
    base = {"model_root": str(ckpt), "dtype": "fp32", "device": "cpu", "max_seq": 512, "torch_threads": 1,
            "progress": False}
    base.update(over)
    return base


@pytest.mark.parametrize("over,key", [
    ({"model_rot": "x"}, "engine.lychee.model_rot"),
    ({"dtype": "int8"}, "engine.lychee.dtype"),
    ({"temperature": "hot"}, "engine.lychee.temperature"),
    ({"max_seq": 100}, "engine.lychee.max_seq"),
    ({"device": "tpu"}, "engine.lychee.device"),
    ({"model_root": "/nonexistent"}, "engine.lychee.model_root"),
])
def test_settings_errors_name_the_key(ckpt, over, key):
    with pytest.raises(SettingsError, match=key.replace(".", r"\.")):
        LycheeEngineSettings.from_mapping(options(ckpt, **over))


@pytest.mark.parametrize("name,sessions", [("lychee-c1.yaml", 1), ("lychee-c2.yaml", 2), ("lychee-c4.yaml", 4)])
def test_profiles_are_valid(ckpt, name, sessions, tmp_path):
    from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder

    data = yaml.safe_load((ROOT / "configs" / name).read_text())
    assert data["engine"]["name"] == "lychee"
    assert data["session"]["max_sessions"] == sessions
    lychee = dict(data["engine"]["lychee"])
    assert lychee["device"].startswith("cuda") and lychee["dtype"] == "bf16"
    # The profile names the released folders in the Hugging Face cache (tests/test_hub_download.py
    # serves from there); swap in tiny folders and validate everything else, the voices included, as written.
    assert lychee["model_root"] == "hf://HIT-TMG/Lychee-FD/lychee_full_duplex"
    assert lychee["token2wav"]["folder"] == "hf://stepfun-ai/Step-Audio-2-mini/token2wav"
    assert lychee["token2wav"]["voices"] == {"default": "builtin"}
    lychee["model_root"] = str(ckpt)
    lychee["token2wav"] = {**lychee["token2wav"], "folder": write_tiny_vocoder(tmp_path, seed=0)["folder"]}
    LycheeEngineSettings.from_mapping(lychee)
    from lychee_rtc.config import load_settings

    settings = load_settings(ROOT / "configs" / name, environ={})
    assert settings.engine.name == "lychee" and settings.session.max_sessions == sessions


class FakeVocoder:
    """Stands in for the streaming Token2Wav: 960 samples per code, tail on final."""

    def __init__(self):
        self.cancelled = 0
        self.pushed: list[int] = []

    def push(self, response_id, codes, final):
        self.pushed += list(codes)
        out = [np.zeros(960 * len(codes), np.float32)] if codes else []
        return out + ([np.zeros(480, np.float32)] if final else [])

    def cancel(self):
        self.cancelled += 1


def test_backend_steps_and_emits_codes(ckpt):
    be = build_lychee_backend(options(ckpt), 2)
    caps = be.capabilities
    assert (caps.input_rate, caps.window_samples, caps.output_rate, caps.max_sessions) == (16000, 6400, 24000, 2)
    assert caps.text_output and caps.audio_output == "codes"
    be.open_slot(1, SessionOptions(seed=3))
    rng = np.random.default_rng(0)
    events = []
    for k in range(4):
        controls = (Control(ControlKind.COMMIT, 0),) if k == 0 else ()
        w = SlotWindow(1, (0.1 * rng.standard_normal(6400)).astype(np.float32), k, 0, controls)
        (out,) = be.step([w])
        events += out
    assert any(isinstance(e, ResponseStarted) for e in events)
    codes = [c for e in events if isinstance(e, CodecTokens) for c in e.codes]
    assert codes and all(0 <= c < be.runner.cfg.stoken_codec_vocab_size for c in codes)
    be.close_slot(1)


def test_vocoder_seam_turns_codes_into_audio(ckpt):
    vocs: dict[int, FakeVocoder] = {}

    def factory(slot, opts):
        vocs[slot] = FakeVocoder()
        return vocs[slot]

    be = build_lychee_backend(options(ckpt), 1, vocoder_factory=factory)
    assert be.capabilities.audio_output == "pcm"
    be.open_slot(0, SessionOptions(seed=3))
    rng = np.random.default_rng(0)
    events = []
    for k in range(4):
        controls = (Control(ControlKind.COMMIT, 0),) if k == 0 else ()
        (out,) = be.step([SlotWindow(0, (0.1 * rng.standard_normal(6400)).astype(np.float32), k, 0, controls)])
        events += out
    assert not any(isinstance(e, CodecTokens) for e in events)
    assert any(isinstance(e, WindowTiming) for e in events)
    audio = [e for e in events if isinstance(e, AudioChunk)]
    if vocs[0].pushed:
        assert audio and sum(len(a.pcm) for a in audio) >= 960 * len(vocs[0].pushed)
    be.apply_controls(0, [Control(ControlKind.CANCEL, 1)])
    assert vocs[0].cancelled >= 1
    done = [e for e in events if isinstance(e, ResponseDone)]
    assert all(d.status in ("completed", "incomplete") for d in done)


def test_tiny_checkpoint_cli_and_step_bench(tmp_path):
    from lychee_rtc.bench.lychee_step import bench_runner, format_table
    from lychee_rtc.engine.lychee.checkpoint import load_model
    from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings
    from lychee_rtc.engine.lychee.tiny import main as tiny_main
    from lychee_rtc.engine.lychee.tokenizer import Tokenizer

    out = tmp_path / "tiny"
    assert tiny_main([str(out), "--seed", "2", "--decision-bias", "4", "--no-vocoder"]) == 0
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json", "vocab.json",
                 "merges.txt", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    torch.set_num_threads(1)
    runner = LycheeRunner(load_model(out, dtype="fp32", progress=False), Tokenizer.from_dir(out), 2,
                          RunnerSettings(max_seq=512, max_speech_tokens=10**6))
    with torch.no_grad():
        stats = bench_runner(runner, 2, windows=2, warmup=1)
    assert {s.mode for s in stats} == {"listen", "speak"}
    assert "| C2 | speak |" in format_table(stats)


def test_token2wav_section_builds_the_vocoder(ckpt, tmp_path):
    from lychee_rtc.engine.lychee.tiny import TinySpec
    from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder

    t2w = write_tiny_vocoder(tmp_path, seed=0)
    talker = write_tiny_checkpoint(tmp_path / "talker", seed=5, spec=TinySpec(decision_bias=4.0))
    with pytest.raises(SettingsError, match=r"engine\.lychee\.token2wav"):
        LycheeEngineSettings.from_mapping(options(ckpt, token2wav={**t2w, "hop": "ten"}))
    be = build_lychee_backend(options(talker, token2wav=t2w), 1)
    assert be.capabilities.audio_output == "pcm" and "default" in be.capabilities.voices
    be.open_slot(0, SessionOptions(seed=3))
    rng = np.random.default_rng(0)
    events = []
    for k in range(5):  # S-S, delay prefix, then > 13 codes (one hop + look-ahead) by window 4
        controls = (Control(ControlKind.COMMIT, 0),) if k == 0 else ()
        (out,) = be.step([SlotWindow(0, (0.1 * rng.standard_normal(6400)).astype(np.float32), k, 0, controls)])
        events += out
    assert not any(isinstance(e, CodecTokens) for e in events)
    audio = [e for e in events if isinstance(e, AudioChunk)]
    started = [e for e in events if isinstance(e, ResponseStarted)]
    assert audio and {a.response_id for a in audio} == {started[0].response_id}
    assert all(a.pcm.dtype == np.float32 and a.pcm.size for a in audio)
    assert [a.seq for a in audio] == sorted(a.seq for a in audio)
    be.close_slot(0)


class FailingVocoder(FakeVocoder):
    """The fake vocoder with faults injected: a voice that cannot be prepared, a stream that breaks."""

    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail

    def update(self, opts):
        if self.fail:
            raise RuntimeError("prompt too long")

    def push(self, response_id, codes, final):
        if self.fail and codes:
            raise RuntimeError("stream broke")
        return super().push(response_id, codes, final)


def _speak(be, slots_epochs, windows=4, seed=0):
    rng = np.random.default_rng(seed)
    events = {slot: [] for slot, _ in slots_epochs}
    for k in range(windows):
        batch = [SlotWindow(slot, (0.1 * rng.standard_normal(6400)).astype(np.float32), k, epoch,
                            (Control(ControlKind.COMMIT, epoch),) if k == 0 else ())
                 for slot, epoch in slots_epochs]
        for (slot, _), out in zip(slots_epochs, be.step(batch)):
            events[slot] += out
    return events


def test_a_failing_vocoder_fails_its_own_response_only(ckpt):
    be = build_lychee_backend(options(ckpt), 2, vocoder_factory=lambda slot, opts: FailingVocoder(slot == 0))
    be.open_slot(0, SessionOptions(seed=3))
    be.open_slot(1, SessionOptions(seed=3))
    # A voice change the vocoder cannot make is an error event; the CANCEL after it still applies.
    events = be.apply_controls(0, [Control(ControlKind.UPDATE, 0, SessionOptions(voice="long")),
                                   Control(ControlKind.CANCEL, 1)])
    assert any(isinstance(e, EngineError) and e.code == "vocoder_control_failed" for e in events)
    assert be.runner.slots[0].epoch == 1
    events = _speak(be, [(0, 1), (1, 0)])
    started = [e for e in events[0] if isinstance(e, ResponseStarted)]
    assert started, "slot 0 never started to speak"
    done = [e for e in events[0] if isinstance(e, ResponseDone)]
    assert [d.status for d in done] == ["failed"] and done[0].epoch == 1
    assert any(isinstance(e, EngineError) and e.code == "vocoder_failed" and e.epoch == 1 for e in events[0])
    assert be.runner.slots[0].response_id is None
    # The other session kept its audio.
    assert any(isinstance(e, AudioChunk) for e in events[1])
    assert not any(isinstance(e, EngineError) for e in events[1])


def test_commit_while_speaking_does_not_restart_after_a_cancel(ckpt):
    be = build_lychee_backend(options(ckpt), 1)
    be.open_slot(0, SessionOptions(seed=3))
    events = _speak(be, [(0, 0)], windows=2)
    assert any(isinstance(e, ResponseStarted) for e in events[0])
    be.apply_controls(0, [Control(ControlKind.COMMIT, 0)])  # while speaking: meaningless, ignored
    assert be.runner.slots[0].commit is False
    be.apply_controls(0, [Control(ControlKind.CANCEL, 1)])
    rng = np.random.default_rng(1)
    (out,) = be.step([SlotWindow(0, (0.1 * rng.standard_normal(6400)).astype(np.float32), 9, 1)])
    assert not any(isinstance(e, ResponseStarted) for e in out)


def test_a_window_for_a_closed_slot_is_skipped(ckpt):
    be = build_lychee_backend(options(ckpt), 2)
    be.open_slot(0, SessionOptions(seed=3))
    be.open_slot(1, SessionOptions(seed=3))
    be.close_slot(0)
    rng = np.random.default_rng(2)
    w = [SlotWindow(s, (0.1 * rng.standard_normal(6400)).astype(np.float32), 0, 0) for s in (0, 1)]
    before = be.runner.slots[1].window
    dead, _ = be.step(w)
    assert dead == [] and be.runner.slots[1].window == before + 1  # the live slot was stepped
