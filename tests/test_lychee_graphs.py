"""Static batch buckets and the CUDA-graph switch of the Lychee-FD runner.

Everything but capture/replay runs here on CPU through the same code the graphs record: padding
to a bucket, the scratch row, the fixed input buffers, one host transfer per step. The check that
replayed graphs give the eager tokens needs CUDA and is skipped without it.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest
import torch
from torch import Tensor

from lychee_rtc.engine.base import Control, ControlKind, SessionOptions
from lychee_rtc.engine.lychee.backend import LycheeEngineSettings, SettingsError
from lychee_rtc.engine.lychee.checkpoint import load_model
from lychee_rtc.engine.lychee.graphs import (
    BatchRows,
    batch_rows,
    bucket_for,
    bucket_sizes,
    fetch,
    gathered_rows,
    use_cuda_graphs,
    window_starts,
)
from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings
from lychee_rtc.engine.lychee.slot import Mode
from lychee_rtc.engine.lychee.scoring import score_teacher_forced
from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint
from lychee_rtc.engine.lychee.tokenizer import Tokenizer
from strict import CUDA_REASON_PREFIX

GREEDY = dict(temperature=0.0, no_repeat_ngram=0, start_speak_factor=1.0, start_listen_factor=1.0,
              max_speech_tokens=10**6)
COMMIT = [Control(ControlKind.COMMIT, 0)]


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Decisions biased to "keep": once started, a response goes on for the whole test.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lychee-graphs") / "tiny", seed=3,
                                 spec=TinySpec(decision_bias=4.0))


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def windows(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(6400)).astype(np.float32) for _ in range(n)]


def drive(r: LycheeRunner, plan: dict[int, tuple[int, int]], n: int, speak: set[int], seed: int = 0):
    """Step window by window; slot s takes part in windows [first, last) of ``plan[s]``, is opened
    at its first window (committing when in ``speak``) and closed after its last."""
    wins = {s: windows(n, seed + s) for s in plan}
    tokens: dict[int, tuple] = {}
    for k in range(n):
        for s, (first, last) in plan.items():
            if k == first:
                r.open(s, SessionOptions(seed=11 + s))
                if s in speak:
                    r.apply_controls(s, COMMIT)
            if k == last:
                st = r.slots[s]
                tokens[s] = (list(st.text), list(st.stoken), list(st.control))
                r.close(s)
        live = [s for s, (first, last) in plan.items() if first <= k < last]
        if live:
            r.step([(s, wins[s][k], 0) for s in live])
    for s in plan:
        if r.slots[s] is not None:
            st = r.slots[s]
            tokens[s] = (list(st.text), list(st.stoken), list(st.control))
    return tokens


def test_bucket_sizes_and_selection():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(4) == (1, 2, 4)
    assert bucket_sizes(5) == (1, 2, 4, 5)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(16) == (1, 2, 4, 8, 16)
    assert [bucket_for(n, bucket_sizes(8)) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="does not fit"):
        bucket_for(9, bucket_sizes(8))
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_batches_read_their_rows_in_place_where_a_window_allows():
    b4 = bucket_sizes(4)
    assert batch_rows([0, 1, 2], b4, busy={0, 1, 2}, scratch=4) == BatchRows((0, 1, 2, 3), (0, 1, 2), 0)
    # Slot 3 is open: its row takes the padding only if it may (it is "spare"), else gather.
    assert batch_rows([0, 1, 2], b4, busy={0, 1, 2, 3}, scratch=4) == BatchRows((0, 1, 2, 4), (0, 1, 2), None)
    assert batch_rows([0, 1, 2], b4, busy={0, 1, 2, 3}, scratch=4, spare={3}) == BatchRows((0, 1, 2, 3), (0, 1, 2), 0)
    # A gap: three speaking slots 0, 1, 3 run as rows 0..3 in place, each in its own row.
    assert batch_rows([0, 1, 3], b4, busy={0, 1, 2, 3}, scratch=4, spare={2}) == BatchRows((0, 1, 2, 3), (0, 1, 3), 0)
    assert batch_rows([3, 0], b4, busy={0, 3}, scratch=4) == BatchRows((0, 1, 2, 3), (3, 0), 0)
    assert batch_rows([2], b4, busy={0, 1, 2, 3}, scratch=4) == BatchRows((2,), (0,), 2)
    assert batch_rows([2, 3], b4, busy={2, 3}, scratch=4) == BatchRows((2, 3), (0, 1), 2)
    assert batch_rows([0, 1], b4, busy={0, 1, 3}, scratch=4) == BatchRows((0, 1), (0, 1), 0)
    # No aligned window of two holds slots 1 and 2: the bucket of four does (its padding is free).
    assert batch_rows([1, 2], b4, busy={1, 2}, scratch=4) == BatchRows((0, 1, 2, 3), (1, 2), 0)
    assert batch_rows([1, 2], b4, busy={0, 1, 2}, scratch=4) == BatchRows((1, 2), (0, 1), None)
    # The scratch row may be the padding of a window; staging rows after it never are.
    assert window_starts(1, 4) == range(0, 5) and window_starts(2, 4) == range(0, 4, 2)
    assert list(window_starts(4, 4)) == [0] and list(window_starts(5, 5)) == [0]
    with pytest.raises(ValueError, match="twice"):
        batch_rows([1, 1], b4, busy={1}, scratch=4)


def test_padding_rows_never_touch_an_open_slot_that_is_not_spare():
    # Every group of open slots of a 4-slot runner, whichever open slots may lend their rows:
    # each real slot runs in its own row, padding uses free rows, the scratch row or spare rows.
    for n_open in range(1, 5):
        for busy in combinations(range(4), n_open):
            for n_spare in range(len(busy) + 1):
                for spare in combinations(busy, n_spare):
                    for n in range(1, n_open + 1):
                        for slots in combinations(busy, n):
                            rows = batch_rows(list(slots), bucket_sizes(4), set(busy), 4, set(spare))
                            assert tuple(rows.rows[r] for r in rows.real) == slots
                            assert rows.size in bucket_sizes(4) and rows.size >= n
                            padding = {rows.rows[r] for r in rows.padding()}
                            assert not padding & (set(busy) - set(spare) - set(slots))
                            if rows.contiguous:
                                assert rows.rows == tuple(range(rows.start, rows.start + rows.size))
                                assert rows.start % rows.size == 0 and rows.rows[-1] <= 4
                            else:
                                assert rows.size == bucket_for(n, bucket_sizes(4)) and padding <= {4}
                            if not set(busy) - set(spare) - set(slots):  # nothing in the way
                                assert rows.contiguous


def test_fetch_brings_ids_and_probabilities_back_exactly():
    ids = torch.tensor([[158362, 3], [0, 151695]])
    probs = torch.tensor([[0.1234567, 0.8765433]], dtype=torch.float32)
    got_ids, got_probs = fetch([ids, probs])
    assert got_ids == ids.tolist() and all(isinstance(v, int) for v in got_ids[0])
    assert got_probs == probs.tolist()


def test_three_sessions_in_bucket_four_match_teacher_forced_scoring(model, tok):
    """Greedy streams of three speaking sessions padded to a bucket of four are the model's
    own argmax at every freely decided position (the reference semantics, no runner code)."""
    r = LycheeRunner(model, tok, 4, RunnerSettings(max_seq=512, **GREEDY))
    slots = [0, 1, 3]  # row 2 is free: the batch is rows 0..3 read in place, row 2 the padding
    wins = {s: windows(8, 40 + s) for s in slots}
    for s in slots:
        r.open(s, SessionOptions())
        r.apply_controls(s, COMMIT)
    for k in range(8):
        r.step([(s, wins[s][k], 0) for s in slots])
    assert ("speak", 10, 4, 0) in r.programs and ("listen", 9, 4, 0) in r.programs
    st = r.tok
    for s in slots:
        state = r.slots[s]
        assert state.mode is Mode.SPEAKING
        out = score_teacher_forced(model, st, r.prefix_ids, state.text, state.stoken, state.control,
                                   np.concatenate(wins[s]))
        p, checked = r.prefix_len, 0
        for q in range(len(state.text) - 1):
            nt, ns = state.text[q + 1], state.stoken[q + 1]
            if nt not in (st.text_pad, st.tts_pad):
                assert out.text_logits[p + q].argmax().item() == nt, (s, q)
                checked += 1
            if st.audio_code_min <= ns < r.cfg.stoken_token_ids_max:
                logits = out.speech_logits[p + q].clone()
                mask = torch.ones_like(logits, dtype=torch.bool)
                mask[st.audio_code_min:r.cfg.stoken_token_ids_max] = False
                mask[st.tts_end] = False
                assert logits.masked_fill(mask, -1e30).argmax().item() == ns, (s, q)
                checked += 1
        assert checked > 20, s


class GatheringRunner(LycheeRunner):
    """The runner with its fallback layout everywhere: every batch's rows gathered."""

    def _batch_rows(self, slots):
        return gathered_rows(slots, self.buckets, self.scratch)


def test_padded_rows_do_not_change_real_rows(model, tok):
    """C3 in bucket 4 gives exactly the streams of a 3-slot runner (bucket 3, no padding), sampled
    speech included, whether the padding row is the free row 3, the top of an open slot's row 3,
    or the scratch row of a gathered batch."""
    settings = RunnerSettings(max_seq=512, max_speech_tokens=10**6)
    speakers = {s: (0, 7) for s in range(3)}
    exact = drive(LycheeRunner(model, tok, 3, settings), speakers, 7, speak={0, 1, 2})

    r = LycheeRunner(model, tok, 4, settings)
    assert drive(r, speakers, 7, speak={0, 1, 2}) == exact
    assert ("speak", 10, 4, 0) in r.programs  # padded into row 3, which no session owns

    alone = drive(LycheeRunner(model, tok, 4, settings), {3: (0, 7)}, 7, speak=set())
    for runner, layout in ((LycheeRunner, 0), (GatheringRunner, None)):
        r = runner(model, tok, 4, settings)
        mixed = drive(r, speakers | {3: (0, 7)}, 7, speak={0, 1, 2})  # slot 3 open and listening
        assert ("speak", 10, 4, layout) in r.programs
        assert {s: mixed[s] for s in range(3)} == exact
        assert mixed[3] == alone[3]  # the listening slot never saw the padding


def commit_at(r: LycheeRunner, commits: dict[int, int], n: int, seed: int):
    """All slots of ``commits`` open at window 0; slot s is sent ``COMMIT`` before window commits[s]."""
    wins = {s: windows(n, seed + s) for s in commits}
    for s in commits:
        r.open(s, SessionOptions(seed=11 + s))
    for k in range(n):
        for s, at in commits.items():
            if k == at:
                r.apply_controls(s, COMMIT)
        r.step([(s, wins[s][k], 0) for s in commits])
    return {s: (list(r.slots[s].text), list(r.slots[s].stoken), list(r.slots[s].control)) for s in commits}


def live_state(r: LycheeRunner, s: int) -> tuple[list[int], list[Tensor]]:
    """Slot s's speech history (the no-repeat rule's) and its cache rows up to its live length."""
    st = r.slots[s]
    n = st.prefix_len + st.fed
    return (r.rule_rows.history[s, :len(st.stoken)].tolist(),
            [c.k_cache[s, :, :n].clone() for c in r.model.caches()] + [c.v_cache[s, :, :n].clone()
                                                                          for c in r.model.caches()])


def test_a_batch_with_a_gap_reads_rows_in_place_and_matches_each_session_alone(model, tok):
    """Sessions 0, 1 and 3 speak while 2 listens (the common C4 window): the speaking batch runs in
    place as rows 0..3 with row 2 as padding (just past what the listener will have fed after
    the step, its rule state in the scratch row), the listener as row 2 alone. Then 2 speaks too,
    its no-repeat rule reading the speech history of the windows in which it lent its row. Every
    stream, sampled speech included, is the one each session makes on its own, and the one of a
    runner that gathers every batch instead."""
    settings = RunnerSettings(max_seq=512, max_speech_tokens=10**6)
    commits = {0: 0, 1: 0, 2: 8, 3: 0}
    r = LycheeRunner(model, tok, 4, settings)
    padded: list[tuple[int, int, int]] = []  # (padding's first position, listener's decided end, speakers' furthest)
    pad_positions = r._pad_positions

    def spy(rows, first, n):
        out = pad_positions(rows, first, n)
        if n == 10 and rows.padding() and rows.rows[rows.padding()[0]] == 2:
            listener = r.slots[2]
            padded.append((int(out[rows.padding()[0]]), listener.prefix_len + len(listener.text),
                           int(max(first[i] for i in rows.real))))
        return out

    r._pad_positions = spy
    mixed = commit_at(r, commits, 14, seed=60)
    # Row 2's padding writes past every position the listener feeds in that step (it lands at
    # the decided end plus a window), not at the top of the row: attention on a CPU reads keys
    # only up to the batch's furthest position, so a mixed window reads as few as an all-speaking one.
    assert len(padded) >= 6
    for at, decided, furthest in padded:
        assert at == decided + 10 and at + 10 <= furthest + 3 * 10 < settings.max_seq - 10, (at, decided, furthest)
    state = {s: live_state(r, s) for s in commits}
    assert ("speak", 10, 4, 0) in r.programs and ("listen", 10, 1, 2) in r.programs
    assert not any(key[3] is None for key in r.programs)  # nothing was gathered
    # 0, 1 and 3 spoke from the second window on, 2 from the tenth.
    speech = {s: [c != r.tok.stoken_pad for c in mixed[s][1]] for s in commits}
    assert not any(speech[2][:80]) and sum(speech[2][80:]) > 20, speech[2]
    assert all(sum(speech[s][10:80]) > 20 for s in (0, 1, 3))
    for s, at in commits.items():
        one = LycheeRunner(model, tok, 4, settings)
        alone = commit_at(one, {s: at}, 14, seed=60)
        assert mixed[s] == alone[s], s
        history, rows = live_state(one, s)  # the device state too, not only what it decided
        assert state[s][0] == history, s
        for got, want in zip(state[s][1], rows):  # batch shapes change float rounding, nothing more
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert commit_at(GatheringRunner(model, tok, 4, settings), commits, 14, seed=60) == mixed


def test_slots_joining_and_leaving_keep_every_stream_intact(model, tok):
    settings = RunnerSettings(max_seq=512, max_speech_tokens=10**6)
    # Slot 1 speaks throughout; 0 joins late, 2 leaves early and 3 joins in its place: the batch
    # moves between buckets 1, 2 and 4 and between windows of rows and their padding.
    plan = {1: (0, 9), 0: (3, 9), 2: (0, 4), 3: (5, 9)}
    r = LycheeRunner(model, tok, 4, settings)
    mixed = drive(r, plan, 9, speak={0, 1, 2, 3})
    for s, span in plan.items():
        alone = drive(LycheeRunner(model, tok, 4, settings), {s: span}, 9, speak={s})
        assert mixed[s] == alone[s], s
    assert len({key[2] for key in r.programs}) >= 2  # more than one bucket size was used


def test_graphs_are_selected_only_on_cuda(model, tok, ckpt):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert use_cuda_graphs("auto", cpu) is False
    assert use_cuda_graphs("auto", cuda) is True
    assert use_cuda_graphs("on", cuda) is True
    assert use_cuda_graphs("off", cuda) is False
    with pytest.raises(ValueError, match="needs a CUDA device"):
        use_cuda_graphs("on", cpu)
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        use_cuda_graphs("yes", cuda)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LycheeRunner(model, tok, 2, RunnerSettings(max_seq=512, cuda_graphs="on"))
    r = LycheeRunner(model, tok, 2, RunnerSettings(max_seq=512))  # auto on a CPU: eager
    assert not r.graphs_captured and not r.use_graphs
    drive(r, {0: (0, 3), 1: (0, 3)}, 3, speak={0})
    assert r.programs and not any(p.run.captured for p in r.programs.values())
    base = {"model_root": str(ckpt), "dtype": "fp32", "device": "cpu", "max_seq": 512}
    with pytest.raises(SettingsError, match=r"engine\.lychee\.cuda_graphs"):
        LycheeEngineSettings.from_mapping(base | {"cuda_graphs": "on"})
    with pytest.raises(SettingsError, match=r"engine\.lychee\.cuda_graphs"):
        LycheeEngineSettings.from_mapping(base | {"cuda_graphs": True})  # unquoted `on` in YAML, on a CPU
    with pytest.raises(SettingsError, match=r"engine\.lychee\.cuda_graphs"):
        LycheeEngineSettings.from_mapping(base | {"cuda_graphs": 1})
    assert LycheeEngineSettings.from_mapping(base | {"cuda_graphs": False}).cuda_graphs == "off"
    assert LycheeEngineSettings.from_mapping(base | {"cuda_graphs": "off"}).runner_settings().cuda_graphs == "off"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{CUDA_REASON_PREFIX}: graph capture and replay")
def test_replayed_graphs_give_the_eager_tokens(ckpt, tok):  # pragma: no cover - GPU only
    model = load_model(ckpt, dtype="fp32", device="cuda", progress=False)
    plan = {s: (0, 8) for s in (0, 1, 3)}
    eager = drive(LycheeRunner(model, tok, 4, RunnerSettings(max_seq=512, cuda_graphs="off", **GREEDY)),
                  plan, 8, speak={0, 1})
    r = LycheeRunner(model, tok, 4, RunnerSettings(max_seq=512, cuda_graphs="on", **GREEDY))
    assert r.graphs_captured and all(p.run.captured for p in r.programs.values())
    assert drive(r, plan, 8, speak={0, 1}) == eager
