"""Long conversations on a Lychee-FD slot: the rolling context (the system prefix kept as the sink,
the recent conversation re-prefilled at new positions), on tiny random checkpoints in the released
layout, through the real loader and runner.

* Exactness: after every slide, the next window's text, speech and control logits are those of a
  fresh teacher-forced forward (a second model loaded from the same files) over exactly the kept
  tokens at their new positions; so are the text and control logits of every other window, and the
  speech logits wherever the live caches hold only recorded tokens.
* Behaviour across slides: a response that spans slides goes on under the same id with its audio
  gapless; barge-in, cancel and epochs work at and after a slide; new instructions take effect at
  the next slide; the slot's memory does not grow.
* The policy's arithmetic and settings, and the policy in the engine's capabilities.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lychee_rtc.engine.lychee.decode as decode_mod
from lychee_rtc.engine.base import (
    AudioChunk,
    BargeIn,
    Control,
    ControlKind,
    EngineError,
    ResponseDone,
    ResponseStarted,
    SessionOptions,
    SlotWindow,
)
from lychee_rtc.engine.lychee.backend import LycheeEngineSettings, SettingsError, build_lychee_backend
from lychee_rtc.engine.lychee.checkpoint import load_model
from lychee_rtc.engine.lychee.context import ContextSettingsError, SlidePolicy
from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings
from lychee_rtc.engine.lychee.scoring import score_teacher_forced
from lychee_rtc.engine.lychee.slot import Mode
from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint
from lychee_rtc.engine.lychee.tokenizer import Tokenizer
from strict import CUDA_REASON_PREFIX

# A slot of 256 positions: the 37-position system prefix, 100 kept, a slide every 6 windows.
SMALL = dict(max_seq=256, context_window=100, context_slide_step=60, context_prefill_chunk=32)
GREEDY = dict(temperature=0.0, start_speak_factor=1.0, start_listen_factor=1.0, max_speech_tokens=10**6,
              max_text_tokens=10**6)
# fp32 logits of a scale of ~5; the reference itself shows ~3e-6 between its cached and uncached paths.
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("lychee-context")
    # Decisions biased to "keep". "plain": a response ends with <tts_end>; "endless": speech never
    # ends by itself, so a response lasts until the script (or a client) stops it.
    return {"plain": write_tiny_checkpoint(root / "plain", seed=3, spec=TinySpec(decision_bias=4.0)),
            "endless": write_tiny_checkpoint(root / "endless", seed=4,
                                             spec=TinySpec(decision_bias=4.0, endless_speech=True))}


def windows(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(6400)).astype(np.float32) for _ in range(n)]


class Recorder:
    """Wraps the decode module's sampling entry points: keeps the logits each decision was taken
    from, and scripts control decisions by window (index 0 = S-S / S-L, 1 = K-L / K-S)."""

    def __init__(self, monkeypatch, script: dict[int, int]):
        self.calls: list[tuple] = []
        self.script = script
        self.window = 0
        sample_text, sample_speech, control_decision = (decode_mod.sample_text, decode_mod.sample_speech,
                                                        decode_mod.control_decision)

        def text(logits, *args, **kwargs):
            out = sample_text(logits, *args, **kwargs)
            self.calls.append(("text", logits.detach().clone(), out[0].clone()))
            return out

        def speech(logits, *args, **kwargs):
            self.calls.append(("speech", logits.detach().clone()))
            return sample_speech(logits, *args, **kwargs)

        def control(scores, factor):
            choice, probs = control_decision(scores, factor)
            self.calls.append(("control", scores.detach().clone()))
            if self.window in self.script:
                choice = torch.full_like(choice, self.script[self.window])
            return choice, probs

        monkeypatch.setattr(decode_mod, "sample_text", text)
        monkeypatch.setattr(decode_mod, "sample_speech", speech)
        monkeypatch.setattr(decode_mod, "control_decision", control)


def check_window(ref, r: LycheeRunner, calls: list[tuple], fed0: int, wins: list[np.ndarray],
                 speech_exact: bool) -> dict[str, int]:
    """Compare the logits recorded in one window with a teacher-forced forward of ``ref`` over the
    slot's context as it stands (prefix + kept + this window). Returns what was compared."""
    s = r.slots[0]
    t = r.tok
    first = s.dropped // 10
    audio = np.concatenate(wins[first:first + len(s.text) // 10])
    out = score_teacher_forced(ref, t, s.prefix_ids, s.text, s.stoken, s.control, audio)
    p = s.prefix_len
    lo, hi = r.rules.speech_slice.start, r.rules.speech_slice.stop
    done = {"text": 0, "speech": 0, "control": 0}
    if calls[0][0] == "control":  # a listening window: one forward, the decision from its last position
        q = s.fed - 1
        rows = [t.start_speaking, t.keep_listening]
        torch.testing.assert_close(calls[0][1][0], out.control_logits[p + q, rows], **TOLERANCE)
        done["control"] += 1
        return done
    step = [c for c in calls if c[0] == "text"]
    speech = [c for c in calls if c[0] == "speech"]
    assert len(step) == len(speech) == 10
    for j in range(10):
        q = fed0 + j
        torch.testing.assert_close(step[j][1][0], out.text_logits[p + q], **TOLERANCE)
        done["text"] += 1
        if speech_exact and step[j][2][0].item() == s.text[q + 1]:
            torch.testing.assert_close(speech[j][1][0], out.speech_logits[p + q, lo:hi], **TOLERANCE)
            done["speech"] += 1
    rows = [t.start_listening, t.keep_speaking]
    torch.testing.assert_close(calls[-1][1][0], out.control_logits[p + fed0 + 9, rows], **TOLERANCE)
    done["control"] += 1
    return done


# Decisions forced by window (0: S-S while listening, S-L while speaking). endless: S-S at window 3,
# barge-in at 9, S-S at 12, barge-in at 21 (a slide's window), S-S at 24, barge-in at 34, S-S at 38;
# plain: S-S every few windows, the responses ending by themselves.
SCRIPTS = {"endless": {3: 0, 9: 0, 12: 0, 21: 0, 24: 0, 34: 0, 38: 0},
           "plain": {2: 0, 8: 0, 14: 0, 20: 0, 26: 0, 32: 0, 38: 0}}


@pytest.mark.parametrize("kind", ["endless", "plain"])
def test_next_logits_after_each_slide_equal_a_fresh_forward_over_the_kept_tokens(ckpts, monkeypatch, kind):
    ckpt = ckpts[kind]
    model = load_model(ckpt, dtype="fp32", progress=False)
    ref = load_model(ckpt, dtype="fp32", progress=False)  # the fresh forward: its own caches, nothing shared
    tok = Tokenizer.from_dir(ckpt)
    rec = Recorder(monkeypatch, SCRIPTS[kind])
    # plain: speech sampled (temperature 0.7, seeded) and ended by <tts_end> after 25 codes at the
    # latest, so responses also end naturally, the rest of their window padded
    sampling = GREEDY if kind == "endless" else {**GREEDY, "temperature": 0.7, "max_speech_tokens": 25}
    r = LycheeRunner(model, tok, 1, RunnerSettings(**SMALL, **sampling))
    r.open(0, SessionOptions())
    s = r.slots[0]
    n = 46
    wins = windows(n, 7)
    after_slide: dict[str, int] = {"speaking": 0, "listening": 0}
    compared = {"text": 0, "speech": 0, "control": 0}
    speech_exact = True  # live caches hold only recorded tokens (no response stopped since the last slide)
    slid_into: int | None = None
    cancelled_mid_slide = False
    natural_ends = 0
    for k in range(n):
        if kind == "endless" and k == 32:
            # A client cancel between two steps while a slide is being prepared and has caught up
            # with the slot: the position whose "next text" it rewrites must be staged again.
            job = r.slides.get(0)
            assert s.mode is Mode.SPEAKING and job is not None and job.staged == job.target(len(s.text), s.fed)
            r.apply_controls(0, [Control(ControlKind.CANCEL, s.epoch + 1), Control(ControlKind.COMMIT, s.epoch + 1)])
            cancelled_mid_slide = True
            speech_exact = False
        rec.window = k
        rec.calls.clear()
        fed0, slides0, mode0 = s.fed, s.context_slides, s.mode
        res = r.step([(0, wins[k], s.epoch)])[0]
        if any(isinstance(e, BargeIn) for e in res.events):
            speech_exact = False
        natural_ends += sum(isinstance(e, ResponseDone) and e.status == "completed" for e in res.events)
        if s.context_slides > slides0:
            # This step ended with a slide: its logits belong to the old context; the next is checked.
            slid_into = k + 1
            speech_exact = True
            assert len(s.text) == r.policy.kept(s.prefix_len, s.prefix_len)
            continue
        got = check_window(ref, r, rec.calls, fed0, wins, speech_exact or slid_into == k)
        for key, v in got.items():
            compared[key] += v
        if slid_into == k:
            assert got["control"] == 1 and (mode0 is Mode.LISTENING or got["speech"] >= 5)
            after_slide["speaking" if mode0 is Mode.SPEAKING else "listening"] += 1
    assert s.context_slides >= 5 and s.context_resets == 0
    assert s.dropped == s.context_slides * 60
    assert compared["control"] >= 35, compared
    if kind == "endless":  # slides while speaking and listening, a barge-in at a slide, a cancel mid-slide
        assert after_slide["speaking"] >= 3 and after_slide["listening"] >= 1 and cancelled_mid_slide, after_slide
        assert compared["text"] >= 200 and compared["speech"] >= 150, compared
    else:  # responses ending by themselves, before, across and after slides
        assert natural_ends >= 3 and after_slide["speaking"] >= 3, (natural_ends, after_slide)
        assert compared["text"] >= 150 and compared["speech"] >= 100, compared
