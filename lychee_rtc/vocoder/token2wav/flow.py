"""``CausalMaskedDiffWithXvec``: speech tokens (25 Hz) + speaker -> 80-bin mel (50 Hz).

Parameter names mirror flow.pt exactly (``input_embedding``, ``spk_embed_affine_layer``,
``encoder.*``, ``encoder_proj``, ``decoder.estimator.*``) so the state dict loads strictly.

Streaming state lives in ``FlowState`` objects owned by each stream; the module itself holds only
weights and the read-only noise buffer, so one instance serves every session.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cfm import CausalConditionalCFM, EstimatorCache, trim_estimator_cache
from .config import FlowConfig
from .flow_encoder import EncoderCache, UpsampleConformerEncoder

ESTIMATOR_KEEP_FRAMES = 100  # the reference keeps P + 100 estimator frames (2 s) after trimming


@dataclass
class FlowState:
    """Everything one stream's flow needs between hops (batch size 1 tensors)."""

    spk: torch.Tensor  # [1, mel] projected speaker embedding
    prompt_frames: int  # P, prompt mel frames (= 2 x prompt tokens)
    encoder: EncoderCache
    estimator: EstimatorCache

    @property
    def noise_offset(self) -> int:
        return self.estimator.frames


class Flow(nn.Module):
    def __init__(self, cfg: FlowConfig, noise_seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalConditionalCFM(cfg, noise_seed)

    @property
    def dtype(self) -> torch.dtype:
        return self.input_embedding.weight.dtype

    def project_speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        e = F.normalize(embedding.to(self.dtype), dim=1)
        return self.spk_embed_affine_layer(e)

    # -- offline ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def inference(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                  embedding: torch.Tensor) -> torch.Tensor:
        """Whole utterance at once (bidirectional DiT attention). tokens [1,N]; prompt_mel [1,2Np,80].

        Not equal to the streamed output (different attention context); kept for offline use and
        as a check of the modules.
        """
        spk = self.project_speaker(embedding)
        tok = torch.cat([prompt_tokens, tokens], dim=1)
        x = self.input_embedding(tok.clamp(min=0).long())
        cache = self.encoder.empty_cache(1, x.device, x.dtype)
        h, _ = self.encoder.forward_chunk(x, last_chunk=True, cache=cache)
        mu = self.encoder_proj(h).transpose(1, 2)
        p = prompt_mel.shape[1]
        cond = torch.zeros_like(mu)
        cond[:, :, :p] = prompt_mel.transpose(1, 2).to(mu.dtype)
        z = self.decoder.noise(0, mu.shape[2]).to(mu.dtype)
        mel, _, _ = self.decoder.solve(z, mu, spk, cond)
        return mel[:, :, p:]

    # -- streaming -------------------------------------------------------------------------------

    @torch.inference_mode()
    def setup(self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
              embedding: torch.Tensor) -> FlowState:
        """Prime the caches with the prompt (the resulting mel is discarded).

        The encoder needs look-ahead tokens after the prompt; like the reference we append the
        *first* L prompt tokens (tiled if the prompt is shorter).
        """
        la = self.cfg.pre_lookahead_len
        n = prompt_tokens.shape[1]
        filler = prompt_tokens.repeat(1, -(-la // max(n, 1)))[:, :la]
        tokens = torch.cat([prompt_tokens, filler], dim=1)
        if n * self.cfg.up_rate != prompt_mel.shape[1]:
            raise ValueError(f"prompt mel has {prompt_mel.shape[1]} frames, expected {n * self.cfg.up_rate}")
        spk = self.project_speaker(embedding)
        x = self.input_embedding(tokens.long())
        h, enc = self.encoder.forward_chunk(x, last_chunk=False,
                                            cache=self.encoder.empty_cache(1, x.device, x.dtype))
        mu = self.encoder_proj(h).transpose(1, 2)
        z = self.decoder.noise(0, mu.shape[2]).to(mu.dtype)
        _, att, cnn = self.decoder.solve(z, mu, spk, prompt_mel.transpose(1, 2).to(mu.dtype))
        return FlowState(spk=spk, prompt_frames=prompt_mel.shape[1], encoder=enc,
                         estimator=EstimatorCache(att=att, cnn=cnn))

    @torch.inference_mode()
    def chunk(self, states: list[FlowState], tokens: torch.Tensor,
              last_chunk: bool) -> tuple[torch.Tensor, list[FlowState]]:
        """One hop for B streams at once. tokens [B, n] (look-ahead included).

        Returns mel [B, 80, Tm] (Tm = 2(n-L), or 2n when ``last_chunk``) and the new states, with
        the estimator cache already trimmed. Streams may have different cache lengths: caches are
        padded and masked (encoder: left pad; estimator: pad after the oldest frame).
        """
        b = len(states)
        x = self.input_embedding(tokens.long())
        enc, enc_lengths = _stack_encoder([s.encoder for s in states])
        h, new_enc = self.encoder.forward_chunk(x, last_chunk, enc, enc_lengths)
        mu = self.encoder_proj(h).transpose(1, 2)
        tm = mu.shape[2]
        spk = torch.cat([s.spk for s in states], dim=0)
        z = torch.cat([self.decoder.noise(s.noise_offset, tm) for s in states], dim=0).to(mu.dtype)
        att, cnn, est_lengths = _stack_estimator([s.estimator for s in states])
        key_mask = None
        if len(set(est_lengths)) > 1:
            lmax = max(est_lengths)
            ar = torch.arange(tm + lmax, device=mu.device)
            lim = torch.tensor([tm + n for n in est_lengths] * 2, device=mu.device)
            key_mask = ar.unsqueeze(0) < lim.unsqueeze(1)
        mel, new_att, new_cnn = self.decoder.solve(z, mu, spk, torch.zeros_like(mu), att, cnn, key_mask)
        out = []
        for i, s in enumerate(states):
            e_cache = EncoderCache(
                pre_conv=new_enc.pre_conv[i:i + 1], up_conv=new_enc.up_conv[i:i + 1],
                kv=new_enc.kv[:, i:i + 1, :, new_enc.kv.shape[3] - (enc_lengths[i] + h.shape[1] // self.cfg.up_rate):],
                up_kv=new_enc.up_kv[:, i:i + 1, :, new_enc.up_kv.shape[3] - (self.cfg.up_rate * enc_lengths[i] + h.shape[1]):],
            )
            if b == 1:  # the common C1 case: no per-stream gather copy
                a, c = new_att, new_cnn
            else:
                rows = [i, b + i]
                a = new_att[:, :, rows, :, : tm + est_lengths[i]]
                c = new_cnn[:, :, rows]
            a = trim_estimator_cache(a, s.prompt_frames, ESTIMATOR_KEEP_FRAMES)
            out.append(FlowState(spk=s.spk, prompt_frames=s.prompt_frames, encoder=e_cache,
                                 estimator=EstimatorCache(att=a.contiguous(), cnn=c.contiguous())))
        return mel, out


def _stack_encoder(caches: list[EncoderCache]) -> tuple[EncoderCache, list[int]]:
    lengths = [c.kv.shape[3] for c in caches]
    if len(caches) == 1:
        return caches[0], lengths
    lmax = max(lengths)

    def left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
        return F.pad(t, (0, 0, n, 0)) if n else t

    return EncoderCache(
        pre_conv=torch.cat([c.pre_conv for c in caches]),
        up_conv=torch.cat([c.up_conv for c in caches]),
        kv=torch.cat([left_pad(c.kv, lmax - n) for c, n in zip(caches, lengths)], dim=1),
        up_kv=torch.cat([left_pad(c.up_kv, 2 * (lmax - n)) for c, n in zip(caches, lengths)], dim=1),
    ), lengths


def _stack_estimator(caches: list[EstimatorCache]):
    """[steps, depth, 2B, ...] with rows cond_0..cond_B-1, uncond_0..uncond_B-1; pad after oldest."""
    lengths = [c.frames for c in caches]
    if len(caches) == 1:
        return caches[0].att, caches[0].cnn, lengths
    lmax = max(lengths)
    padded = [F.pad(c.att, (0, 0, 0, lmax - n)) if n < lmax else c.att for c, n in zip(caches, lengths)]
    att = torch.cat([p[:, :, 0:1] for p in padded] + [p[:, :, 1:2] for p in padded], dim=2)
    cnn = torch.cat([c.cnn[:, :, 0:1] for c in caches] + [c.cnn[:, :, 1:2] for c in caches], dim=2)
    return att, cnn, lengths
