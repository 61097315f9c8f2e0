"""Compare lychee-rtc's Token2Wav with the reference implementation on tiny random weights.

The reference (``third_party/Step-Audio2`` of the public HITsz-TMG/Lychee-FD repository) is
imported from a path given on the command line; none of its code is part of this project. Run it
in an environment that has the reference's extra imports (hyperpyyaml with ruamel.yaml<0.19,
scipy, soundfile, einops, s3tokenizer, onnxruntime); librosa is stubbed because prompts are fed
directly (prompt WAV loading is not compared).

    python scripts/token2wav_parity.py --reference /path/to/Lychee-FD/third_party/Step-Audio2

What is compared (same weights, same CFM noise buffer, same HiFT noise per call):
  1. offline flow mel (``flow.inference``),
  2. HiFT waveform on the same mel,
  3. streamed flow mel per hop and the streamed s16le PCM (hop 10, look-ahead 3, natural final).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch


def stub_librosa() -> bool:
    """Only flashcosyvoice's prompt-mel helper imports librosa. Without librosa it is stubbed and
    the prompt-mel comparison is skipped. Returns whether the real librosa is available."""
    try:
        import librosa  # noqa: F401

        return True
    except ImportError:
        pass
    librosa = types.ModuleType("librosa")
    filters = types.ModuleType("librosa.filters")
    filters.mel = lambda **_: (_ for _ in ()).throw(RuntimeError("librosa stub"))
    librosa.filters = filters
    sys.modules.setdefault("librosa", librosa)
    sys.modules.setdefault("librosa.filters", filters)
    return False


class CpuTorch:
    """The reference's token2wav module hard-codes device='cuda' tensors; run them on CPU."""

    def __init__(self, torch_module):
        self._t = torch_module

    def __getattr__(self, name):
        return getattr(self._t, name)

    def tensor(self, *a, device=None, **k):
        return self._t.tensor(*a, **k)

    def zeros(self, *a, device=None, **k):
        return self._t.zeros(*a, **k)


def seeded_noise(seed: int, shape) -> torch.Tensor:
    """The draws the reference's HiFT makes after ``torch.manual_seed(seed)``: rand(B, 9) for the
    (ineffective) initial phase, then the additive noise with ``randn_like`` of a transposed
    [B, L, 9] view of a [B, 9, L] buffer (torch's non-contiguous normal_ path)."""
    g = torch.Generator().manual_seed(seed)
    torch.rand(shape[0], shape[2], generator=g)
    return torch.empty((shape[0], shape[2], shape[1])).transpose(1, 2).normal_(generator=g)


class SeededHift:
    def __init__(self, hift, first_seed: int):
        self.hift, self.seed = hift, first_seed

    def __call__(self, *args, **kwargs):
        torch.manual_seed(self.seed)
        self.seed += 1
        return self.hift(*args, **kwargs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", required=True, help="path to Lychee-FD/third_party/Step-Audio2")
    ap.add_argument("--tokens", type=int, default=57)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    sys.path.insert(0, str(Path(args.reference).resolve()))
    have_librosa = stub_librosa()
    import token2wav as ref_t2w  # the reference module
    from flashcosyvoice.modules.hifigan import ConvRNNF0Predictor, HiFTGenerator as RefHiFT
    from hyperpyyaml import load_hyperpyyaml

    from lychee_rtc.engine.lychee.token2wav_stream import StreamRules, VocoderStream, to_pcm16
    from lychee_rtc.vocoder.token2wav.frontend import PromptFeatures, prompt_mel
    from lychee_rtc.vocoder.token2wav.model import Token2Wav
    from lychee_rtc.vocoder.token2wav.tiny import PARITY_FLOW, PARITY_HIFT, write_tiny_token2wav

    folder = write_tiny_token2wav(Path(tempfile.mkdtemp()) / "token2wav", seed=args.seed,
                                  flow_config=PARITY_FLOW, hift_config=PARITY_HIFT)
    ours = Token2Wav.load(folder, noise_seed=args.seed + 1)

    # reference objects built from the same files
    with open(folder / "flow.yaml") as f:
        ref_flow = load_hyperpyyaml(f)["flow"]
    ref_flow.load_state_dict(torch.load(folder / "flow.pt", weights_only=True), strict=True)
    ref_flow.eval()
    ref_flow.decoder.rand_noise = ours.flow.decoder.rand_noise.clone()
    ref_hift = RefHiFT(base_channels=PARITY_HIFT.base_channels,
                       f0_predictor=ConvRNNF0Predictor(cond_channels=PARITY_HIFT.cond_channels))
    ref_hift.load_state_dict({k.replace("generator.", ""): v for k, v in
                              torch.load(folder / "hift.pt", weights_only=True).items()}, strict=True)
    ref_hift.eval()

    g = torch.Generator().manual_seed(args.seed + 2)
    prompt_tokens = torch.randint(0, 6561, (1, args.prompt_tokens), generator=g, dtype=torch.int32)
    t = torch.arange(args.prompt_tokens * 960) / 24000
    wav = 0.3 * torch.sin(2 * np.pi * 150 * t) + 0.01 * torch.randn(t.shape, generator=g)
    features = PromptFeatures(tokens=prompt_tokens, embedding=torch.randn(1, 192, generator=g),
                              mel=prompt_mel(wav, args.prompt_tokens))
    voice = ours.voice_from_features("parity", features)
    tokens = torch.randint(0, 6561, (args.tokens,), generator=g).tolist()
    report: dict[str, object] = {"config": {"flow": str(PARITY_FLOW), "hift": str(PARITY_HIFT),
                                            "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
                                            "torch": torch.__version__, "threads": 1}}

    # 1. offline flow mel
    tok = torch.tensor([tokens], dtype=torch.int32)
    with torch.inference_mode():
        ref_mel = ref_flow.inference(tok, torch.tensor([tok.shape[1]]), prompt_tokens,
                                     torch.tensor([args.prompt_tokens]), features.mel,
                                     torch.tensor([features.mel.shape[1]]), features.embedding, 10)
        our_mel = ours.flow.inference(tok, prompt_tokens, features.mel, features.embedding)
    report["offline_flow_mel_max_abs_diff"] = float((ref_mel - our_mel).abs().max())
    report["offline_flow_mel_max_abs"] = float(ref_mel.abs().max())

    # 2. HiFT waveform on the same mel, same noise
    torch.manual_seed(123)
    ref_wav, ref_src = ref_hift(speech_feat=ref_mel)
    our_wav, our_src = ours.hift(ref_mel, noise=seeded_noise(123, ours.hift.noise_shape(1, ref_mel.shape[2])))
    report["hift_wave_max_abs_diff"] = float((ref_wav - our_wav).abs().max())
    report["hift_source_max_abs_diff"] = float((ref_src - our_src).abs().max())
    report["hift_wave_max_abs"] = float(ref_wav.abs().max())

    # 3. streaming: the reference Token2wav driven with hop 10 / look-ahead 3, natural final
    ref_t2w.torch = CpuTorch(torch)
    ref = object.__new__(ref_t2w.Token2wav)
    ref.float16 = False
    ref.flow, ref.hift = ref_flow, SeededHift(ref_hift, 1000)
    ref.mel_cache_len, ref.source_cache_len = 8, 3840
    ref.speech_window = torch.from_numpy(np.hamming(7680))
    ref.stream_lookahead_len = 3
    key = "<parity prompt>"
    ref.cache = {key: (prompt_tokens, torch.tensor([args.prompt_tokens], dtype=torch.int32), features.embedding,
                       features.mel, torch.tensor([features.mel.shape[1]], dtype=torch.int32))}
    ref_chunk_mels, our_chunk_mels = [], []
    inner = ref_flow.inference_chunk

    def record_ref(*a, **k):
        mel, cache = inner(*a, **k)
        ref_chunk_mels.append(mel.clone())
        return mel, cache

    ref_flow.inference_chunk = record_ref
    ref.set_stream_cache(key)
    ref_pcm = []
    buf = list(tokens)
    while len(buf) > 13:  # the reference application's rule: more than hop + look-ahead
        ref_pcm.append(np.frombuffer(ref.stream(buf[:13], key), dtype="<i2"))
        buf = buf[10:]
    ref_pcm.append(np.frombuffer(ref.stream(buf, key, last_chunk=True), dtype="<i2"))

    our_inner = ours.flow.chunk

    def record_ours(states, toks, last):
        mel, new = our_inner(states, toks, last)
        our_chunk_mels.append(mel.clone())
        return mel, new

    ours.flow.chunk = record_ours
    counter = iter(range(1000, 10_000))
    stream = VocoderStream(ours, voice, 0, "parity", rules=StreamRules(hop=10))
    stream.noise_override = lambda shape: seeded_noise(next(counter), shape)
    events = []
    for seq, c in enumerate(tokens):  # one code per packet: the stream decides when to hop
        events += stream.push([c], 0, "parity", seq)
    events += stream.finish()
    our_pcm = [to_pcm16(e.pcm) for e in events]

    report["stream_chunk_sizes_ref"] = [int(p.size) for p in ref_pcm]
    report["stream_chunk_sizes_ours"] = [int(p.size) for p in our_pcm]
    report["stream_flow_mel_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref_chunk_mels, our_chunk_mels))
    report["stream_flow_mel_calls"] = [len(ref_chunk_mels), len(our_chunk_mels)]
    r, o = np.concatenate(ref_pcm).astype(np.int32), np.concatenate(our_pcm).astype(np.int32)
    report["stream_pcm_samples"] = [int(r.size), int(o.size)]
    if r.size == o.size:
        report["stream_pcm_max_abs_diff_lsb"] = int(np.abs(r - o).max())
        report["stream_pcm_mean_abs_diff_lsb"] = float(np.abs(r - o).mean())
        report["stream_pcm_peak_lsb"] = int(np.abs(r).max())
    # 4. prompt mel from a 16 kHz recording (resample to 24 kHz, log-mel, resize to 2N frames)
    if have_librosa:
        import torchaudio
        from flashcosyvoice.utils.audio import mel_spectrogram

        from lychee_rtc.vocoder.token2wav.frontend import resample

        t16 = torch.arange(int(2.3 * 16000)) / 16000
        wav16 = (0.3 * torch.sin(2 * np.pi * (120 + 40 * t16) * t16) + 0.02 * torch.randn(t16.shape, generator=g))[None]
        n = 57
        ref_audio = torchaudio.transforms.Resample(orig_freq=16000, new_freq=24000)(wav16)
        ref_pm = mel_spectrogram(ref_audio).transpose(1, 2)
        ref_pm = torch.nn.functional.pad(ref_pm, (0, 0, 0, 2 * n - ref_pm.shape[1]), mode="replicate")
        our_audio = resample(wav16, 16000, 24000)
        our_pm = prompt_mel(our_audio[0], n)
        report["prompt_resample_max_abs_diff"] = float((ref_audio - our_audio).abs().max())
        report["prompt_mel_shape"] = [list(ref_pm.shape), list(our_pm.shape)]
        report["prompt_mel_max_abs_diff"] = float((ref_pm - our_pm).abs().max())
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
