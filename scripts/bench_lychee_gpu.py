"""Full-size Lychee-FD (released layout, random weights) on a GPU: per-window time and RTF at C1/C2/C4.

    python scripts/bench_lychee_gpu.py --sessions 1,2,4 --windows 30 --max-seq 8192

Builds the model straight on the device in the chosen dtype (no checkpoint needed: 28/4/4/4
Qwen2 layers, hidden 3584, vocab 158363, 32-layer audio encoder; ~12.8 B parameters incl. nothing
for the three skipped side tables), then runs the real runner exactly as serving does and measures
each 400 ms window's step for the whole batch with CUDA synchronisation around it. Decisions are
biased to "keep" so the listen / speak states hold; speech sampling, the 4-gram rule, KV caches
and the audio encoder all run as in serving. Target (issue 4): RTF <= 0.2 at C4 on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lychee_rtc.bench.lychee_step import bench_runner, format_table  # noqa: E402
from lychee_rtc.engine.lychee.config import parse_config  # noqa: E402
from lychee_rtc.engine.lychee.model import LycheeFD, checkpoint_targets  # noqa: E402
from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings  # noqa: E402
from lychee_rtc.engine.lychee.tiny import TinySpec, bias_decisions, randomize_, tiny_config, tiny_vocab  # noqa: E402
from lychee_rtc.engine.lychee.tokenizer import Tokenizer  # noqa: E402

RELEASED = TinySpec(hidden=3584, heads=28, kv_heads=4, intermediate=18944, main_layers=28, branch_layers=4,
                    control_branch_layer=8, audio_state=1280, audio_heads=20, audio_layers=32, audio_ctx=1500,
                    max_positions=16384, vocab_layout="released")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", default="1,2,4")
    ap.add_argument("--windows", type=int, default=30)
    ap.add_argument("--max-seq", type=int, default=8192)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True

    raw = tiny_config(RELEASED)
    cfg = parse_config(raw)
    t0 = time.monotonic()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LycheeFD(cfg)
    torch.set_default_dtype(torch.float32)
    randomize_(model, seed=0)
    with torch.no_grad():
        bias_decisions(checkpoint_targets(model), raw, 4.0)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"built {params / 1e9:.2f} B params in {time.monotonic() - t0:.1f}s on {torch.cuda.get_device_name(device)}",
          flush=True)
    byte_tokens, added = tiny_vocab(RELEASED)
    tok = Tokenizer.from_parts(byte_tokens, [], added)
    sync = torch.cuda.synchronize
    results = []
    for c in [int(x) for x in args.sessions.split(",")]:
        runner = LycheeRunner(model, tok, c, RunnerSettings(max_seq=args.max_seq, max_speech_tokens=10**6))
        with torch.no_grad():
            stats = bench_runner(runner, c, args.windows, warmup=5, sync=sync)
        results += stats
        print(format_table(stats), flush=True)
        print(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB", flush=True)
        del runner
        torch.cuda.empty_cache()
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ | {"rtf": r.rtf} for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
