"""``lychee-rtc bench gpu`` at tiny size on a CPU: the whole measurement runs and writes its report
(a couple of windows; no timing is asserted). The full-size run needs a GPU (scripts/gpu_run.sh)."""

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
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh"), "--tiny"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={"OUT": str(out), "PYTHON": sys.executable,
                                                       "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert summary.split() == ["summary:", "environment=0", "tests_graphs=0", "bench_gpu=0", "bench_vocoder=0"]
    rows = json.loads((out / "bench-gpu" / "bench_gpu.json").read_text())["rows"]
    assert {(r["sessions"], r["state"]) for r in rows} == {(1, "listen"), (1, "speak"), (2, "listen"), (2, "speak")}
    assert json.loads((out / "vocoder.json").read_text())
