"""The long-call and slide benches, briefly, through the CLI on the tiny model: what they report
is checked, never how fast it was (docs/benchmarks.md has the measured figures)."""

from __future__ import annotations

import argparse
import json

import torch

from lychee_rtc.bench.cli import run_bench


def test_a_short_long_call_slides_many_times_without_a_reset(tmp_path):
    out = tmp_path / "long-call"
    old = torch.get_num_threads()
    try:
        status = run_bench(argparse.Namespace(bench="long-call", extra_args=[
            "--minutes", "1.5", "--no-vocoder", "--sample-every", "20", "--out", str(out)]))
    finally:
        torch.set_num_threads(old)
    report = json.loads((tmp_path / "long-call.json").read_text())
    assert status == 0 and report["clean"] is True
    tally = report["tallies"][0]
    assert tally["windows"] == 225 and tally["context_resets"] == 0 and tally["errors"] == {}
    assert tally["responses"] >= 3 and tally["completed"] >= 1 and tally["cancelled"] >= 1
    assert report["windows_dropped"] == 0
    # Every slide at its point; no step re-prefilled more than the budget (1 session: 1.25 x 41).
    assert report["slides_late"] == 0 and 0 < report["most_computed"] <= report["budget"] == 52
    # 90 s of conversation = 2250 positions in a 512-position slot: it slid every 4 s.
    assert report["slides"] >= 18 and report["setup"]["window"] == 200 and report["setup"]["slide_step"] == 100
    samples = report["samples"]
    assert [s["call_s"] for s in samples] == sorted(s["call_s"] for s in samples) and samples[-1]["call_s"] == 90.0
    assert all(s["context_resets"] == 0 and s["longest_tokens"] <= 300 for s in samples)
    assert all(s["rss_mb"] > 0 for s in samples) and report["rss_mb"]["max"] >= report["rss_mb"]["start"]
    assert any(s["speak_cpu_ms_p50"] for s in samples) and any(s["listen_cpu_ms_p50"] for s in samples)
    assert "| RSS MB |" in (tmp_path / "long-call.md").read_text()


def test_the_slide_bench_times_the_slides_of_speaking_sessions(tmp_path):
    old = torch.get_num_threads()
    try:
        status = run_bench(argparse.Namespace(bench="slide", extra_args=[
            "--size", "tiny", "--device", "cpu", "--sessions", "2", "--slides", "2", "--max-seq", "512",
            "--window", "200", "--step", "100", "--out", str(tmp_path)]))
    finally:
        torch.set_num_threads(old)
    report = json.loads((tmp_path / "bench_slide.json").read_text())
    (row,) = report["rows"]
    assert status == 0 and row["sessions"] == 2 and row["slides"] == 2 and row["context_resets"] == 0
    assert (row["sink"], row["window"], row["step"]) == (37, 200, 100)
    # Both sessions slide in the same steps: each slide re-prefilled 2 x (37 prefix + 199 kept), and
    # their pieces shared a forward, never more than the budget (1.25 x 2 x ceil(min(128 + 200, 392) / 8)).
    assert row["prefill_positions"] == 2 * (37 + 199)
    assert row["budget"] == 103 and 0 < row["most_positions"] <= row["most_computed"] <= row["budget"]
    assert row["late"] == row["fallbacks"] == 0 and row["batched_steps"] >= 10
    assert row["speaking"]["windows"] >= 10 and row["switch"]["windows"] == 2 and row["share"]["max"] > 0
    assert row["slide_ms"] > 0 and row["per_position_us"] > 0
    windows = row["raw"]
    assert all(w["speaking"] for w in windows if w["switches"])  # slides timed while speaking
    assert all(w["computed"] <= row["budget"] for w in windows)
    assert "| C2 | 2 | 103 / " in (tmp_path / "bench_slide.md").read_text()
