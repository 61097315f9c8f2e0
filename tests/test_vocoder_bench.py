"""The vocoder benchmark runs (tiny, a couple of hops) and reports sane numbers."""

from lychee_rtc.bench.token2wav_bench import format_table, run_vocoder_bench


def test_vocoder_bench_tiny_cpu():
    results = run_vocoder_bench("tiny", "cpu", "fp32", (1, 2), rounds=2, prompt_seconds=1.0, sequential=True)
    assert [(r.concurrency, r.batched) for r in results] == [(1, True), (2, True), (2, False)]
    for r in results:
        assert r.hop_ms_mean > 0 and abs(r.rtf_mean - r.hop_ms_mean / 400) < 1e-9
        assert r.peak_mem_mb is None and r.params_flow > 0
    assert "| tiny | cpu | float32 | 2 | sequential |" in format_table(results)
