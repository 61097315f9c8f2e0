"""Conditional flow matching decoder: Euler ODE with a cosine time schedule and CFG.

The velocity is evaluated on a batch of [conditional; unconditional] rows
(``v = (1+r)*v_cond - r*v_uncond``, r = ``inference_cfg_rate``). In streaming every Euler step has
its own estimator cache, because the cached keys/values depend on the step's x.

Noise comes from a fixed buffer ``[1, 80, noise_frames]`` indexed by the stream's estimator cache
length, as in the reference. The buffer is drawn from a seeded generator (the reference draws it
unseeded at construction, so its exact values are not reproducible anyway) and can be replaced with
``set_noise`` for parity tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import FlowConfig
from .dit import DiT
from .graphs import GraphedSolve


@dataclass
class EstimatorCache:
    """Per-stream estimator state: one slot per Euler step, CFG rows (cond, uncond) on dim 2."""

    att: torch.Tensor  # [steps, depth, 2, H, L, 2*head_dim], newest frame first
    cnn: torch.Tensor  # [steps, depth, 2, 2*hidden, 2]

    @property
    def frames(self) -> int:
        return self.att.shape[4]


def cosine_t_span(n_timesteps: int, device, dtype) -> torch.Tensor:
    t = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(t * 0.5 * torch.pi)


def trim_estimator_cache(att: torch.Tensor, prompt_frames: int, keep: int = 100) -> torch.Tensor:
    """The reference's trim, applied once the cache exceeds ``prompt_frames + keep`` frames.

    The time axis is newest-first, so ``cat(att[:P], att[-keep:])`` keeps the newest P frames and
    the ``keep`` oldest ones (the prompt's tail once P frames have been generated). The intent in
    the reference comments is "prompt + last 100", but the trimmed set is what the released model
    is served with, so we reproduce it exactly.
    """
    if att.shape[4] <= prompt_frames + keep:
        return att
    return torch.cat([att[:, :, :, :, :prompt_frames], att[:, :, :, :, -keep:]], dim=4)


class CausalConditionalCFM(nn.Module):
    def __init__(self, cfg: FlowConfig, noise_seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.estimator = DiT(cfg.estimator)
        self.cfg_rate = cfg.inference_cfg_rate
        g = torch.Generator().manual_seed(noise_seed)
        noise = torch.randn(1, cfg.output_size, cfg.noise_frames, generator=g)
        self.register_buffer("rand_noise", noise, persistent=False)
        self.graphs: GraphedSolve | None = None  # CUDA graphs of the solve (graphs.py), when enabled
        self.use_graphs = True

    def enable_cuda_graphs(self, max_graphs: int = 4) -> None:
        self.graphs = GraphedSolve(self._solve, max_graphs=max_graphs)

    def set_noise(self, noise: torch.Tensor) -> None:
        if noise.shape[:2] != self.rand_noise.shape[:2]:
            raise ValueError(f"noise must be [1, {self.rand_noise.shape[1]}, N], got {tuple(noise.shape)}")
        self.rand_noise = noise.to(self.rand_noise.device, self.rand_noise.dtype)

    def noise(self, offset: int, frames: int) -> torch.Tensor:
        if offset + frames > self.rand_noise.shape[2]:
            raise RuntimeError(f"CFM noise buffer exhausted ({offset}+{frames} > {self.rand_noise.shape[2]} frames)")
        return self.rand_noise[:, :, offset:offset + frames]

    def solve(self, z: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
              att: torch.Tensor | None = None, cnn: torch.Tensor | None = None,
              key_mask: torch.Tensor | None = None, n_timesteps: int | None = None):
        """Euler from noise ``z`` [B,C,T] to a mel.

        att/cnn: caches batched as ``[steps, depth, 2B, ...]`` (rows cond_0..cond_B-1, uncond_...)
        or None; key_mask [2B, T+L] for padded caches. Returns (x, new_att, new_cnn) with the new
        caches in the same batched layout.
        """
        # Streaming hops only (caches present): priming a voice is a one-off shape.
        streaming = att is not None and cnn is not None
        if self.graphs is not None and self.use_graphs and streaming and n_timesteps in (None, self.cfg.n_timesteps):
            return self.graphs(z, mu, spks, cond, att, cnn, key_mask)
        return self._solve(z, mu, spks, cond, att, cnn, key_mask, n_timesteps)

    def _solve(self, z, mu, spks, cond, att=None, cnn=None, key_mask=None, n_timesteps: int | None = None):
        n = n_timesteps or self.cfg.n_timesteps
        t_span = cosine_t_span(n, mu.device, mu.dtype)
        b = z.shape[0]
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)
        spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)
        cond_in = torch.cat([cond, torch.zeros_like(cond)], dim=0)
        x = z
        t = t_span[0].unsqueeze(0)
        dt = t_span[1] - t_span[0]
        new_att, new_cnn = [], []
        for step in range(1, n + 1):
            v, a, c = self.estimator(
                torch.cat([x, x], dim=0), mu_in, torch.cat([t.expand(b), t.expand(b)]),
                spks_in, cond_in,
                None if att is None else att[step - 1],
                None if cnn is None else cnn[step - 1],
                key_mask)
            new_att.append(a)
            new_cnn.append(c)
            v_cond, v_uncond = v[:b], v[b:]
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
            t = t + dt
            if step < n:  # dt is measured from the accumulated t, as in the reference
                dt = t_span[step + 1] - t
        return x, torch.stack(new_att), torch.stack(new_cnn)
