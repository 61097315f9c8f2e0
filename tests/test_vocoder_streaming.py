"""Streaming Token2Wav on a tiny checkpoint: sizes per call, final flush, fencing, batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lychee_rtc.engine.base import AudioChunk, EngineError, ResponseDone
from lychee_rtc.engine.lychee.token2wav_stream import EpochFence, StreamRules, VocoderStream, synthesize_hops, to_pcm16
from lychee_rtc.vocoder.token2wav import Token2Wav, write_test_prompt, write_tiny_token2wav


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("t2w")
    return Token2Wav.load(write_tiny_token2wav(root / "token2wav", seed=5))


@pytest.fixture(scope="module")
def voices(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    a = model.prepare_voice("a", write_test_prompt(root / "a.wav", seconds=1.0, seed=1))
    b = model.prepare_voice("b", write_test_prompt(root / "b.wav", seconds=1.64, sample_rate=16000, seed=2))
    return a, b


def codes(n, seed=0):
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(stream, all_codes, packet=7):
    out = []
    for seq, i in enumerate(range(0, len(all_codes), packet)):
        out += stream.push(all_codes[i:i + packet], stream.epoch, stream.response_id, seq)
    return out


def test_sizes_per_call(model, voices):
    s = VocoderStream(model, voices[0], 0, "r", seed=1)
    assert run(s, codes(13), packet=13) == []  # exactly 13 pending: a hop waits for more
    out = s.push(codes(1, 1), 0, "r", 1)
    assert [e.pcm.size for e in out] == [5760]  # 14 codes pending -> first hop, 240 ms
    assert s.pending == 4
    out = s.push(codes(9, 2), 0, "r", 2)
    assert out == [] and s.pending == 13
    out = s.push(codes(1, 3), 0, "r", 3)
    assert [e.pcm.size for e in out] == [9600]  # then 400 ms per hop
    assert s.pending == 4
    out = s.push(codes(2, 4), 0, "r", 4) + s.finish()
    assert [e.pcm.size for e in out] == [3840 + 960 * 6]  # natural final: tail + 40 ms per code
    assert all(isinstance(e, AudioChunk) and e.pcm.dtype == np.float32 for e in out)
    assert s.state == "finished" and s.stats.samples == 960 * 26


def reference_schedule(n: int, hop: int = 10, lookahead: int = 3, strict: bool = True) -> list[tuple[int, int, bool]]:
    """(start, stop, last) of every flow call for n codes, as the reference application drives
    Token2Wav: a hop while *more than* hop + look-ahead codes wait (``strict``; ``False`` is the
    ``>=`` variant), then one final call with everything left."""
    calls, start = [], 0
    while (n - start > hop + lookahead) if strict else (n - start >= hop + lookahead):
        calls.append((start, start + hop + lookahead, False))
        start += hop
    calls.append((start, n, True))
    return calls


def seeded_noise():
    """HiFT noise that depends only on the call's index, so two drivers get the same draws."""
    counter = iter(range(1000, 100_000))
    return lambda shape: torch.randn(shape, generator=torch.Generator().manual_seed(next(counter)))


def reference_audio(model, voice, all_codes, schedule, noise):
    """The flow and HiFT driven call by call along ``schedule``, with the reference's HiFT overlap
    written out here (8 mel frames re-vocoded, excitation carried, Hamming cross-fade of 3840
    samples, 3840 held back until the final call). Returns (PCM, mel of every call joined)."""
    state = model.prime(voice)
    n = model.overlap_samples
    w = model.crossfade_window
    mel_cache = torch.zeros(1, model.config.output_size, 0)
    source = torch.zeros(1, 1, 0)
    held = torch.zeros(1, 0)
    pcm, mels = [], []
    with torch.inference_mode():
        for start, stop, last in schedule:
            mel, (state,) = model.flow.chunk([state], torch.tensor([all_codes[start:stop]]), last)
            mels.append(mel.float())
            mel_in = torch.cat([mel_cache, mel.float()], dim=2)
            speech, excitation = model.hift(mel_in, source, noise=noise(model.hift.noise_shape(1, mel_in.shape[2])))
            speech = speech.clone()
            if held.shape[1]:
                speech[:, :n] = speech[:, :n] * w[:n] + held * w[n:]
            mel_cache, source, held = mel_in[:, :, -8:], excitation[:, :, -n:], speech[:, -n:]
            pcm.append(speech if last else speech[:, :-n])
    return torch.cat(pcm, dim=1)[0].numpy(), torch.cat(mels, dim=2)[0]


@pytest.mark.parametrize("n, first_diff_frame", [(13, 0), (83, 140)])
@pytest.mark.parametrize("packet", [1, 7, 10])
def test_hop_rule_matches_the_reference_schedule(model, voices, n, first_diff_frame, packet):
    """n = 3 more than a multiple of 10 is where "more than 13 pending" and "13 pending" part:
    the reference renders the last 13 codes in one final call, not as a hop plus a 3-code final."""
    c = codes(n, 20 + n)
    ref_pcm, ref_mel = reference_audio(model, voices[0], c, reference_schedule(n), seeded_noise())
    s = VocoderStream(model, voices[0], 0, "r", seed=1)
    s.noise_override = seeded_noise()
    out = run(s, c, packet=packet) + s.finish()
    hops = (n - 4) // 10  # hop k needs code 10k + 13, i.e. more than 13 pending
    assert [e.pcm.size for e in out] == ([5760] + [9600] * (hops - 1) + [3840 + 960 * 13] if hops else [960 * n])
    np.testing.assert_array_equal(np.concatenate([e.pcm for e in out]), ref_pcm)
    # The test can tell the rules apart: the ">=" schedule gives other mel from this frame on.
    _, ge_mel = reference_audio(model, voices[0], c, reference_schedule(n, strict=False), seeded_noise())
    assert ge_mel.shape == ref_mel.shape == (model.config.output_size, 2 * n)
    differs = (ge_mel - ref_mel).abs().amax(dim=0) > 1e-4
    assert int(differs.nonzero()[0]) == first_diff_frame
    assert not differs[:first_diff_frame].any()


def test_total_samples_and_chunk_tags(model, voices):
    s = VocoderStream(model, voices[1], 4, "resp-9", seed=2)
    out = run(s, codes(57)) + s.finish()
    assert sum(e.pcm.size for e in out) == 960 * 57
    assert [e.seq for e in out] == list(range(len(out)))
    assert {(e.epoch, e.response_id) for e in out} == {(4, "resp-9")}
    assert all(np.isfinite(e.pcm).all() and np.abs(e.pcm).max() <= 1.0 for e in out)


def test_short_response_and_empty_final(model, voices):
    s = VocoderStream(model, voices[0], 0, "r", seed=1)
    assert s.push(codes(5), 0, "r", 0) == []
    assert [e.pcm.size for e in s.finish()] == [960 * 5]  # never emitted before: all of it
    s = VocoderStream(model, voices[0], 0, "r", seed=1)
    assert s.finish() == []  # nothing received, nothing to flush


def test_final_with_nothing_pending_flushes_held_tail(model, voices):
    rules = StreamRules(hop=10)
    s = VocoderStream(model, voices[0], 0, "r", rules=rules, seed=1)
    s.push(codes(14), 0, "r", 0)
    s._pending.clear()  # as if the look-ahead codes had been consumed (flush_tail case)
    out = s.finish()
    assert [e.pcm.size for e in out] == [3840]


def test_stale_and_duplicate_packets_are_dropped(model, voices):
    s = VocoderStream(model, voices[0], 2, "r2", seed=1)
    assert s.push(codes(20), 1, "r1", 0) == []  # older epoch
    assert s.push(codes(20), 2, "other", 0) == []  # other response
    assert s.pending == 0 and s.stats.stale_dropped == 2
    s.push(codes(5), 2, "r2", 0)
    assert s.push(codes(5), 2, "r2", 0) == [] and s.stats.duplicate_dropped == 1
    assert s.pending == 5


def test_sequence_gap_fails_only_that_response(model, voices):
    a = VocoderStream(model, voices[0], 0, "ra", seed=1)
    b = VocoderStream(model, voices[1], 0, "rb", seed=1)
    a.push(codes(5), 0, "ra", 0)
    b.push(codes(5), 0, "rb", 0)
    out = a.push(codes(5), 0, "ra", 2)
    assert isinstance(out[0], EngineError) and out[0].code == "vocoder_sequence_gap"
    assert isinstance(out[1], ResponseDone) and out[1].status == "failed" and out[1].response_id == "ra"
    assert a.state == "failed" and a.push(codes(20), 0, "ra", 3) == []
    out = b.push(codes(10), 0, "rb", 1)
    assert [e.pcm.size for e in out] == [5760]  # 15 codes: more than 13


def test_out_of_range_code_fails(model, voices):
    s = VocoderStream(model, voices[0], 0, "r", seed=1)
    out = s.push([1, 2, 6561], 0, "r", 0)
    assert out[0].code == "vocoder_invalid_code" and s.state == "failed"
    s = VocoderStream(model, voices[0], 0, "r", seed=1)
    assert s.push([-1], 0, "r", 0)[0].code == "vocoder_invalid_code"


def test_cancel_emits_nothing(model, voices):
    s = VocoderStream(model, voices[0], 0, "r", seed=1)
    s.push(codes(20), 0, "r", 0)
    s.cancel()
    assert s.state == "cancelled"
    assert s.finish() == [] and s.push(codes(20), 0, "r", 1) == []


def test_fence_drops_output_after_interrupt(model, voices):
    fence = EpochFence(0)
    s = VocoderStream(model, voices[0], 0, "r", fence=fence, seed=1)
    s.feed(codes(14), 0, "r", 0)
    fence.advance(1)  # the session was interrupted while the hop was queued
    assert synthesize_hops([s]) == [[]]
    assert s.state == "cancelled" and s.stats.fenced_dropped == 1


def test_long_stream_policy_error(model, voices):
    rules = StreamRules(position_limit_tokens=voices[0].features.n_tokens + 25, long_stream="error")
    s = VocoderStream(model, voices[0], 0, "r", rules=rules, seed=1)
    out = s.push(codes(14), 0, "r", 0)
    assert [e.pcm.size for e in out] == [5760]
    out = s.push(codes(20), 0, "r", 1)
    assert [type(e).__name__ for e in out] == ["AudioChunk", "EngineError", "ResponseDone"]
    assert out[1].code == "vocoder_stream_too_long"


def test_long_stream_extend_is_consistent(model, voices):
    """With "extend" the position table is the sinusoid formula, unbounded: no error."""
    s = VocoderStream(model, voices[0], 0, "r", rules=StreamRules(position_limit_tokens=10), seed=1)
    out = run(s, codes(30)) + s.finish()
    assert sum(e.pcm.size for e in out) == 960 * 30


def test_batched_equals_separate(model, voices):
    """Two streams with different prompt lengths (padded, masked caches) in one batch give the
    same audio as each stream alone."""
    streams_codes = [codes(43, 10), codes(43, 11)]

    def make():
        return [VocoderStream(model, voices[i], 0, f"r{i}", seed=100 + i) for i in range(2)]

    alone = []
    for s, c in zip(make(), streams_codes):
        alone.append(np.concatenate([e.pcm for e in run(s, c, packet=10) + s.finish()]))
    together = make()
    out = [[], []]
    for seq, i in enumerate(range(0, 43, 10)):
        for s, c in zip(together, streams_codes):
            s.feed(c[i:i + 10], 0, s.response_id, seq)
        for k, ev in enumerate(synthesize_hops(together)):
            out[k] += ev
    for s in together:
        s.state = "finishing"
    for k, ev in enumerate(synthesize_hops(together)):
        out[k] += ev
    for k in range(2):
        got = np.concatenate([e.pcm for e in out[k]])
        assert got.shape == alone[k].shape
        np.testing.assert_allclose(got, alone[k], atol=2e-5)
    assert together[0].stats.hops == 4  # 3 hops + one final carrying the last 13 codes


def test_streams_do_not_share_state(model, voices):
    """A stream's output does not depend on another stream running beside it."""
    c = codes(30, 3)
    s1 = VocoderStream(model, voices[0], 0, "x", seed=7)
    ref = np.concatenate([e.pcm for e in run(s1, c) + s1.finish()])
    s2 = VocoderStream(model, voices[0], 0, "y", seed=7)
    noise = VocoderStream(model, voices[1], 0, "z", seed=8)
    out = []
    for seq, i in enumerate(range(0, 30, 7)):
        out += s2.push(c[i:i + 7], 0, "y", seq)
        noise.push(codes(7, 50 + seq), 0, "z", seq)
    out += s2.finish()
    np.testing.assert_array_equal(np.concatenate([e.pcm for e in out]), ref)


def test_to_pcm16_truncates_like_the_reference():
    x = np.array([-1.5, -0.50001, 0.0, 0.49999, 1.2], dtype=np.float32)
    assert to_pcm16(x).tolist() == [-32767, -16383, 0, 16383, 32767]


def test_offline_synthesis_length(model, voices):
    wav = model.synthesize(codes(12), voices[0], generator=torch.Generator().manual_seed(0))
    assert wav.shape == (12 * 960,) and np.isfinite(wav).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_flow_streams(tmp_path, dtype):
    model = Token2Wav.load(write_tiny_token2wav(tmp_path / "token2wav", seed=5), dtype=dtype)
    voice = model.prepare_voice("a", write_test_prompt(tmp_path / "a.wav", seconds=1.0, seed=1))
    s = VocoderStream(model, voice, 0, "r", seed=1)
    out = run(s, codes(30)) + s.finish()
    assert [e.pcm.size for e in out][:2] == [5760, 9600] and sum(e.pcm.size for e in out) == 960 * 30
    assert all(e.pcm.dtype == np.float32 and np.isfinite(e.pcm).all() for e in out)
