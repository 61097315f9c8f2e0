"""CUDA graphs of the flow's per-hop solve: the switch, the eager path on CPU tensors, and (with CUDA
only, also run by scripts/gpu_run.sh) graph replay against eager streaming."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lychee_rtc.bench.token2wav_bench import random_model, random_voice
from lychee_rtc.engine.lychee.token2wav_settings import Token2WavSettings, VocoderSettingsError
from lychee_rtc.engine.lychee.token2wav_stream import VocoderStream, synthesize_hops
from lychee_rtc.vocoder.token2wav.graphs import GraphedSolve, signature, use_cuda_graphs
from lychee_rtc.vocoder.token2wav.model import Token2Wav
from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder
from strict import CUDA_REASON_PREFIX


@pytest.fixture(scope="module")
def vocoder_dir(tmp_path_factory):
    return write_tiny_vocoder(tmp_path_factory.mktemp("t2w-graphs"), seed=1)


def stream_pcm(model: Token2Wav, hops: int, streams: int = 2) -> list[np.ndarray]:
    voices = [random_voice(model, 30, seed=i) for i in range(streams)]
    ss = [VocoderStream(model, v, 0, f"r{i}", seed=i) for i, v in enumerate(voices)]
    g = torch.Generator().manual_seed(0)
    pcm: list[list[np.ndarray]] = [[] for _ in ss]
    for k in range(hops):
        for s in ss:
            s.feed(torch.randint(0, model.config.vocab_size, (13 if k == 0 else 10,), generator=g).tolist(),
                   0, s.response_id, k)
        for i, events in enumerate(synthesize_hops(ss)):
            pcm[i] += [e.pcm for e in events if hasattr(e, "pcm")]
    return [np.concatenate(p) if p else np.zeros(0, np.float32) for p in pcm]


def test_switch_selects_graphs_only_on_cuda(vocoder_dir):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_cuda_graphs("auto", cpu) is False and use_cuda_graphs("auto", cuda) is True
    assert use_cuda_graphs("off", cuda) is False
    with pytest.raises(ValueError, match="needs a CUDA device"):
        use_cuda_graphs("on", cpu)
    model = Token2Wav.load(vocoder_dir["folder"], device="cpu")
    assert model.flow.decoder.graphs is None  # auto on a CPU: eager
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Token2Wav.load(vocoder_dir["folder"], device="cpu", cuda_graphs="on")
    s = Token2WavSettings.from_mapping(dict(vocoder_dir) | {"cuda_graphs": "off"})
    assert s.cuda_graphs == "off"
    assert Token2WavSettings.from_mapping(dict(vocoder_dir) | {"cuda_graphs": False}).cuda_graphs == "off"
    with pytest.raises(VocoderSettingsError, match=r"token2wav\.cuda_graphs"):
        Token2WavSettings.from_mapping(dict(vocoder_dir) | {"cuda_graphs": "always"})
    with pytest.raises(VocoderSettingsError, match=r"token2wav\.cuda_graphs"):
        Token2WavSettings.from_mapping(dict(vocoder_dir) | {"cuda_graphs": "on", "device": "cpu"})


def test_graph_switch_on_cpu_tensors_runs_the_eager_solve_and_captures_nothing():
    # With the switch on, every streaming solve goes through GraphedSolve; on CPU tensors it must
    # hand them to the eager solve untouched (CUDA graphs exist only on CUDA). Graph replay against
    # eager is the CUDA test below.
    torch.set_num_threads(1)
    eager = random_model("tiny", "cpu", torch.float32)
    graphed = random_model("tiny", "cpu", torch.float32)
    graphed.flow.decoder.enable_cuda_graphs(max_graphs=2)
    g = graphed.flow.decoder.graphs
    assert g is not None
    calls = []
    solve = g.fn
    g.fn = lambda *args: calls.append(len(args)) or solve(*args)
    a, b = stream_pcm(eager, 4), stream_pcm(graphed, 4)
    assert calls  # the solves went through the graph switch
    assert all(len(x) > 0 and np.array_equal(x, y) for x, y in zip(a, b))
    assert g.captures == 0 and g.replays == 0 and not g.seen


def test_signature_tells_shapes_dtypes_and_missing_inputs_apart():
    x = torch.zeros(2, 3)
    assert signature([x, None]) == signature([torch.ones(2, 3), None])
    assert signature([x, None]) != signature([x, x])
    assert signature([x]) != signature([x.double()]) != signature([torch.zeros(3, 2)])
    with pytest.raises(ValueError):
        GraphedSolve(lambda: (), max_graphs=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{CUDA_REASON_PREFIX}: graph capture and replay")
def test_replayed_solve_streams_the_eager_audio():  # pragma: no cover - GPU only
    eager = random_model("tiny", "cuda", torch.float32)
    graphed = random_model("tiny", "cuda", torch.float32)
    graphed.flow.decoder.enable_cuda_graphs(max_graphs=2)
    a, b = stream_pcm(eager, 12), stream_pcm(graphed, 12)
    g = graphed.flow.decoder.graphs
    assert g is not None and g.captures >= 1 and g.replays > g.captures  # steady-state shapes repeat
    assert len(g.graphs) <= 2
    for x, y in zip(a, b):
        assert len(x) == len(y) > 0
        assert np.abs(x - y).max() < 1e-4
