"""Full-size Token2Wav on a GPU: time and RTF per hop at C1 / C2 / C4 (random weights, released
shapes). Prints a markdown table for docs/benchmarks.md and writes JSON next to it.

    python scripts/token2wav_gpu_bench.py --out /tmp/t2w_gpu.json            # fp32 and bf16
    python scripts/token2wav_gpu_bench.py --dtypes bf16 --rounds 40 --sequential

Target (issue 5): one H200-class GPU, RTF <= 0.1 per hop with four concurrent streams.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lychee_rtc.bench.token2wav_bench import format_table, run_vocoder_bench  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--prompt-seconds", type=float, nargs="+", default=[6.0])
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--out", default="token2wav_gpu_bench.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, matmul tf32={torch.backends.cuda.matmul.allow_tf32}")
    results = []
    t0 = time.time()
    for dtype in args.dtypes:
        for ps in args.prompt_seconds:
            rs = run_vocoder_bench("full", args.device, dtype, tuple(args.concurrency), args.rounds, ps, args.sequential)
            print(format_table(rs), flush=True)
            results += rs
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"# total {time.time() - t0:.0f} s; JSON in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
