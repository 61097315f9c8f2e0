"""Audio front-end, Whisper-style encoder and adapter of Lychee-FD.

Every 400 ms window (6400 samples at 16 kHz) is encoded on its own: the reference normalises the
log-mel per window and gives the encoder no context across windows, so a window's five output
vectors depend on that window only. That is what lets the runner encode each slot's window once,
batched with the other slots, with no per-session audio state.

Module and parameter names follow the checkpoint (``encoder.blocks.{i}.attn.query`` ...), so the
encoder and adapter load strictly by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchaudio.functional as AF
from torch import Tensor, nn

from .config import AudioEncoderConfig

SAMPLE_RATE = 16000
WINDOW_SAMPLES = 6400  # 400 ms
N_FFT = 400
HOP = 160
PAD_SAMPLES = 479  # right zero-pad before the STFT (reference quirk, keeps 42 frames per window)
FEATURES_PER_WINDOW = 5  # 12.5 Hz adapter output; one every other 40 ms position


def mel_filterbank(n_mels: int = 128, device: torch.device | None = None) -> Tensor:
    """(n_mels, n_fft//2+1) Slaney mel filters, the same as librosa.filters.mel(16000, 400, 128)."""
    fb = AF.melscale_fbanks(
        n_freqs=N_FFT // 2 + 1,
        f_min=0.0,
        f_max=SAMPLE_RATE / 2,
        n_mels=n_mels,
        sample_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    return fb.T.contiguous().to(device=device, dtype=torch.float32)


def log_mel(windows: Tensor, filters: Tensor) -> Tensor:
    """(B, N) float waveforms -> (B, n_mels, frames) normalised log-mel, one max per window.

    N = 6400 gives 42 frames. The max is taken per window (not per batch) so that batching the
    windows of several sessions never lets one session's loudness change another's features.
    """
    x = F.pad(windows.float(), (0, PAD_SAMPLES))
    window = torch.hann_window(N_FFT, device=x.device)
    stft = torch.stft(x, N_FFT, HOP, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2  # the reference drops the last frame
    mel = filters @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    peak = log_spec.amax(dim=(-2, -1), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return (log_spec + 4.0) / 4.0


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n_head

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        # The reference scales q and k by d^-1/4 each and adds a -1e10 bias on padded keys; a
        # boolean mask with the combined d^-1/2 scale is the same function.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(b, t, d))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.mlp = nn.Sequential(nn.Linear(n_state, 4 * n_state), nn.GELU(), nn.Linear(4 * n_state, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        x = x + self.attn(self.attn_ln(x), key_mask)
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    """conv1 -> conv2 (stride 2) -> +pos -> blocks -> avgpool(2) -> after_norm."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        s = cfg.n_audio_state
        self.conv1 = nn.Conv1d(cfg.n_mels, s, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(s, s, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = nn.Embedding(cfg.n_audio_ctx, s)
        self.blocks = nn.ModuleList(ResidualAttentionBlock(s, cfg.n_audio_head) for _ in range(cfg.n_audio_layer))
        self.avg_pooler = nn.AvgPool1d(2, stride=2)
        self.after_norm = nn.LayerNorm(s)

    def forward(self, mel: Tensor, mel_lengths: Tensor) -> Tensor:
        """mel (B, n_mels, T) with valid lengths (B,) -> (B, T//4, n_state)."""
        x, key_mask = self.stem(mel, mel_lengths)
        for block in self.blocks:
            x = block(x, key_mask)
        return self.finish(x)

    def stem(self, mel: Tensor, mel_lengths: Tensor) -> tuple[Tensor, Tensor]:
        """The convolutions and positions before the blocks: (x (B, ceil(T/2), s), key mask)."""
        t = mel.shape[-1]
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # (B, ceil(T/2), s)
        # Key mask on the stride-2 grid, taken exactly as the reference does: frame i of conv2's
        # output is valid iff input frame (T+1)%2 + 2i is inside the valid length.
        grid = torch.arange(t, device=mel.device)[(t + 1) % 2 :: 2]
        key_mask = grid[None, :] < mel_lengths[:, None]
        return x + self.positional_embedding.weight[: x.shape[1]], key_mask

    def finish(self, x: Tensor) -> Tensor:
        """After the blocks: average pool by 2, final norm."""
        x = self.avg_pooler(x.transpose(1, 2)).transpose(1, 2)
        return self.after_norm(x)


class Adaptor(nn.Module):
    """GELU(conv k3 s2) -> linear1 -> ReLU -> linear2: encoder width -> LLM width at 12.5 Hz."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        s = cfg.n_audio_state
        self.conv = nn.Conv1d(s, s, cfg.kernel_size, cfg.adapter_stride, padding=1)
        self.linear1 = nn.Linear(s, 2048)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(2048, cfg.llm_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.linear2(self.relu(self.linear1(x)))


def encode_windows(encoder: AudioEncoder, adapter: Adaptor, filters: Tensor, windows: Tensor) -> Tensor:
    """(B, 6400) float32 windows -> (B, 5, llm_dim) features in the encoder's dtype."""
    if windows.shape[-1] != WINDOW_SAMPLES:
        raise ValueError(f"expected {WINDOW_SAMPLES}-sample windows, got {windows.shape[-1]}")
    mel, lengths = window_mel(windows, filters)
    feats = adapter(encoder(mel.to(encoder.conv1.weight.dtype), lengths))
    return feats[:, :FEATURES_PER_WINDOW]


def window_mel(windows: Tensor, filters: Tensor) -> tuple[Tensor, Tensor]:
    """(B, 6400) windows -> log-mel (B, n_mels, 42) and its valid lengths (B,) (40 frames)."""
    mel = log_mel(windows, filters)
    return mel, torch.full((mel.shape[0],), mel.shape[-1] - 2, device=mel.device)
