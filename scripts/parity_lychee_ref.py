"""Compare lychee_rtc's Lychee-FD with the reference implementation on a tiny random checkpoint.

The reference (public repo HITsz-TMG/Lychee-FD, ``Training_package/Code/Models``) is NOT part of
this project: pass the folder that contains ``Models/`` on the command line. It needs
``transformers==4.57.*`` and ``librosa`` in the interpreter running this script.

    python scripts/parity_lychee_ref.py --ref /path/to/Lychee-FD/Training_package/Code

What is compared (fp32, then bf16):
  1. log-mel of one 400 ms window (torchaudio Slaney filters vs librosa),
  2. encoder + adapter features of the same windows,
  3. teacher-forced text / speech / control logits over a 3-window sequence (prefix included),
     with our ``score_teacher_forced`` against the reference ``LycheeFD.forward``,
  4. the reference's cached streaming path (``multi_head_generate``, 1 prefill + decode steps with
     forced tokens) against our runner's listen/speak steps on the same inputs.
Prints one line per comparison with the largest absolute difference.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lychee_rtc.engine.lychee.audio import encode_windows, log_mel, mel_filterbank  # noqa: E402
from lychee_rtc.engine.lychee.checkpoint import load_model  # noqa: E402
from lychee_rtc.engine.lychee.config import load_config  # noqa: E402
from lychee_rtc.engine.lychee.scoring import score_teacher_forced  # noqa: E402
from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint  # noqa: E402
from lychee_rtc.engine.lychee.tokenizer import SYSTEM_PREFIX, Tokenizer  # noqa: E402


def load_reference(ref: Path, ckpt: Path, dtype: torch.dtype):
    sys.path.insert(0, str(ref))
    lfd = importlib.import_module("Models.LycheeFD")
    msa = importlib.import_module("Models.modeling_step_audio_2")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["torch_dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float32"
    cfg = lfd.LycheeFDConfig(**raw)
    for sub in (cfg.text_config, cfg.stoken_layer_config, cfg.control_layer_config, cfg.merge_layer_config):
        sub._attn_implementation = "eager"
    model = lfd.LycheeFD(cfg)
    state = {}
    for shard in sorted(ckpt.glob("model-*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in m for m in missing), missing
    model = model.to(dtype).eval()
    return model, msa


def sequences(tok, st, n_windows: int, rng: np.random.Generator):
    """A plausible 3-window history: listen, S-S, then speaking with text and delayed speech."""
    t = n_windows * 10
    text = [st.text_pad] * t
    stoken = [st.stoken_pad] * t
    control = []
    for i in range(t):
        slot = i % 10
        control.append(st.detect if slot == 8 else st.sleep)
    control[9] = st.start_speaking
    for i in range(10, t):
        text[i] = int(rng.integers(32, 127))
        if i - 10 < 10:
            stoken[i] = st.stoken_delay
        elif i - 10 == 10:
            stoken[i] = st.tts_start
        else:
            stoken[i] = st.audio_code_min + int(rng.integers(0, 64))
    control[19] = st.keep_speaking
    control[29] = st.keep_speaking
    return text, stoken, control


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, type=Path, help="folder holding the reference Models/ package")
    ap.add_argument("--windows", type=int, default=3)
    args = ap.parse_args()
    if not (args.ref / "Models" / "LycheeFD.py").is_file():
        print(f"reference not found under {args.ref}; skipping")
        return 0
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="lychee-parity-"))
    ckpt = write_tiny_checkpoint(tmp / "ckpt", seed=1, spec=TinySpec(hidden=32, intermediate=64, vocab_layout="released"))
    cfg = load_config(ckpt)
    tok = Tokenizer.from_dir(ckpt)
    st = cfg.resolve_tokens(tok)
    prefix = tok.encode(SYSTEM_PREFIX)
    audio = (0.1 * rng.standard_normal(args.windows * 6400)).astype(np.float32)
    audio[:3200] *= 0.01  # one quiet half-window: exercises the per-window max-8 floor
    text, stoken, control = sequences(tok, st, args.windows, rng)

    ref_fp32: dict[str, torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        ours = load_model(ckpt, dtype=dtype, progress=False)
        ref, msa = load_reference(args.ref, ckpt, dtype)

        w = torch.from_numpy(audio[:6400])
        mel_ref = msa.log_mel_spectrogram(w, n_mels=128, padding=479)
        mel_ours = log_mel(w[None], mel_filterbank())[0]
        print(f"[{name}] log-mel (42x128): max |diff| = {(mel_ref - mel_ours).abs().max().item():.3e}")

        windows = torch.from_numpy(audio).view(-1, 6400)
        mels = torch.stack([msa.log_mel_spectrogram(x, n_mels=128, padding=479) for x in windows])
        lens = torch.full((mels.shape[0],), mels.shape[-1] - 2, dtype=torch.int32)
        with torch.no_grad():
            f_ref, _ = ref.encoder(mels.to(dtype), lens)
            f_ref = ref.adapter(f_ref)
            f_ours = encode_windows(ours.encoder, ours.adapter, mel_filterbank(), windows)
        print(f"[{name}] encoder+adapter features: max |diff| = {(f_ref.float() - f_ours.float()).abs().max().item():.3e}"
              f" (scale {f_ref.float().abs().max().item():.2f})")

        res = score_teacher_forced(ours, st, prefix, text, stoken, control, audio)
        audio_ids = [st.audio_patch if i % 2 == 0 else st.audio_pad for i in range(len(text))]
        with torch.no_grad():
            out = ref(
                input_ids=torch.tensor([prefix + text]),
                stoken_ids=torch.tensor([stoken]),
                control_input_ids=torch.tensor([control]),
                audio_input_ids=torch.tensor([audio_ids]),
                prefix_input_ids=torch.tensor([prefix]),
                wavs=mels.transpose(1, 2).transpose(1, 2),
                wav_lens=lens,
                use_cache=False,
            )
        for label, a, b in (("text", out.logits, res.text_logits), ("speech", out.stoken_logits, res.speech_logits),
                            ("control", out.control_logits, res.control_logits)):
            a = a[0].float()
            d = (a - b).abs().max().item()
            agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
            print(f"[{name}] teacher-forced {label} logits ({a.shape[0]}x{a.shape[1]}): max |diff| = {d:.3e}"
                  f" (scale {a.abs().max().item():.2f}, argmax agreement {agree:.3f})")
            if dtype == torch.float32:
                ref_fp32[label] = a
            else:
                # bf16 has no single right answer: report both bf16 runs against the fp32 reference.
                floor = (a - ref_fp32[label]).abs().max().item()
                mine = (b - ref_fp32[label]).abs().max().item()
                print(f"[{name}]   vs fp32 reference: reference-bf16 {floor:.3e}, ours-bf16 {mine:.3e}")
        if dtype == torch.float32:
            streaming_check(ours, ref, tok, st, prefix, 12)
    return 0


def streaming_check(ours, ref, tok, st, prefix, n_windows: int) -> None:
    """Run our real-time runner (greedy: speech temperature 0, no n-gram rule, factors 1) with a
    commit so it speaks, then score what it decided with the reference's teacher-forced forward:
    every freely chosen text / speech / control token must be the reference's argmax."""
    from lychee_rtc.engine.base import Control, ControlKind, SessionOptions
    from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings

    runner = LycheeRunner(ours, tok, 1, RunnerSettings(max_seq=1024, temperature=0.0, no_repeat_ngram=0,
                                                       start_speak_factor=1.0, start_listen_factor=1.0))
    runner.open(0, SessionOptions())
    rng = np.random.default_rng(5)
    wins = [(0.1 * rng.standard_normal(6400)).astype(np.float32) for _ in range(n_windows)]
    for k, w in enumerate(wins):
        if runner.slots[0].mode.value == "listening":
            runner.apply_controls(0, [Control(ControlKind.COMMIT, 0)])
        runner.step([(0, w, 0)])
    s = runner.slots[0]
    mels = torch.stack([ref_mel(torch.from_numpy(x)) for x in wins])
    lens = torch.full((len(wins),), mels.shape[-1] - 2, dtype=torch.int32)
    audio_ids = [st.audio_patch if i % 2 == 0 else st.audio_pad for i in range(len(s.text))]
    with torch.no_grad():
        out = ref(input_ids=torch.tensor([prefix + s.text]), stoken_ids=torch.tensor([s.stoken]),
                  control_input_ids=torch.tensor([s.control]), audio_input_ids=torch.tensor([audio_ids]),
                  prefix_input_ids=torch.tensor([prefix]), wavs=mels, wav_lens=lens, use_cache=False)
    p = len(prefix)
    hi = runner.cfg.stoken_token_ids_max
    n_text = n_speech = n_ctrl = bad = 0
    for q in range(len(s.text) - 1):
        nt, ns, nc = s.text[q + 1], s.stoken[q + 1], s.control[q + 1]
        if nt not in (st.text_pad, st.tts_pad):
            n_text += 1
            bad += int(out.logits[0, p + q].argmax().item() != nt)
        if st.audio_code_min <= ns < hi or ns == st.tts_end:
            n_speech += 1
            row = out.stoken_logits[0, p + q].clone()
            keep = torch.zeros_like(row, dtype=torch.bool)
            keep[st.audio_code_min:hi] = True
            keep[st.tts_end] = True
            bad += int(row.masked_fill(~keep, -1e30).argmax().item() != ns)
        if (q + 1) % 10 == 9 and q >= 9:
            n_ctrl += 1
            pair = (st.start_speaking, st.keep_listening) if nc in pair_l(st) else (st.start_listening, st.keep_speaking)
            row = out.control_logits[0, p + q]
            want = pair[0] if row[pair[0]] >= row[pair[1]] else pair[1]
            forced = nc == st.start_speaking and row[pair[0]] < row[pair[1]]  # a commit forced S-S
            bad += int(want != nc and not forced)
    print(f"[fp32] streaming runner vs reference teacher-forced argmax over {len(wins)} windows: "
          f"{n_text} text, {n_speech} speech, {n_ctrl} control decisions checked, {bad} disagreements")


def pair_l(st):
    return (st.start_speaking, st.keep_listening)


def ref_mel(x):
    msa = importlib.import_module("Models.modeling_step_audio_2")
    return msa.log_mel_spectrogram(x, n_mels=128, padding=479)


if __name__ == "__main__":
    raise SystemExit(main())
