"""The CFM velocity estimator: a DiT with adaLN-Zero, q/k LayerNorm and a causal conv branch.

No positional encoding of any kind: a chunk attends to itself and to every cached frame, so only
the *set* of cached frames matters. Caches are explicit tensors passed in and returned.

Cache layout (one Euler step): keys|values ``[depth, B, H, L, 2*head_dim]``, **newest frame
first** (the new chunk is prepended), and conv history ``[depth, B, 2*hidden, 2]`` (the inputs of
the two causal convs). Keeping the reference's newest-first order keeps the float summation order
of attention identical, and its trimming rule (see ``cfm.trim_estimator_cache``) is defined on it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import DiTConfig


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of 1000*t (cos half first) -> MLP."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        # Made on t's device: a host-to-device copy here could not be captured in a CUDA graph.
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half).to(t)
        args = (t * 1000)[:, None] * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class Attention(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.h, self.dk = cfg.num_heads, cfg.head_dim
        inner = cfg.num_heads * cfg.head_dim
        self.to_q = nn.Linear(cfg.hidden_size, inner)
        self.to_k = nn.Linear(cfg.hidden_size, inner)
        self.to_v = nn.Linear(cfg.hidden_size, inner)
        self.q_norm = nn.LayerNorm(cfg.head_dim)
        self.k_norm = nn.LayerNorm(cfg.head_dim)
        self.proj = nn.Linear(inner, cfg.hidden_size)

    def forward(self, x, cache, key_mask):
        """x [B,T,C]; cache [B,H,L,2dk] newest first or None; key_mask [B, T+L] or None."""
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, t, self.h, self.dk).transpose(1, 2)

        q = self.q_norm(heads(self.to_q(x)))
        k = self.k_norm(heads(self.to_k(x)))
        v = heads(self.to_v(x))
        if cache is not None and cache.shape[2] > 0:
            k_cache, v_cache = cache.chunk(2, dim=3)
            k = torch.cat([k, k_cache], dim=2)
            v = torch.cat([v, v_cache], dim=2)
        new_cache = torch.cat([k, v], dim=3)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1)), new_cache


class CausalConv(nn.Conv1d):
    """Conv1d whose left context comes from the previous chunk (zeros at the start)."""

    def forward_chunk(self, x: torch.Tensor, history: torch.Tensor | None):
        ctx = self.kernel_size[0] - 1
        if history is None:
            history = x.new_zeros(x.shape[0], x.shape[1], ctx)
        x = torch.cat([history, x], dim=2)
        return super().forward(x), x[..., -ctx:]


class ConvBlock(nn.Module):
    """CausalConv -> LayerNorm -> Mish -> CausalConv; the state_dict indices (1, 3, 6) match the
    reference's Sequential (Transpose, conv, Transpose, norm, Mish, Transpose, conv, Transpose)."""

    def __init__(self, channels: int):
        super().__init__()
        self.channels = channels
        self.block = nn.ModuleDict({
            "1": CausalConv(channels, channels, 3),
            "3": nn.LayerNorm(channels),
            "6": CausalConv(channels, channels, 3),
        })

    def forward(self, x: torch.Tensor, history: torch.Tensor | None):
        """x [B,T,C]; history [B, 2C, 2] (conv1 input ++ conv2 input)."""
        h1 = h2 = None
        if history is not None:
            h1, h2 = history.split(self.channels, dim=1)
        y, n1 = self.block["1"].forward_chunk(x.transpose(1, 2), h1)
        y = F.mish(self.block["3"](y.transpose(1, 2)))
        y, n2 = self.block["6"].forward_chunk(y.transpose(1, 2), h2)
        return y.transpose(1, 2), torch.cat([n1, n2], dim=1)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        c = cfg.hidden_size
        self.norm1 = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.norm3 = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp = MLP(c, cfg.mlp_hidden)
        self.conv = ConvBlock(c)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c, 9 * c))

    def forward(self, x, c, att_cache, cnn_cache, key_mask):
        (sh_msa, sc_msa, g_msa, sh_mlp, sc_mlp, g_mlp,
         sh_conv, sc_conv, g_conv) = self.adaLN_modulation(c).chunk(9, dim=-1)
        a, new_att = self.attn(modulate(self.norm1(x), sh_msa, sc_msa), att_cache, key_mask)
        x = x + g_msa * a
        # order is attention, conv, MLP (the conv branch uses norm3, the MLP norm2)
        y, new_cnn = self.conv(modulate(self.norm3(x), sh_conv, sc_conv), cnn_cache)
        x = x + g_conv * y
        x = x + g_mlp * self.mlp(modulate(self.norm2(x), sh_mlp, sc_mlp))
        return x, new_att, new_cnn


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.t_embedder = TimestepEmbedder(cfg.hidden_size)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg.hidden_size, cfg.out_channels)

    def forward(self, x, mu, t, spks, cond, att_cache=None, cnn_cache=None, key_mask=None):
        """One velocity evaluation.

        x, mu, cond [B, C, T]; t [B]; spks [B, C]; att_cache [depth, B, H, L, 2dk] (newest first)
        or None; cnn_cache [depth, B, 2*hidden, 2] or None; key_mask [B, T+L] or None.
        Returns velocity [B, C, T] and the new caches (attention: new chunk prepended).
        """
        c = self.t_embedder(t).unsqueeze(1)
        spk = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        h = self.in_proj(torch.cat([x, mu, spk, cond], dim=1).transpose(1, 2))
        new_att, new_cnn = [], []
        for i, block in enumerate(self.blocks):
            h, a, k = block(h, c,
                            None if att_cache is None else att_cache[i],
                            None if cnn_cache is None else cnn_cache[i],
                            key_mask)
            new_att.append(a)
            new_cnn.append(k)
        out = self.final_layer(h, c).transpose(1, 2)
        return out, torch.stack(new_att), torch.stack(new_cnn)
