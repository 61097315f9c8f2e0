"""The flow's token encoder: ``UpsampleConformerEncoderV2`` with explicit streaming caches.

Token embeddings (25 Hz) -> Linear/LayerNorm/xscale -> pre-look-ahead convs -> conformer stack ->
nearest x2 upsample + causal conv -> Linear/LayerNorm/xscale -> conformer stack -> LayerNorm
(50 Hz, one frame per mel frame).

Only the chunked ("streaming") form exists here. The offline form of the reference is the same
computation with no caches and ``last_chunk=True`` (the right zero pad of the look-ahead conv is
what ``last_chunk`` appends), so one code path serves both.

Several streams may run in one batch: each stream's attention cache is left-padded to the longest
one and the padding is masked. Left padding shifts query and key positions equally, so the relative
positions (the only positional input) are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig


@dataclass
class EncoderCache:
    """Per-stream encoder state (batch size 1), oldest frame first on every time axis."""

    pre_conv: torch.Tensor  # [1, D, 2]  last two conv1 outputs of the look-ahead layer
    up_conv: torch.Tensor  # [1, D, 2*stride]  last upsampled frames before the up conv
    kv: torch.Tensor  # [num_blocks, 1, H, Lt, 2*dk]  token-rate stack keys|values
    up_kv: torch.Tensor  # [num_up_blocks, 1, H, 2*Lt, 2*dk]  frame-rate stack keys|values

    @property
    def tokens(self) -> int:
        return self.kv.shape[3]


def rel_position_rows(d_model: int, r_max: int, r_min: int, device, dtype) -> torch.Tensor:
    """EspNet rel-pos encodings for r = r_max, r_max-1, ..., r_min (descending), [1, n, d_model].

    Computed from the formula instead of slicing a fixed 5000-row table, so lengths past the
    table behave like the reference's own offline path (which re-extends its table) instead of the
    reference's streaming path (which silently slices with a negative start).
    """
    r = torch.arange(r_max, r_min - 1, -1, dtype=torch.float32, device=device).unsqueeze(1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32, device=device)
                    * -(math.log(10000.0) / d_model))
    pe = torch.zeros(r.shape[0], d_model, device=device)
    pe[:, 0::2] = torch.sin(r * div)
    pe[:, 1::2] = torch.cos(r * div)
    return pe.unsqueeze(0).to(dtype)


class LinearEmbed(nn.Module):
    """``LinearNoSubsampling``: Linear -> LayerNorm(eps 1e-5) -> x sqrt(D)."""

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    """Transformer-XL style attention with learned biases u, v (ESPnet ``rel_selfattn``)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.output_size
        self.h, self.d_k = cfg.attention_heads, cfg.head_dim
        self.linear_q = nn.Linear(d, d)
        self.linear_k = nn.Linear(d, d, bias=cfg.key_bias)
        self.linear_v = nn.Linear(d, d)
        self.linear_out = nn.Linear(d, d)
        self.linear_pos = nn.Linear(d, d, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(self.h, self.d_k))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.d_k).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None, key_mask: torch.Tensor | None,
                pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B,T,D]; cache [B,H,Lc,2dk] (oldest first); key_mask [B, Lc+T] bool or None;
        pe: ``rel_position_rows`` for r = Lc+T-1 .. -(T-1)."""
        b, t, _ = x.shape
        q = self._heads(self.linear_q(x))
        k = self._heads(self.linear_k(x))
        v = self._heads(self.linear_v(x))
        if cache is not None and cache.shape[2] > 0:
            k_cache, v_cache = cache.split(self.d_k, dim=-1)
            k = torch.cat([k_cache, k], dim=2)
            v = torch.cat([v_cache, v], dim=2)
        new_cache = torch.cat([k, v], dim=-1)
        n_keys = k.shape[2]
        # Query i sits at absolute position n_keys - t + i, key j at j: r = n_keys - t + i - j,
        # which spans [-(t-1), n_keys-1]. Rows are ordered r descending, so row(r) = n_keys-1-r.
        p = self.linear_pos(pe).view(1, -1, self.h, self.d_k).transpose(1, 2)  # [1,H,n_keys+t-1,dk]
        u = self.pos_bias_u.unsqueeze(1)  # [H,1,dk]
        vb = self.pos_bias_v.unsqueeze(1)
        matrix_ac = torch.matmul(q + u, k.transpose(-2, -1))  # [B,H,t,n_keys]
        matrix_bd = torch.matmul(q + vb, p.transpose(-2, -1))  # [B,H,t,n_keys+t-1]
        i = torch.arange(t, device=x.device).unsqueeze(1)
        j = torch.arange(n_keys, device=x.device).unsqueeze(0)
        index = (t - 1 - i + j).expand(b, self.h, t, n_keys)
        matrix_bd = torch.gather(matrix_bd, -1, index)
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        if key_mask is not None:
            blocked = ~key_mask[:, None, None, :]
            scores = scores.masked_fill(blocked, float("-inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(blocked, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out), new_cache


class FeedForward(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(d, hidden)
        self.w_2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm; no macaron FF and no conv module in this checkpoint (so no extra norms)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.self_attn = RelPositionAttention(cfg)
        self.feed_forward = FeedForward(cfg.output_size, cfg.linear_units)
        self.norm_mha = nn.LayerNorm(cfg.output_size, eps=1e-12)
        self.norm_ff = nn.LayerNorm(cfg.output_size, eps=1e-12)

    def forward(self, x, cache, key_mask, pe):
        att, new_cache = self.self_attn(self.norm_mha(x), cache, key_mask, pe)
        x = x + att
        x = x + self.feed_forward(self.norm_ff(x))
        return x, new_cache


class PreLookaheadLayer(nn.Module):
    """conv1 sees frames t..t+L (look-ahead), conv2 sees conv1 outputs t-2..t (causal)."""

    def __init__(self, channels: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, D] with the look-ahead frames included -> [B, n-L, D]."""
        y = F.leaky_relu(self.conv1(x.transpose(1, 2)))
        y = torch.cat([cache, y], dim=2)
        new_cache = y[..., -2:]
        y = self.conv2(y).transpose(1, 2)
        return y + x[:, : x.shape[1] - self.lookahead], new_cache


class UpsampleConv(nn.Module):
    """Nearest x stride, then a causal conv of width 2*stride+1 fed by the cached frames."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, D, T] -> [B, D, stride*T]."""
        y = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        y = torch.cat([cache, y], dim=2)
        new_cache = y[..., -2 * self.stride:]
        return self.conv(y), new_cache


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.output_size
        self.embed = LinearEmbed(cfg.input_size, d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_blocks))
        self.up_layer = UpsampleConv(d, cfg.up_stride)
        self.up_embed = LinearEmbed(cfg.input_size, d)
        self.up_encoders = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_up_blocks))
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def empty_cache(self, batch: int, device, dtype) -> EncoderCache:
        c = self.cfg
        d, h, dk = c.output_size, c.attention_heads, c.head_dim
        return EncoderCache(
            pre_conv=torch.zeros(batch, d, 2, device=device, dtype=dtype),
            up_conv=torch.zeros(batch, d, 2 * c.up_stride, device=device, dtype=dtype),
            kv=torch.zeros(c.num_blocks, batch, h, 0, 2 * dk, device=device, dtype=dtype),
            up_kv=torch.zeros(c.num_up_blocks, batch, h, 0, 2 * dk, device=device, dtype=dtype),
        )

    def forward_chunk(self, xs: torch.Tensor, last_chunk: bool, cache: EncoderCache,
                      lengths: list[int] | None = None) -> tuple[torch.Tensor, EncoderCache]:
        """xs: token embeddings [B, n, D_in] including the look-ahead tokens.

        Returns frames [B, stride*(n-L), D] (or stride*n when ``last_chunk``) and the new cache.
        ``lengths``: true token-rate cache length per batch row when ``cache.kv`` is left-padded.
        """
        x = self.embed(xs)
        if last_chunk:  # the reference zero-pads the look-ahead *after* the embedding
            x = F.pad(x, (0, 0, 0, self.cfg.pre_lookahead_len))
        x, pre_conv = self.pre_lookahead_layer(x, cache.pre_conv)
        t1 = x.shape[1]
        lt = cache.kv.shape[3]
        mask1 = mask2 = None
        if lengths is not None and any(n != lt for n in lengths):
            ar = torch.arange(lt + t1, device=xs.device)
            starts = torch.tensor([lt - n for n in lengths], device=xs.device)
            mask1 = ar.unsqueeze(0) >= starts.unsqueeze(1)
            s = self.cfg.up_stride
            ar2 = torch.arange(s * (lt + t1), device=xs.device)
            mask2 = ar2.unsqueeze(0) >= (s * starts).unsqueeze(1)
        d = self.cfg.output_size
        pe = rel_position_rows(d, lt + t1 - 1, -(t1 - 1), xs.device, x.dtype)
        new_kv = []
        for idx, layer in enumerate(self.encoders):
            x, kv = layer(x, cache.kv[idx], mask1, pe)
            new_kv.append(kv)
        y, up_conv = self.up_layer(x.transpose(1, 2), cache.up_conv)
        x = self.up_embed(y.transpose(1, 2))
        l2, t2 = cache.up_kv.shape[3], x.shape[1]
        pe = rel_position_rows(d, l2 + t2 - 1, -(t2 - 1), xs.device, x.dtype)
        new_up_kv = []
        for idx, layer in enumerate(self.up_encoders):
            x, kv = layer(x, cache.up_kv[idx], mask2, pe)
            new_up_kv.append(kv)
        x = self.after_norm(x)
        return x, EncoderCache(pre_conv=pre_conv, up_conv=up_conv,
                               kv=torch.stack(new_kv), up_kv=torch.stack(new_up_kv))
