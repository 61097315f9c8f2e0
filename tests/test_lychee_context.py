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
import lychee_rtc.engine.lychee.model as model_mod
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
SMALL = dict(max_seq=256, context_window=100, context_slide_step=60)
GREEDY = dict(temperature=0.0, start_speak_factor=1.0, start_listen_factor=1.0, max_speech_tokens=10**6,
              max_text_tokens=10**6)
# fp32 logits of a scale of ~5; the reference itself shows ~3e-6 between its cached and uncached paths.
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


pytestmark = pytest.mark.usefixtures("torch_one_thread")


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


@pytest.mark.parametrize("attention", ["masked", "open prefix"])
@pytest.mark.parametrize("kind", ["endless", "plain"])
def test_next_logits_after_each_slide_equal_a_fresh_forward_over_the_kept_tokens(ckpts, monkeypatch, kind, attention):
    """``open prefix``: every re-prefill piece attends to the keys before it without a mask (on a
    CPU the engine does so only where those are thousands, beyond this slot's 256 positions)."""
    ckpt = ckpts[kind]
    open_calls = []
    if attention == "open prefix":
        monkeypatch.setattr(model_mod, "OPEN_PREFIX_MIN_KEYS", 1)
        monkeypatch.setattr(model_mod, "OPEN_PREFIX_MIN", 0)
        attend = model_mod.attend_open_prefix
        monkeypatch.setattr(model_mod, "attend_open_prefix", lambda *a: open_calls.append(1) or attend(*a))
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
    assert (len(open_calls) > 0) == (attention == "open prefix")
    assert compared["control"] >= 35, compared
    if kind == "endless":  # slides while speaking and listening, a barge-in at a slide, a cancel mid-slide
        assert after_slide["speaking"] >= 3 and after_slide["listening"] >= 1 and cancelled_mid_slide, after_slide
        assert compared["text"] >= 200 and compared["speech"] >= 150, compared
    else:  # responses ending by themselves, before, across and after slides
        assert natural_ends >= 3 and after_slide["speaking"] >= 3, (natural_ends, after_slide)
        assert compared["text"] >= 150 and compared["speech"] >= 100, compared


def test_a_response_spanning_slides_goes_on_gapless_and_barge_in_and_epochs_hold(ckpts, tmp_path, monkeypatch):
    """Through the backend with the tiny Token2Wav: one response over three slides keeps its id and
    its audio (one 400 ms chunk per window, in sequence); a client cancel, a new response, a model
    barge-in decided in the very window that ends with a slide, and the answer after it all go as
    they do without slides."""
    from lychee_rtc.engine.base import ContextPolicy, TurnState
    from lychee_rtc.engine.lychee.token2wav_slots import Token2WavPool
    from lychee_rtc.vocoder.token2wav import write_test_prompt, write_tiny_token2wav

    pool = Token2WavPool.load(write_tiny_token2wav(tmp_path / "token2wav", seed=1),
                              {"alpha": write_test_prompt(tmp_path / "alpha.wav", seconds=0.8, seed=1)},
                              default_voice="alpha")
    at = {"window": 0}
    control_decision = decode_mod.control_decision

    def scripted(scores, factor):  # the model's own barge-in (S-L) at window 39, which ends with a slide
        choice, probs = control_decision(scores, factor)
        return (torch.zeros_like(choice) if at["window"] == 39 else choice), probs

    monkeypatch.setattr(decode_mod, "control_decision", scripted)
    opts = {"model_root": str(ckpts["endless"]), "dtype": "fp32", "device": "cpu", "max_seq": 512,
            "torch_threads": 1, "progress": False, "strict_codec_range": True, "context_window": 100,
            "context_slide_step": 60}
    be = build_lychee_backend(opts, 1, vocoder_factory=pool)
    assert be.capabilities.context == ContextPolicy("sliding", 512, 25.0, 37, 100, 60)
    be.open_slot(0, SessionOptions(seed=3))
    s = be.runner.slots[0]
    wins = windows(48, 9)
    epoch = 0
    events: list[list] = []
    slides_after: list[int] = []
    for k in range(48):
        controls: tuple = ()
        if k == 0:
            controls = (Control(ControlKind.COMMIT, 0),)
        if k == 30:  # the client cuts the answer and asks again
            epoch = 1
            controls = (Control(ControlKind.CANCEL, 1), Control(ControlKind.COMMIT, 1))
        if k == 40:  # the session's answer to the model's barge-in: a new epoch, then "answer now"
            epoch = 2
            controls = (Control(ControlKind.CANCEL, 2), Control(ControlKind.COMMIT, 2))
        at["window"] = k
        before = s.context_slides
        events.append(be.step([SlotWindow(0, wins[k], k, epoch, controls)])[0])
        if s.context_slides > before:
            slides_after.append(k)
    assert slides_after == [15, 21, 27, 33, 39, 45] and s.context_resets == 0
    assert not any(isinstance(e, EngineError) for ev in events for e in ev)

    def audio(lo: int, hi: int) -> list[AudioChunk]:
        return [e for ev in events[lo:hi] for e in ev if isinstance(e, AudioChunk)]

    # First response: windows 0..29, three slides, one id, no end, a chunk in every window once begun.
    first = [e for ev in events[:30] for e in ev if isinstance(e, ResponseStarted)]
    assert len(first) == 1 and not any(isinstance(e, ResponseDone) for ev in events[:30] for e in ev)
    chunks = audio(0, 30)
    assert {c.response_id for c in chunks} == {first[0].response_id}
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.pcm.size for c in chunks] == [5760] + [9600] * (len(chunks) - 1)
    assert all(sum(isinstance(e, AudioChunk) for e in ev) == 1 for ev in events[30 - len(chunks) + 1:30])
    # The cancel ends it under epoch 1; the new answer (epoch 1) goes over the slide at window 33.
    cut = [e for e in events[30] if isinstance(e, (TurnState, ResponseStarted))]
    assert [(type(e), getattr(e, "state", None)) for e in cut] == [
        (TurnState, "listening"), (TurnState, "speaking"), (ResponseStarted, None)]
    assert all(e.epoch == 1 for e in cut)
    second = audio(30, 40)
    assert second and {c.response_id for c in second} == {cut[2].response_id} and all(c.epoch == 1 for c in second)
    assert [c.seq for c in second] == list(range(second[0].seq, second[0].seq + len(second)))
    # The model barges in at window 39, which also ends with a slide; after the session's cancel the
    # next answer starts under epoch 2 and its audio flows again.
    barge = [e for e in events[39] if isinstance(e, BargeIn)]
    assert len(barge) == 1 and barge[0].response_id == cut[2].response_id and barge[0].epoch == 1
    third = [e for e in events[40] if isinstance(e, ResponseStarted)]
    assert len(third) == 1 and third[0].epoch == 2
    late = audio(40, 48)
    assert late and all(c.response_id == third[0].response_id and c.epoch == 2 for c in late)
    be.close_slot(0)


def test_new_instructions_take_effect_at_the_next_slide(ckpts, monkeypatch):
    ckpt = ckpts["endless"]
    model, ref = load_model(ckpt, dtype="fp32", progress=False), load_model(ckpt, dtype="fp32", progress=False)
    tok = Tokenizer.from_dir(ckpt)
    rec = Recorder(monkeypatch, {2: 0})
    r = LycheeRunner(model, tok, 1, RunnerSettings(**SMALL, **GREEDY))
    r.open(0, SessionOptions())
    s = r.slots[0]
    wins = windows(24, 5)
    for k in range(24):
        if k == 12:  # mid-conversation, while speaking: kept for the next slide
            r.apply_controls(0, [Control(ControlKind.UPDATE, 0, SessionOptions(instructions="Be brief."))])
            assert s.pending_prefix_ids is not None and s.prefix_len == 37
        rec.window = k
        rec.calls.clear()
        fed0, slides0 = s.fed, s.context_slides
        r.step([(0, wins[k], 0)])
        if s.context_slides > slides0 and k > 12:
            if s.context_slides == 1:  # its re-prefill began before the update: the old prompt
                assert s.prefix_len == 37 and s.pending_prefix_ids is not None
            else:
                break
    assert tok.decode(s.prefix_ids) == "<|BOT|>system\nBe brief.<|EOT|>" and s.pending_prefix_ids is None
    assert s.mode is Mode.SPEAKING and s.context_slides == 2 and s.dropped == 120 and len(s.text) == 100
    # The next window runs on the new prompt and the kept conversation, exactly.
    rec.window = k + 1
    rec.calls.clear()
    fed0 = s.fed
    r.step([(0, wins[k + 1], 0)])
    got = check_window(ref, r, rec.calls, fed0, wins, speech_exact=True)
    assert got == {"text": 10, "speech": got["speech"], "control": 1} and got["speech"] >= 5


def test_a_slot_stays_the_same_size_over_many_slides(ckpts):
    """A long listening-and-speaking conversation: the host lists, the device buffers and the
    slide bookkeeping stay within fixed bounds (the soak bench measures the process's memory)."""
    ckpt = ckpts["plain"]
    model = load_model(ckpt, dtype="fp32", progress=False)
    r = LycheeRunner(model, Tokenizer.from_dir(ckpt), 1, RunnerSettings(**SMALL, max_speech_tokens=30))
    caches = [(c.k_cache.data_ptr(), c.k_cache.shape) for c in model.caches()]
    buffers = (r.rule_rows.history.data_ptr(), r.store.feats.data_ptr())
    r.open(0, SessionOptions(seed=1))
    s = r.slots[0]
    wins = windows(12, 3)
    longest = 0
    for k in range(130):  # 52 s of conversation in a 256-position slot
        if k % 8 == 0 and s.mode is Mode.LISTENING:
            r.apply_controls(0, [Control(ControlKind.COMMIT, s.epoch)])
        r.step([(0, wins[k % len(wins)], s.epoch)])
        longest = max(longest, len(s.text), len(s.stoken), len(s.control))
        assert s.prefix_len + s.fed <= 256 and len(r.slides) <= 1
    assert s.context_slides >= 18 and s.context_resets == 0
    assert longest == 150  # kept + slide step - 10: the slide takes effect in the step that reaches it
    assert [(c.k_cache.data_ptr(), c.k_cache.shape) for c in model.caches()] == caches
    assert (r.rule_rows.history.data_ptr(), r.store.feats.data_ptr()) == buffers


def test_policy_arithmetic():
    p = SlidePolicy.build(8192, 6000, 1500, None, prefix_len=10, max_prefix=2048)
    plan = p.plan(10, 10, decided=6010)  # started right after the last slide: a whole slide step to run
    assert (plan.kept, plan.shift, plan.swap_at) == (6000, 1500, 7500)
    assert p.last_switch(10) == 8160  # the window after it would be within two of the end
    assert p.kept(2048, 2048) == 4620  # a long system prompt shrinks the window, never the slot
    longer = p.plan(10, 2048, decided=7400)  # a new prompt longer by more than a step: the time left
    assert (longer.kept, longer.swap_at, longer.shift) == (4620, 8160, 3540)
    # Re-prefill budget: the largest context (min(2048 + 6000, 8192 - 1500 - 20) = 6672) over the 150
    # window steps of a slide less 2 in reserve, 46 a step, x 1.25.
    assert (p.rate, p.budget) == (46, 58)
    assert SlidePolicy.build(8192, 6000, 1500, None, 10, 2048, sessions=4).budget == 230
    derived = SlidePolicy.build(8192, None, None, None, prefix_len=10, max_prefix=2048)
    assert (derived.step, derived.window) == (1630, 6530)
    off = SlidePolicy.build(8192, 0, None, None, prefix_len=10, max_prefix=2048)
    assert not off.enabled and off.plan(10, 10, decided=10) is None
    for kwargs, key in (({"window": 6005}, "context_window"), ({"step": 0}, "context_slide_step"),
                        ({"window": 7000}, "context_window"), ({"budget": 10}, "context_prefill_budget"),
                        ({"budget": 45}, "context_prefill_budget"), ({"step": 6120, "window": 10}, "context_slide_step")):
        args = {"window": 6000, "step": 1500, "budget": None} | kwargs
        with pytest.raises(ContextSettingsError, match=key):
            SlidePolicy.build(8192, args["window"], args["step"], args["budget"], prefix_len=10, max_prefix=2048)


def test_context_settings_errors_name_the_key(ckpts):
    base = {"model_root": str(ckpts["plain"]), "dtype": "fp32", "device": "cpu", "max_seq": 1024,
            "progress": False, "torch_threads": 1}
    for over, key in (({"context_window": 105}, "engine.lychee.context_window"),
                      ({"context_slide_step": 0}, "engine.lychee.context_slide_step"),
                      ({"context_prefill_budget": 8}, "engine.lychee.context_prefill_budget"),
                      ({"context_window": "6000"}, "engine.lychee.context_window")):
        with pytest.raises(SettingsError, match=key.replace(".", r"\.")):
            LycheeEngineSettings.from_mapping(base | over)
    # Only the tokenizer knows the prefix: checked when the engine loads, still naming the key.
    with pytest.raises(SettingsError, match=r"engine\.lychee\.context_window: 6000"):
        build_lychee_backend(base | {"context_window": 6000, "context_slide_step": 1500}, 1)
    reset = build_lychee_backend(base | {"context_window": 0}, 1).capabilities.context
    assert reset is not None and (reset.mode, reset.window_positions, reset.slide_positions) == ("reset", 0, 0)
    derived = build_lychee_backend(base, 1).capabilities.context
    assert derived is not None and derived.mode == "sliding" and derived.sink_positions == 37
    assert (derived.slide_positions, derived.window_positions) == (200, 760)  # 1024 // 5; 1024 - 200 - 37 - 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{CUDA_REASON_PREFIX}: graph capture and replay")
def test_replayed_graphs_give_the_eager_streams_across_slides(ckpts):  # pragma: no cover - GPU only
    """The captured window programs read the caches, speech history and positions a slide rewrote
    in place: with graphs, the same tokens and decision probabilities as eager, slide after slide."""
    ckpt = ckpts["endless"]
    tok = Tokenizer.from_dir(ckpt)
    streams = {}
    for graphs in ("off", "on"):
        model = load_model(ckpt, dtype="fp32", device="cuda", progress=False)
        r = LycheeRunner(model, tok, 2, RunnerSettings(**SMALL, **GREEDY, cuda_graphs=graphs))
        assert r.graphs_captured is (graphs == "on")
        for slot in (0, 1):
            r.open(slot, SessionOptions(seed=slot))
        r.apply_controls(0, [Control(ControlKind.COMMIT, 0)])
        wins = windows(40, 6)
        for k in range(40):
            if k == 20:
                r.apply_controls(1, [Control(ControlKind.COMMIT, 0)])
            r.step([(0, wins[k], 0), (1, wins[39 - k], 0)])
        streams[graphs] = [(r.slots[i].text, r.slots[i].stoken, r.slots[i].control, r.slots[i].context_slides)
                           for i in (0, 1)]
    assert streams["on"] == streams["off"] and all(st[3] >= 3 for st in streams["on"])
