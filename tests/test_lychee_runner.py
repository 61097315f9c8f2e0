"""The real-time runner on a tiny checkpoint: agreement with teacher-forced scoring, batching,
seeding, the duplex state machine (start, natural end, barge-in, cancel, forced listen) and the
context-limit policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lychee_rtc.engine.lychee.decode as decode_mod
from lychee_rtc.engine.base import (
    BargeIn,
    CodecTokens,
    Control,
    ControlKind,
    EngineError,
    ResponseDone,
    ResponseStarted,
    SessionOptions,
    TextDelta,
)
from lychee_rtc.engine.lychee.checkpoint import load_model
from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings
from lychee_rtc.engine.lychee.slide import Slider
from lychee_rtc.engine.lychee.slot import Mode
from lychee_rtc.engine.lychee.sampling import control_decision, ngram_banned
from lychee_rtc.engine.lychee.scoring import score_teacher_forced
from lychee_rtc.engine.lychee.tiny import write_tiny_checkpoint
from lychee_rtc.engine.lychee.tokenizer import Tokenizer

GREEDY = dict(temperature=0.0, no_repeat_ngram=0, start_speak_factor=1.0, start_listen_factor=1.0)


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lychee-run") / "tiny", seed=3)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def windows(n: int, seed: int = 0, scale: float = 0.1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(6400)).astype(np.float32) for _ in range(n)]


def run(r: LycheeRunner, slot_windows: dict[int, list[np.ndarray]], controls=None):
    """Step all given slots together window by window; return events per slot."""
    events: dict[int, list] = {s: [] for s in slot_windows}
    n = len(next(iter(slot_windows.values())))
    for k in range(n):
        for (slot, at), cs in (controls or {}).items():
            if at == k:
                events[slot] += r.apply_controls(slot, cs)
        res = r.step([(s, w[k], r.slots[s].epoch) for s, w in slot_windows.items()])
        for s, out in zip(slot_windows, res):
            events[s] += out.events
    return events


class Scripted:
    """Replace the greedy decision with a script: index 0 = S-S / S-L, 1 = K-L / K-S."""

    def __init__(self, listening: list[int], speaking: list[int]):
        self.script = {2: list(listening), 1: list(speaking)}

    def __call__(self, scores, factor):
        choice, probs = control_decision(scores, factor)
        # listening calls use start_speak_factor (2.0 below), speaking ones start_listen_factor (1.0)
        key = 2 if factor == 2.0 else 1
        if self.script[key]:
            choice = torch.full_like(choice, self.script[key].pop(0))
        return choice, probs


def test_streaming_matches_teacher_forced_scoring(model, tok):
    r = LycheeRunner(model, tok, 2, RunnerSettings(max_seq=512, **GREEDY))
    r.open(0, SessionOptions())
    wins = windows(8)
    run(r, {0: wins}, controls={(0, 0): [Control(ControlKind.COMMIT, 0)]})
    s = r.slots[0]
    assert len(s.text) == 80 and s.fed == 79
    st = r.tok
    out = score_teacher_forced(model, st, r.prefix_ids, s.text, s.stoken, s.control, np.concatenate(wins))
    p = r.prefix_len
    checked = 0
    for q in range(79):
        nt, ns, nc = s.text[q + 1], s.stoken[q + 1], s.control[q + 1]
        if nt not in (st.text_pad, st.tts_pad):  # a freely sampled (greedy) text token
            assert out.text_logits[p + q].argmax().item() == nt, q
            checked += 1
        if st.audio_code_min <= ns < r.cfg.stoken_token_ids_max or ns == st.tts_end:
            logits = out.speech_logits[p + q].clone()
            mask = torch.ones_like(logits, dtype=torch.bool)
            mask[st.audio_code_min:r.cfg.stoken_token_ids_max] = False
            mask[st.tts_end] = False
            assert logits.masked_fill(mask, -1e30).argmax().item() == ns, q
            checked += 1
        if (q + 1) % 10 == 9 and nc in (st.keep_listening, st.keep_speaking) and q + 1 > 9:
            other = st.start_speaking if nc == st.keep_listening else st.start_listening
            assert out.control_logits[p + q, nc] > out.control_logits[p + q, other], q
    assert checked > 10
    # the grammar: Sleep x8, Detect, decision in every window
    for q in range(1, 80):
        if q % 10 == 8:
            assert s.control[q] == st.detect
        elif q % 10 != 9:
            assert s.control[q] == st.sleep


def test_batched_slots_match_single_slot_and_seed_is_reproducible(model, tok):
    wins_a, wins_b = windows(6, 1), windows(6, 2)
    commit = [Control(ControlKind.COMMIT, 0)]

    def tokens(slots: dict[int, list], seed: int = 7):
        r = LycheeRunner(model, tok, 4, RunnerSettings(max_seq=512, seed=0))
        for s in slots:
            r.open(s, SessionOptions(seed=seed))
        run(r, slots, controls={(s, 0): commit for s in slots})
        return {s: (r.slots[s].text, r.slots[s].stoken, r.slots[s].control) for s in slots}

    alone = tokens({2: wins_a})[2]
    together = tokens({0: wins_b, 2: wins_a, 3: wins_b})
    assert together[2] == alone  # other sessions in the batch never change a session's output
    assert together[0] == together[3]  # same seed, same audio, different cache rows
    again = tokens({2: wins_a})[2]
    assert again == alone
    other_seed = tokens({2: wins_a}, seed=8)[2]
    assert other_seed[0] == alone[0]  # text is greedy
    lo = model.cfg.token_fields["stoken_audio_token_id_min"]
    if any(lo <= c < lo + model.cfg.stoken_codec_vocab_size for c in alone[1]):
        assert other_seed[1] != alone[1]  # speech is sampled


def test_natural_end_emits_codes_then_completed(ckpt, tok, monkeypatch):
    # Speech greedy with a silenced merge branch: all speech logits tie, so the lowest allowed id,
    # <tts_end>, is chosen at the first free step after the forced delay prefix.
    m = load_model(ckpt, dtype="fp32", progress=False)
    m.merge_model.norm.weight.data.zero_()
    monkeypatch.setattr(decode_mod, "control_decision", Scripted([0], [1, 1, 1]))
    r = LycheeRunner(m, tok, 1, RunnerSettings(max_seq=512, temperature=0.0, start_speak_factor=2.0, start_listen_factor=1.0))
    r.open(0, SessionOptions())
    ev = run(r, {0: windows(5)})[0]
    kinds = [e.kind for e in ev]
    assert kinds.index("response_started") < kinds.index("response_done")
    done = next(e for e in ev if isinstance(e, ResponseDone))
    assert done.status == "completed"
    s = r.slots[0]
    st = r.tok
    end = s.stoken.index(st.tts_end)
    assert end == 10 + 11  # S-S at 9; delay x10 at 10..19, <tts_start> at 20, <tts_end> at 21
    assert s.stoken[10:20] == [st.stoken_delay] * 10 and s.stoken[20] == st.tts_start
    # the rest of that window is padding closing with S-L, then the model listens again
    assert s.control[29] == st.start_listening and s.mode is Mode.LISTENING
    assert all(x == st.stoken_pad for x in s.stoken[22:30])
    assert not any(isinstance(e, BargeIn) for e in ev)


def test_barge_in_and_cancel_follow_the_epoch_contract(model, tok, monkeypatch):
    monkeypatch.setattr(decode_mod, "control_decision", Scripted([0], [1, 0]))
    r = LycheeRunner(model, tok, 1, RunnerSettings(max_seq=512, start_speak_factor=2.0, start_listen_factor=1.0))
    r.open(0, SessionOptions())
    ev = run(r, {0: windows(3)})[0]
    started = next(e for e in ev if isinstance(e, ResponseStarted))
    barge = [e for e in ev if isinstance(e, BargeIn)]
    assert len(barge) == 1 and barge[0].response_id == started.response_id and barge[0].epoch == 0
    s = r.slots[0]
    st = r.tok
    assert s.mode is Mode.LISTENING
    # S->L tail fallback: the decision position keeps S-L with padded text and speech
    assert (s.text[29], s.stoken[29], s.control[29]) == (st.text_pad, st.stoken_pad, st.start_listening)
    # the session answers with CANCEL under a new epoch: later events carry it
    r.apply_controls(0, [Control(ControlKind.CANCEL, 1)])
    r.apply_controls(0, [Control(ControlKind.COMMIT, 1)])
    res = r.step([(0, windows(1, 9)[0], 1)])[0]
    assert all(getattr(e, "epoch", 1) == 1 for e in res.events)
    assert any(isinstance(e, ResponseStarted) for e in res.events)


def test_client_cancel_and_forced_listen(model, tok):
    r = LycheeRunner(model, tok, 1, RunnerSettings(max_seq=512))
    r.open(0, SessionOptions())
    run(r, {0: windows(1)}, controls={(0, 0): [Control(ControlKind.COMMIT, 0)]})
    assert r.slots[0].mode is Mode.SPEAKING
    events = r.apply_controls(0, [Control(ControlKind.CANCEL, 3), Control(ControlKind.FORCE_LISTEN, 3)])
    assert r.slots[0].mode is Mode.LISTENING and r.slots[0].epoch == 3
    assert all(e.epoch == 3 for e in events)
    # held in listening: even a commit does not start a response
    ev = run(r, {0: windows(4, 5)}, controls={(0, 1): [Control(ControlKind.COMMIT, 3)]})[0]
    assert not any(isinstance(e, (ResponseStarted, TextDelta, CodecTokens)) for e in ev)
    r.apply_controls(0, [Control(ControlKind.RELEASE_LISTEN, 3), Control(ControlKind.COMMIT, 3)])
    ev = run(r, {0: windows(1, 6)})[0]
    assert any(isinstance(e, ResponseStarted) for e in ev)


@pytest.mark.parametrize("stalled_slides", [False, True], ids=["sliding-off", "slides-stalled"])
def test_context_limit_resets_and_never_overflows(model, tok, monkeypatch, stalled_slides):
    # Always decide to speak and keep speaking: the hard stop must end the response cleanly. With
    # sliding off this is the policy; with sliding on it is the last resort, reached here only
    # because the re-prefill is made to do nothing.
    monkeypatch.setattr(decode_mod, "control_decision", Scripted([0] * 50, [1] * 50))
    if stalled_slides:
        monkeypatch.setattr(Slider, "stage", lambda *args, **kwargs: (0, 0))
    r = LycheeRunner(model, tok, 1, RunnerSettings(max_seq=200, context_reserve_windows=3,
                                                   context_window=None if stalled_slides else 0,
                                                   start_speak_factor=2.0, start_listen_factor=1.0,
                                                   max_speech_tokens=1000, max_text_tokens=1000))
    assert r.policy.enabled is stalled_slides
    r.open(0, SessionOptions())
    ev = run(r, {0: windows(40, 4, scale=0.05)})[0]
    assert any(isinstance(e, EngineError) and e.code == "context_reset" for e in ev)
    done = [e for e in ev if isinstance(e, ResponseDone)]
    assert any(d.status == "incomplete" and d.reason == "context_limit" for d in done)
    assert r.slots[0].fed + r.prefix_len <= 200
    assert r.slots[0].context_slides == 0
    assert r.slide_stats.fallbacks == (r.slots[0].context_resets if stalled_slides else 0)


def test_close_resets_the_slot(model, tok):
    r = LycheeRunner(model, tok, 1, RunnerSettings(max_seq=512))
    r.open(0, SessionOptions(seed=1))
    first = run(r, {0: windows(3)}, controls={(0, 0): [Control(ControlKind.COMMIT, 0)]})
    text1 = list(r.slots[0].text)
    r.close(0)
    assert r.slots[0] is None
    r.open(0, SessionOptions(seed=1))
    run(r, {0: windows(3)}, controls={(0, 0): [Control(ControlKind.COMMIT, 0)]})
    assert r.slots[0].text == text1  # nothing of the previous owner leaks into the new session
    assert first


def test_ngram_rule_bans_repeats():
    hist = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 0, 0]])
    ids, valid = ngram_banned(hist, torch.tensor([7]), 4)
    assert set(ids[valid].tolist()) == {8}
    ids, valid = ngram_banned(hist, torch.tensor([2]), 4)
    assert not valid.any()


def test_session_instructions_become_the_system_prefix(model, tok):
    r = LycheeRunner(model, tok, 2, RunnerSettings(max_seq=512, **GREEDY))
    r.open(0, SessionOptions(instructions="Answer briefly."))
    r.open(1, SessionOptions())
    s = r.slots[0]
    assert tok.decode(s.prefix_ids) == "<|BOT|>system\nAnswer briefly.<|EOT|>"
    assert r.slots[1].prefix_ids == r.prefix_ids
    wins = windows(4, 3)
    run(r, {0: wins, 1: wins}, controls={(0, 0): [Control(ControlKind.COMMIT, 0)]})
    out = score_teacher_forced(model, r.tok, s.prefix_ids, s.text, s.stoken, s.control, np.concatenate(wins))
    p = s.prefix_len
    for q in range(39):
        nt = s.text[q + 1]
        if nt not in (r.tok.text_pad, r.tok.tts_pad):
            assert out.text_logits[p + q].argmax().item() == nt, q


def test_restart_prefills_new_instructions_and_update_waits_for_the_next_reset(model, tok):
    wins = windows(3, 7)
    # Reference: a slot opened with the instructions from the start.
    ref = LycheeRunner(model, tok, 1, RunnerSettings(max_seq=512, **GREEDY))
    ref.open(0, SessionOptions(instructions="Speak like a pirate."))
    run(ref, {0: wins})
    # The agent's set-up arrives after the call opened and one window was heard: RESTART makes the
    # slot exactly what it would have been with those instructions from the start.
    r = LycheeRunner(model, tok, 1, RunnerSettings(max_seq=512, **GREEDY))
    r.open(0, SessionOptions())
    run(r, {0: windows(1, 8)})
    assert r.slots[0].window == 1
    r.apply_controls(0, [Control(ControlKind.CANCEL, 1),
                         Control(ControlKind.RESTART, 1, SessionOptions(instructions="Speak like a pirate."))])
    s = r.slots[0]
    assert s.window == 0 and s.prefix_ids == ref.slots[0].prefix_ids
    run(r, {0: wins})
    assert (s.text, s.stoken, s.control) == (ref.slots[0].text, ref.slots[0].stoken, ref.slots[0].control)
    # Mid-conversation, UPDATE keeps the context and holds the new prefix for the next reset.
    before = list(s.text)
    r.apply_controls(0, [Control(ControlKind.UPDATE, 1, SessionOptions(instructions="Be brief."))])
    assert s.text == before and s.prefix_ids == ref.slots[0].prefix_ids
    assert tok.decode(s.pending_prefix_ids) == "<|BOT|>system\nBe brief.<|EOT|>"
    r.start_context(s)  # what the context policy does when the context is nearly full
    assert tok.decode(s.prefix_ids) == "<|BOT|>system\nBe brief.<|EOT|>" and s.pending_prefix_ids is None
