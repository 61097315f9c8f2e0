"""``lychee-rtc check``: is this checkpoint servable, and how much GPU memory will it take?

Without reading a weight: the Lychee-FD and Token2Wav folders a profile names (``hf://``
references through the cache, or folders; ``--dir`` / ``--model`` / ``--token2wav`` instead) are
checked against the released inventory from their headers and index (``inventory.py``), and the
memory plan (``memory_plan.py``) is printed for 1, 2, 4 and 8 sessions and the profile's own count,
with the profile's dtype, ``max_seq`` and voices, against a GPU's memory (an H200 by default), and
so is the rolling context the profile comes to with the folder's tokenizer (sink, window, slide
step, re-prefill budget; the sizes left null follow ``max_seq``).

``--step`` then runs one full-size window step on the CPU, one layer at a time from the memory-
mapped shards (``streamed_step.py``), and reports its time and peak memory: the model code meets
the real shapes before a GPU does.
"""

from __future__ import annotations

import argparse
import json
import sys
import wave
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .hub import HubReferenceError, resolve_folder
from .memory_plan import H200_GIB, VocoderGeometry, format_plan, plan

BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4, "float": 4}
PROMPT_LIMIT_TOKENS = 440  # the longest prompt a voice may have (17.6 s)


def prompt_tokens(path: Path) -> int:
    """Prompt tokens of a voice recording (25 per second); the limit when its length cannot be read."""
    try:
        with wave.open(str(path)) as w:
            return min(PROMPT_LIMIT_TOKENS, int(w.getnframes() / w.getframerate() * 25))
    except (OSError, wave.Error, EOFError):
        return PROMPT_LIMIT_TOKENS


def vocoder_geometry(folder: Path, section: dict[str, Any]) -> VocoderGeometry:
    import torch

    from lychee_rtc.vocoder.token2wav.config import load_flow_config
    from lychee_rtc.vocoder.token2wav.flow import Flow
    from lychee_rtc.vocoder.token2wav.inventory import _headers

    from .token2wav_settings import Token2WavSettings

    settings = Token2WavSettings.from_mapping({**section, "folder": str(folder)})
    cfg = load_flow_config(folder)
    with torch.device("meta"):
        flow_params = sum(p.numel() for p in Flow(cfg).parameters())
    hift_params = sum(t.numel() for t in _headers(folder / "hift.pt").values())
    enc, dit = cfg.encoder, cfg.estimator
    return VocoderGeometry(
        flow_params=flow_params, hift_params=hift_params, flow_bytes=BYTES[settings.dtype],
        noise_frames=cfg.noise_frames, mel=cfg.output_size, steps=cfg.n_timesteps, depth=dit.depth,
        heads=dit.num_heads, head_dim=dit.head_dim, hidden=dit.hidden_size, enc_blocks=enc.num_blocks,
        enc_up_blocks=enc.num_up_blocks, enc_heads=enc.attention_heads, enc_head_dim=enc.head_dim,
        up_rate=cfg.up_rate, hop=settings.hop,
        prompt_tokens=tuple(prompt_tokens(p) for p in settings.voices.values()),
        max_cached_voices=settings.max_cached_voices)


def context_geometry(model_root: Path, lychee: dict[str, Any], sessions: int) -> dict[str, Any]:
    """What the profile's context keys come to for this folder's tokenizer (its default prompt)."""
    from .runner import RunnerSettings, slide_policy
    from .tokenizer import Tokenizer

    keys = ("max_seq", "context_window", "context_slide_step", "context_prefill_budget")
    settings = RunnerSettings(**{k: lychee[k] for k in keys if k in lychee})
    policy, prefix = slide_policy(Tokenizer.from_dir(model_root), settings, sessions)
    sink = len(prefix)
    return {"mode": "sliding" if policy.enabled else "reset", "sink": sink,
            "window": policy.kept(sink, sink) if policy.enabled else 0, "step": policy.step if policy.enabled else 0,
            "budget": policy.budget}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="lychee-c1",
                        help="profile whose folders and settings to check (default lychee-c1)")
    parser.add_argument("--dir", help="check DIR/lychee_full_duplex and DIR/token2wav instead of the profile's folders")
    parser.add_argument("--model", help="the Lychee-FD folder (or hf:// reference) to check")
    parser.add_argument("--token2wav", help="the Token2Wav folder (or hf:// reference) to check")
    parser.add_argument("--layout", choices=("released", "any"), default="released",
                        help="released (default): require the released layout; any: only self-consistent")
    parser.add_argument("--sessions", default="1,2,4,8", help="session counts to plan for (the profile's is added)")
    parser.add_argument("--gpu-gib", type=float, default=H200_GIB,
                        help=f"GPU memory to plan against (default {H200_GIB:.1f}: an H200)")
    parser.add_argument("--step", action="store_true",
                        help="also run one full-size window step on the CPU, one layer at a time")
    parser.add_argument("--threads", type=int, help="torch CPU threads for --step")
    parser.add_argument("--json", help="write the report here as JSON")


def run(args: argparse.Namespace) -> int:
    from lychee_rtc.config import ConfigError, load_settings
    from lychee_rtc.vocoder.token2wav.config import CheckpointError
    from lychee_rtc.vocoder.token2wav.inventory import verify_token2wav_folder

    from .config import load_config
    from .inventory import InventoryError, verify_model_folder

    def fail(message: str) -> int:
        print(f"lychee-rtc check: {message}", file=sys.stderr)
        return 1

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        return fail(str(exc))
    if settings.engine.name != "lychee":
        return fail(f"{args.config}: engine is {settings.engine.name!r}, not lychee")
    lychee = dict(settings.engine.lychee)
    section = lychee.get("token2wav") or None
    model_value = args.model or (str(Path(args.dir) / "lychee_full_duplex") if args.dir else lychee.get("model_root", ""))
    vocoder_value = args.token2wav or (str(Path(args.dir) / "token2wav") if args.dir else
                                       (section or {}).get("folder"))
    try:
        model_root = resolve_folder(str(model_value), "engine.lychee.model_root", "model")
        vocoder_root = resolve_folder(str(vocoder_value), "engine.lychee.token2wav.folder", "token2wav") \
            if vocoder_value else None
    except HubReferenceError as exc:
        return fail(str(exc))
    released = args.layout == "released"
    report: dict[str, Any] = {"profile": str(args.config)}
    try:
        m = verify_model_folder(model_root, released=released)
        report["model"] = asdict(m)
        print(f"model: {m.path}: {m.files} files, {m.bytes / 2**30:.2f} GiB, {m.tensors} tensors ({m.dtype}), "
              f"{m.params / 1e9:.2f} B parameters to load, layout {m.layout}: ok")
        geometry = None
        if vocoder_root is not None:
            v = verify_token2wav_folder(vocoder_root, released=released)
            report["token2wav"] = asdict(v)
            print(f"token2wav: {v.path}: {v.files} files, {v.bytes / 2**30:.2f} GiB, flow.pt {v.flow_tensors} "
                  f"tensors, hift.pt {v.hift_tensors} tensors, layout {v.layout}: ok")
            geometry = vocoder_geometry(vocoder_root, section or {"voices": {"default": "builtin"}})
    except (InventoryError, CheckpointError) as exc:
        return fail(str(exc))
    except ValueError as exc:  # a profile value of the vocoder section
        return fail(str(exc))

    cfg = load_config(model_root)
    counts = sorted({int(c) for c in str(args.sessions).split(",") if c} | {settings.session.max_sessions})
    dtype = str(lychee.get("dtype", "bf16"))
    max_seq = int(lychee.get("max_seq", 8192))
    sliding = lychee.get("context_window") != 0  # slides keep a second cache row per session
    rows = [plan(cfg, sessions=c, max_seq=max_seq, lm_value_bytes=BYTES[dtype], vocoder=geometry,
                 max_speech_tokens=int(lychee.get("max_speech_tokens", 1000)), gpu_gib=args.gpu_gib,
                 sliding=sliding) for c in counts]
    report["plan"] = {"dtype": dtype, "max_seq": max_seq, "gpu_gib": args.gpu_gib, "rows": [asdict(r) for r in rows]}
    print(f"\nmemory plan ({dtype}, max_seq {max_seq}, profile {args.config} with {settings.session.max_sessions} "
          f"session(s)):")
    print(format_plan(rows))
    status = 0 if all(r.fits for r in rows if r.sessions == settings.session.max_sessions) else 1
    try:
        report["context"] = context_geometry(model_root, lychee, settings.session.max_sessions)
    except ValueError as exc:  # an explicit size that does not fit: the message names the key
        return fail(f"engine.lychee.{exc}")
    c = report["context"]
    print(f"\nrolling context ({c['mode']}): sink {c['sink']} positions (the default system prompt), window "
          f"{c['window']} ({c['window'] / 25:.0f} s), slide step {c['step']} ({c['step'] / 25:.0f} s), re-prefill "
          f"budget {c['budget']} positions per window step for {settings.session.max_sessions} session(s)")
    if args.step:
        import torch

        from .streamed_step import run_streamed

        if args.threads:
            torch.set_num_threads(args.threads)
        from .checkpoint import parse_dtype

        # In the profile's dtype, as the GPU runs it (bf16 also halves what one layer holds).
        _, step = run_streamed(model_root, dtype=parse_dtype(dtype),
                               start_speak_factor=float(lychee.get("start_speak_factor", 1.2)))
        report["step"] = asdict(step)
        print(f"\none window step on the CPU, a layer at a time ({step.modules_loaded} modules, "
              f"{step.bytes_read / 2**30:.2f} GiB read): {step.wall_s:.1f} s ({step.cpu_s:.1f} s of CPU, "
              f"{torch.get_num_threads()} threads, {dtype}), peak RSS {step.peak_rss_mib:.0f} MiB "
              f"(at start {step.rss_at_start_mib:.0f}); decision {step.decision} {step.decision_probs}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if status:
        print(f"the profile's {settings.session.max_sessions} session(s) do not fit {args.gpu_gib:.1f} GiB",
              file=sys.stderr)
    return status
