"""``Token2Wav``: the loaded checkpoint folder (flow + HiFT + prompt front-end) and its constants.

One instance is shared by every session of an engine: it holds weights and the read-only CFM noise
buffer only. Anything that changes while audio is produced lives in the per-stream objects of
``lychee_rtc.engine.lychee.token2wav_stream``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import FlowConfig, load_flow_config
from .flow import ESTIMATOR_KEEP_FRAMES, Flow, FlowState
from .frontend import PromptFeatures, PromptFrontend, read_audio
from .graphs import use_cuda_graphs
from .hift import HiFTGenerator
from .loader import load_flow, load_hift

SAMPLE_RATE = 24000
MEL_CACHE_FRAMES = 8  # HiFT overlap: 8 mel frames (160 ms) re-vocoded each hop
DEFAULT_HOP = 10


class PromptTooLong(ValueError):
    pass


@dataclass
class Voice:
    """A prepared prompt. ``primed`` is the flow state after the prompt (computed once, shared
    read-only by every stream of this voice: streams never write into it)."""

    name: str
    features: PromptFeatures
    primed: FlowState | None = field(default=None, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def max_prompt_tokens(hop: int = DEFAULT_HOP, estimator_capacity: int = 1000) -> int:
    """The reference's estimator scratch holds 1000 frames and peaks at P + 100 + 2*hop before a
    trim, so P <= 1000 - 100 - 2*hop mel frames (hop 10: 880 frames = 440 tokens = 17.6 s).
    We keep the same limit so a voice that works here works with the reference server too."""
    return (estimator_capacity - ESTIMATOR_KEEP_FRAMES - 2 * hop) // 2


class Token2Wav:
    sample_rate = SAMPLE_RATE

    def __init__(self, flow: Flow, hift: HiFTGenerator, frontend: PromptFrontend | None,
                 device: torch.device, folder: Path | None = None):
        self.flow = flow
        self.hift = hift
        self.frontend = frontend
        self.device = device
        self.folder = folder
        self.config: FlowConfig = flow.cfg
        self.samples_per_frame = hift.cfg.samples_per_frame  # 480
        self.samples_per_token = self.samples_per_frame * self.config.up_rate  # 960
        self.overlap_samples = MEL_CACHE_FRAMES * self.samples_per_frame  # 3840
        w = np.hamming(2 * self.overlap_samples)
        self.crossfade_window = torch.from_numpy(w).to(device)  # float64, as the reference
        self.max_prompt_tokens = max_prompt_tokens()

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, noise_seed: int = 0,
             tokenizer_device: str | torch.device | None = None, cuda_graphs: str = "auto") -> "Token2Wav":
        """Load a released-layout folder. ``dtype`` applies to the flow (HiFT stays fp32).
        ``cuda_graphs``: auto | on | off for the flow's per-hop solve (``graphs.py``)."""
        folder = Path(folder)
        device = torch.device(device)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported flow dtype {dtype}")
        graphed = use_cuda_graphs(cuda_graphs, device)
        config = load_flow_config(folder)
        flow = load_flow(folder, config, device, dtype, noise_seed)
        if graphed:
            flow.decoder.enable_cuda_graphs()
        hift = load_hift(folder, device)
        frontend = PromptFrontend(folder, tokenizer_device or device)
        return cls(flow, hift, frontend, device, folder)

    # -- voices ----------------------------------------------------------------------------------

    def prepare_voice(self, name: str, wav: torch.Tensor | np.ndarray | str | Path,
                      sample_rate: int | None = None) -> Voice:
        """From a prompt recording (path, or samples + rate) to a ready voice."""
        if self.frontend is None:
            raise RuntimeError("this Token2Wav has no prompt front-end")
        if isinstance(wav, (str, Path)):
            wav, sample_rate = read_audio(wav)
        if sample_rate is None:
            raise ValueError("sample_rate is required with raw samples")
        wav = torch.as_tensor(np.asarray(wav, dtype=np.float32))
        seconds = wav.shape[-1] / sample_rate
        limit_s = self.max_prompt_tokens / 25
        if seconds > limit_s + 0.04:
            raise PromptTooLong(f"voice {name!r}: prompt is {seconds:.2f} s; the limit is {limit_s:.1f} s "
                                f"({self.max_prompt_tokens} speech tokens)")
        features = self.frontend.prepare(wav, sample_rate)
        return self.voice_from_features(name, features)

    def voice_from_features(self, name: str, features: PromptFeatures) -> Voice:
        if features.n_tokens > self.max_prompt_tokens:
            raise PromptTooLong(f"voice {name!r}: prompt has {features.n_tokens} speech tokens; "
                                f"the limit is {self.max_prompt_tokens} ({self.max_prompt_tokens / 25:.1f} s)")
        if features.mel.shape[1] != 2 * features.n_tokens:
            raise ValueError(f"voice {name!r}: prompt mel must have 2 frames per token")
        return Voice(name=name, features=features)

    def prime(self, voice: Voice) -> FlowState:
        with voice.lock:
            if voice.primed is None:
                f = voice.features
                voice.primed = self.flow.setup(f.tokens.to(self.device), f.mel.to(self.device),
                                               f.embedding.to(self.device))
            return voice.primed

    # -- offline ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def synthesize(self, tokens: list[int] | torch.Tensor, voice: Voice,
                   generator: torch.Generator | None = None) -> np.ndarray:
        """Whole utterance at once (not equal to streaming; see ``Flow.inference``)."""
        f = voice.features
        tok = torch.as_tensor(tokens, dtype=torch.int32, device=self.device).view(1, -1)
        mel = self.flow.inference(tok, f.tokens.to(self.device), f.mel.to(self.device), f.embedding.to(self.device))
        wav, _ = self.hift(mel.float(), generator=generator)
        return wav[0].float().cpu().numpy()
