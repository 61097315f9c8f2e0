"""Prompt preparation: a voice's prompt speech tokens, CAM++ speaker embedding and prompt mel.

All three come from one prompt recording (any sample rate; resampled here):

* tokens: 16 kHz, channel 0 -> Whisper-style 128-bin log-mel -> S3 tokenizer v2 (25 Hz);
* speaker: 16 kHz Kaldi fbank (80 bins, dither 0), mean-normalised -> CAM++ ONNX -> [1, 192];
* mel: 24 kHz channel mean -> 80-bin log-mel (n_fft 1920, hop 480, fmax 8000, reflect pad 720),
  resized to exactly 2 frames per prompt token by replicating (or dropping) the last frame.

The S3 tokenizer runs through the ``s3tokenizer`` package (it converts the released ONNX graph into
a torch model, as the reference does) when the file is the released graph; any other graph (the
tiny test models) runs in onnxruntime with the same inputs and outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torchaudio.compliance.kaldi as kaldi
import torchaudio.functional as AF

from .config import CheckpointError

SPEAKER_ONNX = "campplus.onnx"
TOKENIZER_ONNX = "speech_tokenizer_v2_25hz.onnx"
# The released tokenizer's first conv initializer, by which s3tokenizer recognises the v2 graph.
_S3_V2_MARKER = "onnx::Conv_2216"


@dataclass(frozen=True)
class PromptFeatures:
    tokens: torch.Tensor  # [1, N] int32, 25 Hz
    embedding: torch.Tensor  # [1, 192] float32 (CAM++)
    mel: torch.Tensor  # [1, 2N, 80] float32

    @property
    def n_tokens(self) -> int:
        return self.tokens.shape[1]


def resample(wav: torch.Tensor, sr: int, target: int) -> torch.Tensor:
    """torchaudio's default band-limited sinc (Hann) resampler, as ``transforms.Resample``."""
    return wav if sr == target else AF.resample(wav, sr, target)


def prompt_mel(wav24: torch.Tensor, n_tokens: int | None = None) -> torch.Tensor:
    """[T] mono 24 kHz -> [1, frames, 80] log-mel; resized to 2*n_tokens frames when given."""
    n_fft, hop = 1920, 480
    y = torch.nn.functional.pad(wav24.view(1, 1, -1), ((n_fft - hop) // 2, (n_fft - hop) // 2), mode="reflect").view(1, -1)
    spec = torch.stft(y, n_fft, hop_length=hop, win_length=n_fft, window=torch.hann_window(n_fft),
                      center=False, onesided=True, return_complex=True)
    spec = torch.view_as_real(spec)
    mag = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    fb = AF.melscale_fbanks(n_fft // 2 + 1, 0.0, 8000.0, 80, 24000, norm="slaney", mel_scale="slaney")
    mel = torch.log(torch.clamp(torch.matmul(fb.T, mag), min=1e-5))  # [1, 80, frames]
    mel = mel.transpose(1, 2)
    if n_tokens is not None:
        want = 2 * n_tokens
        if mel.shape[1] >= want:
            mel = mel[:, :want]
        else:
            mel = torch.cat([mel, mel[:, -1:].expand(1, want - mel.shape[1], 80)], dim=1)
    return mel.contiguous()


def speaker_fbank(wav16: torch.Tensor) -> torch.Tensor:
    feat = kaldi.fbank(wav16.unsqueeze(0), num_mel_bins=80, dither=0, sample_frequency=16000)
    return feat - feat.mean(dim=0, keepdim=True)


def whisper_log_mel(wav16: torch.Tensor) -> torch.Tensor:
    """128-bin log-mel of the S3 tokenizer ([128, T]); s3tokenizer's own when installed."""
    try:
        import s3tokenizer

        return s3tokenizer.log_mel_spectrogram(wav16)
    except ImportError:
        pass
    window = torch.hann_window(400)
    stft = torch.stft(wav16, 400, 160, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    fb = AF.melscale_fbanks(201, 0.0, 8000.0, 128, 16000, norm="slaney", mel_scale="slaney")
    log_spec = torch.clamp(fb.T @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def read_audio(path: str | Path) -> tuple[torch.Tensor, int]:
    """Decode any audio file to float32 [channels, T] with PyAV (torchaudio.load needs torchcodec)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        rate = stream.rate
        chunks = [frame.to_ndarray() for frame in container.decode(stream)]
        layout_channels = stream.channels
    if not chunks:
        raise ValueError(f"{path}: no audio")
    data = np.concatenate(chunks, axis=1)
    if data.dtype.kind == "i":
        data = data.astype(np.float32) / float(np.iinfo(data.dtype).max + 1)
    data = data.astype(np.float32)
    if data.shape[0] == 1 and layout_channels > 1:  # packed (interleaved) formats
        data = data.reshape(-1, layout_channels).T
    return torch.from_numpy(np.ascontiguousarray(data)), rate


class PromptFrontend:
    """Runs the two ONNX models of the folder; CPU only (the reference runs CAM++ on CPU too)."""

    def __init__(self, folder: str | Path, tokenizer_device: str | torch.device = "cpu"):
        import onnxruntime as ort

        folder = Path(folder)
        for name in (SPEAKER_ONNX, TOKENIZER_ONNX):
            if not (folder / name).is_file():
                raise CheckpointError(f"token2wav folder {folder}: missing {name}")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = 1
        self._speaker = ort.InferenceSession(str(folder / SPEAKER_ONNX), sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self._check_io(self._speaker, SPEAKER_ONNX, n_inputs=1)
        self._s3 = None
        self._tokenizer = None
        self.tokenizer_backend = "onnxruntime"
        if self._is_released_tokenizer(folder / TOKENIZER_ONNX):
            try:
                import s3tokenizer
            except ImportError as exc:
                raise CheckpointError("the released speech tokenizer needs the 's3tokenizer' package "
                                      "(pip install 'lychee-rtc[model]')") from exc
            self._s3 = s3tokenizer.load_model(str(folder / TOKENIZER_ONNX)).to(tokenizer_device).eval()
            self._s3_device = tokenizer_device
            self.tokenizer_backend = "s3tokenizer"
        else:
            self._tokenizer = ort.InferenceSession(str(folder / TOKENIZER_ONNX), sess_options=options,
                                                   providers=["CPUExecutionProvider"])
            self._check_io(self._tokenizer, TOKENIZER_ONNX, n_inputs=2)

    @staticmethod
    def _check_io(session, name: str, n_inputs: int) -> None:
        if len(session.get_inputs()) != n_inputs or not session.get_outputs():
            raise CheckpointError(f"{name}: expected {n_inputs} input(s) and at least one output")

    @staticmethod
    def _is_released_tokenizer(path: Path) -> bool:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        return any(init.name == _S3_V2_MARKER for init in model.graph.initializer)

    def speaker_embedding(self, wav16: torch.Tensor) -> torch.Tensor:
        feat = speaker_fbank(wav16)
        out = self._speaker.run(None, {self._speaker.get_inputs()[0].name: feat.unsqueeze(0).numpy()})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).reshape(1, -1)

    def speech_tokens(self, wav16: torch.Tensor) -> torch.Tensor:
        mels = whisper_log_mel(wav16).unsqueeze(0)  # [1, 128, T]
        if self._s3 is not None:
            lens = torch.tensor([mels.shape[2]], dtype=torch.int32)
            with torch.inference_mode():
                tokens, token_lens = self._s3.quantize(mels.to(self._s3_device), lens.to(self._s3_device))
            return tokens[:, : int(token_lens[0])].to("cpu", torch.int32)
        inputs = self._tokenizer.get_inputs()
        out = self._tokenizer.run(None, {inputs[0].name: mels.numpy().astype(np.float32),
                                         inputs[1].name: np.array([mels.shape[2]], dtype=np.int32)})[0]
        return torch.from_numpy(np.asarray(out).astype(np.int32)).reshape(1, -1)

    def prepare(self, wav: torch.Tensor, sample_rate: int) -> PromptFeatures:
        """wav [channels, T] or [T] float in [-1, 1] at ``sample_rate``."""
        if wav.dim() == 1:
            wav = wav.unsqueeze(0)
        wav = wav.float()
        wav16 = resample(wav[0:1], sample_rate, 16000)[0]  # channel 0, like s3tokenizer.load_audio
        wav24 = resample(wav.mean(dim=0, keepdim=True), sample_rate, 24000)[0]
        tokens = self.speech_tokens(wav16)
        if tokens.shape[1] == 0:
            raise ValueError("prompt too short: it produced no speech tokens")
        embedding = self.speaker_embedding(wav16)
        mel = prompt_mel(wav24, tokens.shape[1])
        return PromptFeatures(tokens=tokens, embedding=embedding, mel=mel)


