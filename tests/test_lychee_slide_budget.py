"""The engine-wide re-prefill budget of context slides: its arithmetic (pace, earliest-deadline-first
share, batching), the guarantee of the derived budget over many geometries and phases, and the real
runner on tiny checkpoints: several slots sliding together never re-prefill more than the budget in
a step, their pieces run as one batched forward, every slide takes effect at its point with caches
equal to a fresh forward over the kept tokens, and a slide that cannot keep up is counted (late,
then the last resort) without a window lost. Also: the context sizes follow ``max_seq`` in the
shipped profiles."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lychee_rtc.engine.base import Control, ControlKind, EngineError, SessionOptions
from lychee_rtc.engine.lychee.backend import LycheeEngineSettings, SettingsError, build_lychee_backend
from lychee_rtc.engine.lychee.checkpoint import load_model
from lychee_rtc.engine.lychee.context import ContextSettingsError, SlidePolicy
from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings
from lychee_rtc.engine.lychee.scoring import score_teacher_forced
from lychee_rtc.engine.lychee.slide import SlideJob
from lychee_rtc.engine.lychee.slide_budget import Claim, batches, cost, fits, fixed_cost, levelled, pace, padded, share
from lychee_rtc.engine.lychee.slot import Mode
from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint
from lychee_rtc.engine.lychee.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(max_seq=256, context_window=100, context_slide_step=60)


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("slide-budget") / "tiny", seed=5,
                                 spec=TinySpec(decision_bias=4.0))


# ---------------------------------------------------------------------------------------------
# arithmetic


def test_pace_spreads_the_backlog_and_catches_up_before_the_reserve():
    # A re-prefill fed at its pace with ten new positions a step has caught up 2 steps early.
    for known, steps in ((4509, 150), (137, 6), (40, 30), (0, 5), (9, 40)):
        staged_per_step = []
        for left in range(steps, 0, -1):
            g = pace(known, left)
            assert 0 <= g <= known
            staged_per_step.append(g)
            known += 10 - g
            if left <= 3:  # the reserve: from here on only the ten new positions
                assert known == 10
        assert max(staged_per_step) - min(staged_per_step[:-3] or [0]) <= max(11, known)  # level, no burst
    assert pace(500, 0) == pace(500, -3) == 500  # late: all it knows
    # Pieces of at least the steady rate: a slide that only keeps up waits until it has that many.
    known, pieces = 0, []
    for left in range(60, 0, -1):
        known += 10
        g = pace(known, left, least=41)
        assert g == 0 or g >= 41 or left <= 3
        known -= g
        pieces.append(g)
    assert known == 0 and sum(1 for g in pieces if g) <= 60 // 4 + 3
    assert pace(30, 40, least=41) == 0 and pace(45, 40, least=41) == 41 and pace(4000, 40, least=41) == 115


def test_cost_counts_attended_keys_and_fits_is_the_most_that_a_spend_buys():
    assert fixed_cost(64, 32, 128) == 288 and fixed_cost(3584, 512, 18944) == 32512
    rng = random.Random(3)
    for _ in range(500):
        lo, n, fixed = rng.randint(0, 7000), rng.randint(0, 400), rng.choice([0, 288, 32512])
        assert cost(lo, lo + n, fixed) == sum(fixed + p + 1 for p in range(lo, lo + n))
        spend = rng.uniform(0, 3e6)
        m = fits(lo, spend, fixed)
        assert cost(lo, lo + m, fixed) <= spend < cost(lo, lo + m + 1, fixed)
    assert cost(6000, 6040, 288) > 8 * cost(0, 40, 288)  # the same length, late in a slide


def paced_by_cost(fixed: int | None, sessions: int = 4) -> tuple[list[int], list[int], int]:
    """Aligned slides of the 8192 profile (sink 37) from one switch to the next, their grants
    summed per step: (cost per step, positions per step, budget in cost)."""
    policy = SlidePolicy.build(8192, None, None, None, 37, 2048, sessions)
    policy = dataclasses.replace(policy, fixed=fixed)
    price = fixed if fixed is not None else fixed_cost(64, 32, 128)  # what the cost is measured in
    job = SlideJob(policy.plan(37, 37, policy.window), [0] * 37)
    staged, decided, costs, positions = [0] * sessions, policy.window, [], []
    while decided < job.plan.swap_at:
        decided += 10
        claims = [Claim(i, job.steps_left(decided), job.target(decided, decided - 1) - staged[i], staged[i],
                        37 + job.plan.kept) for i in range(sessions)]
        grants = share(claims, policy.budget, least=policy.rate) if fixed is None else \
            share(claims, policy.budget_cost, least=policy.rate, fixed=fixed)
        costs.append(sum(cost(s, s + g, price) for s, g in zip(staged, grants)))
        positions.append(sum(grants))
        staged = [s + g for s, g in zip(staged, grants)]
    assert staged == [job.target(decided, decided - 1)] * sessions  # caught up at the slide point: on time
    return costs, positions, int(policy.budget_cost)


def test_pacing_by_cost_levels_a_slide_and_lowers_its_dearest_step():
    """Four aligned slides: paced by positions, a step late in the slide (pieces attending to ~6500
    keys) costs about six times one at its start; paced by cost, early pieces are longer (much of
    the backlog is known at the start), late ones shorter, the cost per step level within a third
    (the last steps only keep up with the live slot) and the dearest step about 40 % cheaper. With
    the full-size model's fixed cost (a position's own cost dwarfs its keys) the pace stays close
    to the positions' one."""
    tiny = fixed_cost(64, 32, 128)
    by_positions, positions, _ = paced_by_cost(None)
    by_cost, levelled_positions, budget = paced_by_cost(tiny)
    assert max(by_positions[-20:]) > 5 * by_positions[1]
    assert max(by_cost) <= 0.7 * max(by_positions) and max(by_cost) <= budget
    assert max(by_cost) <= 1.35 * min(by_cost[1:-4])  # the last steps: only the ten new positions
    assert levelled_positions[1] > 2 * positions[1] and max(levelled_positions[-40:]) < max(positions[-40:])
    full = fixed_cost(3584, 512, 18944)
    _, full_positions, _ = paced_by_cost(full)
    assert max(full_positions[2:]) <= 1.3 * max(positions)
    # one claim alone: no grant beyond what is known, all of it once within the reserve
    claim = Claim(0, 50, 300, 1000, 6537)
    assert 0 < levelled(claim, tiny) <= 300 and levelled(Claim(0, 2, 300, 1000, 6537), tiny) == 300


def test_share_goes_to_the_nearest_slide_point_first_within_the_budget():
    claims = [Claim(slot=0, steps_left=40, known=3000), Claim(slot=1, steps_left=3, known=90),
              Claim(slot=2, steps_left=-1, known=25), Claim(slot=3, steps_left=40, known=3000)]
    grants = share(claims, 100)
    assert sum(grants) == 100
    assert grants[2] == 25 and grants[1] == 75 and grants[0] == grants[3] == 0  # late, then nearest
    assert share(claims, 10_000) == [pace(c.known, c.steps_left) for c in claims]  # enough: each its pace
    rng = random.Random(0)
    for _ in range(500):
        cs = [Claim(i, rng.randint(-2, 200), rng.randint(0, 7000)) for i in range(rng.randint(1, 9))]
        budget = rng.randint(10, 900)
        g = share(cs, budget)
        assert sum(g) <= budget and all(0 <= x <= c.known for x, c in zip(g, cs))
        # earliest deadline first: a claim gets less than its pace only if every later one gets nothing
        for i, c in enumerate(cs):
            if g[i] < pace(c.known, c.steps_left):
                assert all(g[j] == 0 for j, d in enumerate(cs) if (d.steps_left, d.slot) > (c.steps_left, c.slot))


def test_batches_pad_only_within_the_spare_budget():
    same = [(100, 141), (200, 241), (300, 341)]
    assert batches(same, 0, float("inf")) == [[0, 1, 2]]  # aligned slides: one forward, no padding
    uneven = [(5000, 5041), (5000, 5030)]
    assert batches(uneven, 0, float("inf")) == [[1], [0]]  # padding 11 positions does not fit 0
    assert batches(uneven, 11, float("inf")) == [[1, 0]]
    far = [(0, 40), (6000, 6040)]
    assert batches(far, 1000, 1.25) == [[0], [1]]  # a CPU does not read 6000 keys for the near one
    assert batches(far, 1000, float("inf")) == [[0, 1]]  # a GPU does (a forward's fixed cost dominates)
    rng = random.Random(1)
    for _ in range(500):
        pieces = []
        for _ in range(rng.randint(1, 8)):
            lo = rng.randint(0, 6000)
            pieces.append((lo, lo + rng.randint(1, 120)))
        spare = rng.randint(0, 300)
        groups = batches(pieces, spare, rng.choice([1.25, float("inf")]))
        assert sorted(i for g in groups for i in g) == list(range(len(pieces)))
        computed = sum(padded([pieces[i] for i in g]) for g in groups)
        assert computed <= sum(hi - lo for lo, hi in pieces) + spare


def simulate(policy: SlidePolicy, prefixes: list[int], opened: list[int], slides: int, seed: int) -> dict:
    """The runner's slide bookkeeping without a model: each slot decides 10 positions a step, may
    have its pending position rewritten (a cancel), and slides when its staging row is ready."""
    rng = random.Random(seed)
    n = len(prefixes)
    decided: list[int | None] = [None] * n
    jobs: list[SlideJob | None] = [None] * n
    done, late, most, step = [0] * n, 0, 0, 0
    costs: list[int] = []
    while min(done) < slides:
        step += 1
        live = [i for i in range(n) if step >= opened[i]]
        for i in live:
            decided[i] = 10 if decided[i] is None else decided[i] + 10
            assert decided[i] <= policy.last_switch(prefixes[i]), f"slot {i} reached its end at step {step}"
            if jobs[i] is None:
                jobs[i] = SlideJob(policy.plan(prefixes[i], prefixes[i], decided[i]), [0] * prefixes[i])
            elif rng.random() < 0.1:
                jobs[i].rewind(decided[i] - 1)
        claims = [Claim(i, jobs[i].steps_left(decided[i]), jobs[i].target(decided[i], decided[i] - 1) - jobs[i].staged,
                        jobs[i].staged, prefixes[i] + jobs[i].plan.kept) for i in live]
        if policy.fixed is None:
            grants = share(claims, policy.budget, least=policy.rate)
            most = max(most, sum(grants))
        else:
            grants = share(claims, policy.budget_cost, least=policy.rate, fixed=policy.fixed)
            most = max(most, sum(cost(c.staged, c.staged + g, policy.fixed) for c, g in zip(claims, grants)))
            costs.append(sum(cost(c.staged, c.staged + g, policy.fixed) for c, g in zip(claims, grants)))
        for i, g in zip(live, grants):
            jobs[i].staged += g
            if jobs[i].ready(decided[i], decided[i] - 1):
                late += decided[i] > jobs[i].plan.swap_at
                decided[i] -= jobs[i].plan.shift
                jobs[i] = None
                done[i] += 1
    return {"late": late, "most": most, "costs": costs}


# A position's fixed cost: none (positions only), the tiny checkpoints', the full-size model's.
FIXED = [None, fixed_cost(64, 32, 128), fixed_cost(3584, 512, 18944)]


@pytest.mark.parametrize("fixed", FIXED, ids=str)
@pytest.mark.parametrize("geometry", [(8192, None, None), (8192, 6000, 1500), (1024, None, None), (256, 100, 60),
                                      (2048, 100, 1500)], ids=str)
def test_the_derived_budget_keeps_every_slide_on_time(geometry, fixed):
    """Aligned (sessions opened together: every slide in the same steps), staggered and random
    phases, up to 16 sessions with different system prompts, cancels rewriting staged positions:
    no slide is late, no slot reaches its end, no step goes over the budget (in positions, or in
    cost when paced by cost). The budget is tight: a tenth less than the least accepted value makes
    the profile geometry's slides miss."""
    max_seq, window, step = geometry
    for sessions in (1, 2, 4, 16):
        prefixes = [10 + 9 * (i % 3) for i in range(sessions)]
        policy = SlidePolicy.build(max_seq, window, step, None, min(prefixes), max(max(prefixes), max_seq // 4),
                                   sessions)
        policy = dataclasses.replace(policy, fixed=fixed)
        rng = random.Random(sessions)
        for opened in ([0] * sessions, [5 * i for i in range(sessions)], [rng.randrange(200) for _ in range(sessions)]):
            out = simulate(policy, prefixes, opened, slides=3, seed=sessions)
            assert out["late"] == 0
            assert out["most"] <= (policy.budget if fixed is None else policy.budget_cost)
    if geometry == (8192, None, None):
        # by cost: a tenth less than sixteen slides' mean cost per step (their keys, half the context)
        mean = 1 if fixed is None else (fixed + policy.context / 2) / (fixed + policy.context)
        tight = dataclasses.replace(policy, budget=int(0.9 * policy.rate * 16 * mean))
        with pytest.raises(AssertionError, match="reached its end"):
            simulate(tight, prefixes, [0] * 16, slides=3, seed=0)


def test_context_sizes_follow_max_seq_unless_set():
    b = SlidePolicy.build
    p = b(8192, None, None, None, prefix_len=10, max_prefix=2048, sessions=4)
    assert (p.step, p.window, p.rate, p.budget) == (1630, 6530, 41, 205)  # 1.25 x 4 x ceil(6541 / 161)
    assert (b(1024, None, None, None, 37, 256).step, b(1024, None, None, None, 37, 256).window) == (200, 760)
    assert (b(1024, 600, None, None, 37, 256).step, b(1024, 600, None, None, 37, 256).window) == (200, 600)
    assert b(1024, 900, None, None, 37, 256).step == 60  # an explicit window takes the step's room
    assert b(1024, None, 300, None, 37, 256).window == 660
    assert b(8192, 0, None, None, 10, 2048).enabled is False
    errors = [((1024, 960, None, None), "context_window"), ((1024, None, 990, None), "context_slide_step"),
              ((1024, 800, 200, None), "context_window"), ((1024, 105, None, None), "context_window"),
              ((8192, None, None, 150), "context_prefill_budget")]
    for args, key in errors:
        with pytest.raises(ContextSettingsError, match=key):
            b(*args, prefix_len=37, max_prefix=256, sessions=4)
    assert b(8192, None, None, 164, 10, 2048, sessions=4).budget == 164  # the least accepted: 4 x 41


def test_every_profile_follows_a_lower_max_seq(ckpt):
    """An operator who lowers only ``max_seq`` in a shipped profile gets a working engine whose
    context sizes follow it (1024 positions: a fifth dropped per slide, the rest kept)."""
    for path in sorted((ROOT / "configs").glob("lychee-*.yaml")):
        profile = yaml.safe_load(path.read_text())
        lychee = dict(profile["engine"]["lychee"])
        lychee.update(model_root=str(ckpt), device="cpu", dtype="fp32", token2wav=None, progress=False,
                      torch_threads=1, max_seq=1024)
        sessions = profile["session"]["max_sessions"]
        backend = build_lychee_backend(lychee, sessions)
        context = backend.capabilities.context
        assert context is not None and context.mode == "sliding", path.name
        assert (context.slide_positions, context.window_positions, context.sink_positions) == (200, 760, 37)
        assert backend.runner.policy.budget == backend.runner.slide_stats.budget > 0
    with pytest.raises(SettingsError, match=r"engine\.lychee\.context_prefill_budget"):
        LycheeEngineSettings.from_mapping({**lychee, "context_prefill_budget": 5})


# ---------------------------------------------------------------------------------------------
# the runner


def windows(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(6400)).astype(np.float32) for _ in range(n)]


def assert_caches_are_a_fresh_forward(model, ref, tok, state, audio: list[np.ndarray]) -> None:
    """The slot's live caches right after its slide: those of a teacher-forced forward of ``ref``
    over exactly the kept context (prefix + kept tokens + their audio), every stack and layer."""
    first = state.dropped // 10
    wav = np.concatenate(audio[first:first + len(state.text) // 10])
    score_teacher_forced(ref, tok, state.prefix_ids, state.text, state.stoken, state.control, wav)
    m = state.prefix_len + state.fed
    for live, fresh in zip(model.caches(), ref.caches()):
        torch.testing.assert_close(live.k_cache[state.index, :, :m], fresh.k_cache[0, :, :m], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(live.v_cache[state.index, :, :m], fresh.v_cache[0, :, :m], atol=1e-4, rtol=1e-4)


def test_slots_sliding_together_stay_within_the_budget_batched_on_time_and_exact(ckpt):
    """Four slots, three opened together (their slides fall in the same steps) and one two windows
    later, one of them under its own system prompt (a longer sink, so pieces of different lengths):
    no step re-prefills (or computes, padding included) more than the budget, the pieces of the
    aligned slots run as one forward, every slide takes effect at its point, and each slot's caches
    right after each slide are a fresh forward's over the kept tokens."""
    model, ref = load_model(ckpt, dtype="fp32", progress=False), load_model(ckpt, dtype="fp32", progress=False)
    tok = Tokenizer.from_dir(ckpt)
    r = LycheeRunner(model, tok, 4, RunnerSettings(**SMALL, max_speech_tokens=25, seed=2))
    stats = r.slide_stats
    assert stats.budget == r.policy.budget == 205  # 1.25 x 4 x ceil(164 / 4)
    audio = {i: windows(60, 20 + i) for i in range(4)}
    for i in range(3):
        r.open(i, SessionOptions(seed=i, instructions="Answer in one short sentence, please." if i == 2 else None))
    assert r.slots[2].prefix_len > r.slots[0].prefix_len
    batched = checked = several = 0
    for k in range(60):
        if k == 2:
            r.open(3, SessionOptions(seed=3))
        items = []
        for i, s in enumerate(r.slots):
            if s is None:
                continue
            if k % 7 == i and s.mode is Mode.LISTENING:
                r.apply_controls(i, [Control(ControlKind.COMMIT, s.epoch)])
            items.append((i, audio[i][s.window + s.dropped // 10], s.epoch))
        slides0 = [s.context_slides if s else 0 for s in r.slots]
        r.step(items)
        assert stats.positions <= stats.computed and stats.cost <= stats.budget_cost
        batched += stats.pieces - stats.forwards >= 2  # three slots (or more) in one forward
        several += stats.pieces >= 3
        for i, s in enumerate(r.slots):
            if s is not None and s.context_slides > slides0[i]:
                assert len(s.text) == r.policy.kept(s.prefix_len, s.prefix_len)  # on time: exactly the window
                assert_caches_are_a_fresh_forward(model, ref, r.tok, s, audio[i])
                checked += 1
    assert stats.late == 0 and stats.fallbacks == 0 and all(s.context_resets == 0 for s in r.slots)
    assert all(s.context_slides >= 5 for s in r.slots) and checked == stats.slides >= 20
    # the aligned slots' pieces share a forward (paced by cost, pieces of slots whose sinks differ
    # differ in length, and a CPU runs them apart when padding would cost too much)
    assert batched >= 0.75 * several >= 25, (batched, several)
    assert 0 < stats.most_computed <= stats.budget


def test_a_binding_budget_still_slides_every_slot_on_time(ckpt):
    """A budget just above what four aligned slides need on average: many steps use all of it, the
    nearest slide first, and still no slide is late."""
    model = load_model(ckpt, dtype="fp32", progress=False)
    tok = Tokenizer.from_dir(ckpt)
    r = LycheeRunner(model, tok, 4, RunnerSettings(**SMALL, seed=1))
    r.policy = dataclasses.replace(r.policy, budget=100)  # below the validated least (164), above the need
    wins = windows(8, 3)
    for i in range(4):
        r.open(i, SessionOptions(seed=i))
    full = 0
    dearest = r.policy.fixed + r.policy.context  # a position at the largest context
    for k in range(50):
        r.step([(i, wins[(k + i) % 8], 0) for i in range(4)])
        st = r.slide_stats
        assert st.cost <= st.budget_cost == 100 * dearest
        full += st.cost > st.budget_cost - dearest  # not one more position at the largest context fits
    assert full >= 3 and r.slide_stats.late == 0 and r.slide_stats.slides >= 20
    assert all(s.context_resets == 0 for s in r.slots)


def test_a_slide_that_cannot_keep_up_is_late_then_falls_back_counted_and_no_window_is_lost(ckpt):
    """A budget far too small (not a valid setting; forced here): slides take effect late while the
    slot has room (counted), and a slot that reaches its end before its staging row is ready takes
    the last resort (a context reset, counted); every window still gets its result and the session
    goes on."""
    model = load_model(ckpt, dtype="fp32", progress=False)
    tok = Tokenizer.from_dir(ckpt)
    r = LycheeRunner(model, tok, 1, RunnerSettings(max_seq=256, context_window=60, context_slide_step=60, seed=1))
    r.open(0, SessionOptions(seed=1))
    s = r.slots[0]
    # The budget in cost is this many positions at the largest context (124 keys): 12 a step against
    # the 13 that a whole re-prefill (97 positions, 37 of them the sink) needs on average within its
    # 6 steps (the least accepted budget, for any system prompt, is 31): each slide falls behind.
    r.policy = dataclasses.replace(r.policy, budget=12)
    wins = windows(8, 4)
    events = []
    for k in range(80):
        heard, resets = (s.dropped + len(s.text)) // 10, s.context_resets
        events += r.step([(0, wins[k % 8], s.epoch)])[0].events
        # one window further (wherever a slide moved its positions), or the first after a reset
        assert (s.dropped + len(s.text)) // 10 == (1 if s.context_resets > resets else heard + 1)
    st = r.slide_stats
    assert st.late >= 1 and st.fallbacks >= 1 and st.fallbacks == s.context_resets
    assert sum(isinstance(e, EngineError) and e.code == "context_reset" for e in events) == st.fallbacks
    assert st.slides == s.context_slides >= 1
    # Given its budget back, the slot slides on time again.
    r.policy = dataclasses.replace(r.policy, budget=SlidePolicy.build(256, 60, 60, None, 37, 64).budget)
    late, resets = st.late, s.context_resets
    for k in range(40):
        r.step([(0, wins[k % 8], s.epoch)])
    assert st.slides > late and s.context_resets == resets


def test_the_budget_never_changes_what_a_slot_decides(ckpt):
    """Slides never change what a slot decides between them: two runners, derived and binding
    budgets, give the same tokens (staging touches only the staging rows)."""
    tok = Tokenizer.from_dir(ckpt)
    streams = []
    for budget in (None, 100):
        model = load_model(ckpt, dtype="fp32", progress=False)
        r = LycheeRunner(model, tok, 2, RunnerSettings(**SMALL, temperature=0.0, seed=1))
        if budget:
            r.policy = dataclasses.replace(r.policy, budget=budget)
        wins = windows(30, 8)
        for i in range(2):
            r.open(i, SessionOptions(seed=i))
        r.apply_controls(0, [Control(ControlKind.COMMIT, 0)])
        for k in range(30):
            r.step([(0, wins[k], 0), (1, wins[29 - k], 0)])
        streams.append([(x.text, x.stoken, x.control, x.context_slides) for x in r.slots[:2]])
    assert streams[0] == streams[1] and all(st[3] >= 3 for st in streams[0])
