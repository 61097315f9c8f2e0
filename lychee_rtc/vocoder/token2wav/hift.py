"""HiFT vocoder (neural source filter + iSTFTNet): 80-bin mel at 50 Hz -> 24 kHz waveform.

Weight norm exists only in the checkpoint: the loader folds ``g * v / |v|`` into plain conv
weights, so the modules here are ordinary convolutions.

The excitation has one random input that matters, the additive noise of the sine generator
(``[B, 480*T, harmonics+1]`` standard normal). It can be passed in (tests fix it) or drawn from a
per-stream ``torch.Generator``. The reference also draws a random initial phase that never
reaches the output (the linear down-sampling never reads sample 0), so we do not draw it.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import HiftConfig


def periodic_hann(n: int) -> torch.Tensor:
    """scipy.signal.get_window('hann', n, fftbins=True), computed the way scipy does, as float32."""
    fac = np.linspace(-np.pi, np.pi, n + 1)[:n]
    return torch.from_numpy((0.5 + 0.5 * np.cos(fac)).astype(np.float32))


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, alpha per channel (linear scale)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.view(1, -1, 1)
        return x + (1.0 / (alpha + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=d * (kernel - 1) // 2) for d in dilations)
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + c2(a2(c1(a1(x))))
        return x


class F0Predictor(nn.Module):
    """``ConvRNNF0Predictor``: 5 x (conv k3 -> ELU) -> Linear -> |.| (Hz per mel frame)."""

    def __init__(self, in_channels: int, cond_channels: int, layers: int):
        super().__init__()
        mods: list[nn.Module] = []
        for i in range(layers):
            mods += [nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*mods)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return torch.abs(self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1))


class SourceModule(nn.Module):
    """``SourceModuleHnNSF2`` / ``SineGen2``: harmonic sines from F0, merged to one excitation."""

    def __init__(self, cfg: HiftConfig):
        super().__init__()
        self.cfg = cfg
        self.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)

    def forward(self, f0_up: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """f0_up [B, L, 1] (Hz per sample); noise [B, L, harmonics+1] ~ N(0,1) -> [B, L, 1]."""
        c = self.cfg
        scale = c.samples_per_frame
        harmonics = torch.arange(1, c.nb_harmonics + 2, dtype=torch.float32, device=f0_up.device)
        fn = f0_up * harmonics.view(1, 1, -1)
        rad = (fn / c.sampling_rate) % 1
        # phase is integrated at frame rate and interpolated back: cheap and alias-free
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * np.pi
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=scale, mode="linear").transpose(1, 2)
        sines = torch.sin(phase) * c.nsf_alpha
        uv = (f0_up > c.nsf_voiced_threshold).type(torch.float32)
        noise_amp = uv * c.nsf_sigma + (1 - uv) * c.nsf_alpha / 3
        sine_waves = sines * uv + noise_amp * noise
        return torch.tanh(self.l_linear(sine_waves))


class HiFTGenerator(nn.Module):
    def __init__(self, cfg: HiftConfig):
        super().__init__()
        self.cfg = cfg
        base = cfg.base_channels
        self.m_source = SourceModule(cfg)
        self.conv_pre = nn.Conv1d(cfg.in_channels, base, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(base // 2 ** i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        # the excitation's STFT is brought down to each upsampling stage's rate
        down = np.cumprod([1] + list(cfg.upsample_rates[::-1][:-1]))[::-1]
        n_spec = cfg.n_fft + 2
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k) in enumerate(zip(down, cfg.source_resblock_kernel_sizes)):
            ch = base // 2 ** (i + 1)
            u = int(u)
            self.source_downs.append(nn.Conv1d(n_spec, ch, 1) if u == 1 else nn.Conv1d(n_spec, ch, 2 * u, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, cfg.resblock_dilations))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, cfg.resblock_dilations)
            for i in range(len(cfg.upsample_rates)) for k in cfg.resblock_kernel_sizes)
        self.conv_post = nn.Conv1d(base // 2 ** len(cfg.upsample_rates), n_spec, 7, padding=3)
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.cond_channels, cfg.f0_layers)
        self.register_buffer("stft_window", periodic_hann(cfg.n_fft), persistent=False)

    def noise_shape(self, batch: int, mel_frames: int) -> tuple[int, int, int]:
        return (batch, mel_frames * self.cfg.samples_per_frame, self.cfg.nb_harmonics + 1)

    def draw_noise(self, batch: int, mel_frames: int, generator: torch.Generator | None = None,
                   device=None) -> torch.Tensor:
        """Standard normal noise [B, L, harmonics+1], filled the way the reference's
        ``randn_like`` fills it (a [B, harmonics+1, L] buffer viewed transposed, which takes
        torch's non-contiguous normal_ path), so a seeded generator reproduces its noise."""
        b, n, h = self.noise_shape(batch, mel_frames)
        return torch.empty((b, h, n), device=device).transpose(1, 2).normal_(generator=generator)

    def excitation(self, mel: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        f0 = self.f0_predictor(mel)  # [B, T]
        f0_up = f0.repeat_interleave(self.cfg.samples_per_frame, dim=1).unsqueeze(-1)
        return self.m_source(f0_up, noise).transpose(1, 2)  # [B, 1, L]

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        spec = torch.stft(source.squeeze(1), c.n_fft, c.hop_len, c.n_fft, window=self.stft_window,
                          return_complex=True)
        spec = torch.view_as_real(spec)
        s = torch.cat([spec[..., 0], spec[..., 1]], dim=1)
        x = self.conv_pre(mel)
        n_k = len(c.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s))
            xs = self.resblocks[i * n_k](x)
            for j in range(1, n_k):
                xs += self.resblocks[i * n_k + j](x)
            x = xs / n_k
        x = self.conv_post(F.leaky_relu(x))  # default slope 0.01 here, as in the reference
        half = c.n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :half]), max=1e2)
        phase = torch.sin(x[:, half:])
        wav = torch.istft(torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase)),
                          c.n_fft, c.hop_len, c.n_fft, window=self.stft_window)
        return torch.clamp(wav, -c.audio_limit, c.audio_limit)

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, cache_source: torch.Tensor | None = None,
                noise: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 80, T] -> (wav [B, 480T], excitation [B, 1, 480T]).

        ``cache_source`` [B, 1, Tc] overwrites the head of the excitation (streaming continuity).
        """
        mel = mel.float()
        if noise is None:
            noise = self.draw_noise(mel.shape[0], mel.shape[2], generator, mel.device)
        s = self.excitation(mel, noise)
        if cache_source is not None and cache_source.shape[2] > 0:
            s[:, :, :cache_source.shape[2]] = cache_source
        return self.decode(mel, s), s


