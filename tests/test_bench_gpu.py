"""``lychee-rtc bench gpu`` at tiny size on a CPU: the whole measurement runs and writes its report
(a couple of windows; no timing is asserted), and a report short of what was asked exits non-zero.
The full-size run needs a GPU (scripts/gpu_run.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpu_tiny_on_cpu_writes_json_and_markdown(tmp_path):
    from lychee_rtc.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "gpu", "--size", "tiny", "--device", "cpu", "--windows", "2", "--warmup", "1",
                 "--concurrency", "1,3", "--prompt-seconds", "1", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads((out / "bench_gpu.json").read_text())
    rows = report["rows"]
    assert [(r["sessions"], r["state"], r["mode"]) for r in rows] == [
        (1, "listen", "eager"), (1, "speak", "eager"), (3, "listen", "eager"), (3, "speak", "eager")]
    for r in rows:
        assert r["windows"] == 2 and len(r["raw_lm_ms"]) == 2
        assert r["lm_ms"]["p50"] > 0
        assert abs(r["total_ms"]["max"] - max(a + b for a, b in zip(r["raw_lm_ms"], r["raw_vocoder_ms"]))) < 1e-9
        assert abs(r["rtf"]["max"] - r["total_ms"]["max"] / 400.0) < 1e-9
        assert r["peak_gib"] is None and r["launch_overhead_lm"] is None  # CPU: no graphs, no GPU memory
        if r["state"] == "speak":
            assert min(r["raw_vocoder_ms"]) > 0  # one Token2Wav hop per stream and window
    assert report["setup"]["size"] == "tiny" and report["environment"]["device"] == "cpu"
    md = (out / "bench_gpu.md").read_text()
    assert "| C3 | speak | eager | 2 |" in md and "RTF p50 / p95 / max" in md


def test_bench_gpu_fails_when_no_row_was_measured(tmp_path, capsys):
    # Graphs only, on a CPU: nothing can be measured, so the run must not look like a success.
    from lychee_rtc.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "gpu", "--size", "tiny", "--device", "cpu", "--windows", "1", "--warmup", "0",
                 "--concurrency", "1", "--modes", "graphs", "--no-vocoder", "--threads", "1",
                 "--out", str(out)]) == 1
    assert "incomplete: no row was measured" in capsys.readouterr().err
    assert json.loads((out / "bench_gpu.json").read_text())["rows"] == []


def test_bench_gpu_names_rows_with_fewer_windows_than_asked(tmp_path):
    # Rows measured for real at tiny size, judged against more windows than they hold, and
    # against a concurrency and a mode that were not measured.
    import torch

    from lychee_rtc.bench.gpu import build_lychee, measure, shortfalls

    torch.set_num_threads(1)
    model, tokenizer, _ = build_lychee("tiny", torch.device("cpu"), torch.float32)
    rows = measure(model, tokenizer, None, 1, windows=2, warmup=0, max_seq=1024, modes=["eager"], prompt_tokens=25)
    assert [(r.state, r.windows) for r in rows] == [("listen", 2), ("speak", 2)]
    assert shortfalls(rows, [1], ["eager"], 2, {}) == []
    assert shortfalls(rows, [1], ["eager"], 3, {}) == ["C1 listen eager: 2 of 3 windows measured",
                                                       "C1 speak eager: 2 of 3 windows measured"]
    assert shortfalls(rows, [1, 2], ["eager", "graphs"], 2, {4: "out of GPU memory"}) == [
        "C4 not run: out of GPU memory", "C1 listen graphs: no windows measured",
        "C1 speak graphs: no windows measured", "C2 listen eager: no windows measured",
        "C2 listen graphs: no windows measured", "C2 speak eager: no windows measured",
        "C2 speak graphs: no windows measured"]
    assert shortfalls([], [1], ["eager"], 2, {}) == ["no row was measured"]


def test_building_the_bench_parsers_imports_no_torch():
    code = ("import argparse, sys\nfrom lychee_rtc.bench.cli import add_bench_parser\n"
            "add_bench_parser(argparse.ArgumentParser().add_subparsers())\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(900)  # the script is allowed 600 s on its own
def test_gpu_run_script_runs_every_step_at_tiny_size(tmp_path):
    """The one script meant for a fresh GPU machine, run here at tiny size on the CPU."""
    out = tmp_path / "results"
    written = tmp_path / "checkpoint"
    env = {"OUT": str(out), "PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "WRITE_DIR": str(written)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh"), "--tiny"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert summary.split()[:9] == ["summary:", "environment=0", "write_checkpoint=0", "check=0", "tests_graphs=0",
                                   "e2e=0", "bench_slide=0", "bench_gpu=0", "bench_vocoder=0"]
    # No checkpoint given: the script wrote one (tiny here, the released size on a GPU) and served it.
    assert json.loads((out / "write_checkpoint.json").read_text())["tensors"] == 172
    check = json.loads((out / "check.json").read_text())
    assert check["model"]["path"] == str(written / "lychee_full_duplex")
    assert [r["sessions"] for r in check["plan"]["rows"]] == [1, 2, 4, 8]
    slide = json.loads((out / "bench-slide" / "bench_slide.json").read_text())["rows"]
    assert [(r["sessions"], r["slides"], r["context_resets"]) for r in slide] == [(1, 2, 0), (2, 2, 0)]
    rows = json.loads((out / "bench-gpu" / "bench_gpu.json").read_text())["rows"]
    assert {(r["sessions"], r["state"]) for r in rows} == {(1, "listen"), (1, "speak"), (2, "listen"), (2, "speak")}
    assert json.loads((out / "vocoder.json").read_text())
    e2e = json.loads((out / "e2e.json").read_text())
    assert e2e["checkpoint"] == str(written)
    assert [(s["sessions"], s["answered"]) for s in e2e["steps"]] == [(1, 1), (2, 2)]
    for s in e2e["steps"]:
        assert s["engine_steps"] > 0 and 0 <= s["deadline_misses"] <= s["engine_steps"]
        assert all(t["first_audio_ms"] > 0 for t in s["turns"])
