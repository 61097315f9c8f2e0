"""The whole ``lychee`` path on CPU with tiny checkpoints: WebRTC audio in -> Lychee-FD windows ->
speech codes -> Token2Wav PCM -> WebRTC audio out.

The server is started from the GPU profile (configs/lychee-c1.yaml) with its mount points swapped
for a tiny checkpoint and a tiny token2wav/ folder, so the real settings, factory and loaders run.
The tiny model never ends its speech by itself (``TinySpec.endless_speech``), so the client's cancel
always lands on a response that is still speaking, and the cancel path is what this test checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from pathlib import Path

from conftest import running_server
from lychee_rtc.bench.client import RATE, RtcClient
from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint
from lychee_rtc.session.protocol import validate_server_event
from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocoder-rtc")
    lychee = write_tiny_checkpoint(root / "tiny", seed=11, spec=TinySpec(decision_bias=4.0, endless_speech=True))
    return str(lychee), write_tiny_vocoder(root, seed=3)


async def test_lychee_with_token2wav_serves_audio(roots, tmp_path):
    lychee_root, vocoder_section = roots
    # The GPU profile itself, with its model and token2wav/ mount points swapped for the tiny ones.
    profile = yaml.safe_load((ROOT / "configs" / "lychee-c1.yaml").read_text())
    profile["server"]["host"] = "127.0.0.1"
    profile["engine"]["lychee"].update({
        "model_root": lychee_root, "device": "cpu", "dtype": "fp32", "max_seq": 1024, "torch_threads": 1,
        "progress": False, "seed": 1, "token2wav": vocoder_section})  # context sizes follow max_seq
    config = tmp_path / "lychee-c1-tiny.yaml"
    config.write_text(yaml.safe_dump(profile))
    async with running_server(str(config)) as (url, _app):
        client = RtcClient(url)
        await client.connect()
        try:
            await client.wait_event("session.created", timeout=60)
            rng = np.random.default_rng(0)
            client.mic.feed((0.05 * rng.standard_normal(RATE * 30)).astype(np.float32))
            client.send({"type": "input_audio_buffer.commit"})
            started = await client.wait_event("response.created", timeout=60)
            rid = started["response_id"]
            playing = await client.wait_event("output_audio_buffer.started", timeout=60, response_id=rid)
            assert not client.events_of("response.output_audio_codes.delta")  # PCM, not codes
            # Half a second of the answer, by the stream's own positions.
            start = playing["sample_offset"] * RATE // playing["sample_rate"]
            await client.wait_audio(start + RATE // 2)
            heard = client.received.signal(start, start + RATE // 2)
            assert float(np.sqrt(np.mean(heard ** 2))) > 1e-3, "vocoded speech expected"
            # Still speaking: this model has no <tts_end> before max_speech_tokens (40 s of speech).
            assert not client.events_of("response.done")
            client.send({"type": "response.cancel"})
            done = await client.wait_event("response.done", timeout=60, response_id=rid)
            assert done["response"]["status"] == "cancelled"
            # Past the cut, the stream goes on in silence.
            end = await client.wait_event("output_audio_buffer.cleared", timeout=60, response_id=rid)
            cut = end["sample_offset"] * RATE // end["sample_rate"]
            await client.wait_audio(cut + RATE)
            late = [e for e in client.events if e["seq"] > done["seq"] and e.get("response_id") == rid
                    and e["type"].startswith("response.output")]
            assert not late
            # Opus carries the old signal across a cut for up to the packet the cut fell in (20 ms) and
            # its own delay (6.5 ms): measured 0.86-1.04e-3 at 16-22 ms after it, the answer's RMS 0.02.
            # From 30 ms on, everything is silence (measured 0.0).
            tail = client.received.signal(cut + RATE * 3 // 100, cut + RATE)
            assert float(np.abs(tail).max()) < 1e-3, "nothing of the cancelled response may still play"
            for ev in client.events:
                validate_server_event(ev)
            assert playing["epoch"] == started.get("epoch", playing["epoch"])
        finally:
            await client.close()
