"""The whole ``lychee`` path on CPU with tiny checkpoints: WebRTC audio in -> Lychee-FD windows ->
speech codes -> Token2Wav PCM -> WebRTC audio out.

The engine factory does not attach a vocoder yet (wiring listed in docs/token2wav.md); this test
attaches the Token2Wav pool the way the wiring will, by wrapping ``build_lychee_backend``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import running_server
from lychee_rtc.bench.client import RATE, RtcClient
from lychee_rtc.engine.lychee import backend as lychee_backend
from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint
from lychee_rtc.session.protocol import validate_server_event
from lychee_rtc.vocoder.settings import build_token2wav_pool
from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocoder-rtc")
    lychee = write_tiny_checkpoint(root / "tiny", seed=11, spec=TinySpec(decision_bias=4.0))
    return str(lychee), write_tiny_vocoder(root, seed=3)


async def test_lychee_with_token2wav_serves_audio(roots, monkeypatch):
    lychee_root, vocoder_section = roots
    pool = build_token2wav_pool(vocoder_section)
    original = lychee_backend.build_lychee_backend

    def with_vocoder(options, max_sessions, **kw):
        return original(options, max_sessions, vocoder_factory=pool)

    monkeypatch.setattr(lychee_backend, "build_lychee_backend", with_vocoder)
    lychee = {"model_root": lychee_root, "device": "cpu", "dtype": "fp32", "max_seq": 1024, "torch_threads": 1,
              "progress": False, "seed": 1}
    async with running_server("configs/lychee-c1.yaml", server={"host": "127.0.0.1"},
                              engine={"lychee": lychee}) as (url, _app):
        client = RtcClient(url)
        await client.connect()
        try:
            await client.wait_event("session.created", timeout=20)
            rng = np.random.default_rng(0)
            client.mic.feed((0.05 * rng.standard_normal(RATE * 30)).astype(np.float32))
            client.send({"type": "input_audio_buffer.commit"})
            started = await client.wait_event("response.created", timeout=20)
            rid = started["response_id"]
            playing = await client.wait_event("output_audio_buffer.started", timeout=30, response_id=rid)
            assert not client.events_of("response.output_audio_codes.delta")  # PCM, not codes
            await asyncio.sleep(1.0)  # let some vocoded audio arrive
            audio = client.received.signal()
            assert audio.size > RATE // 2
            assert float(np.sqrt(np.mean(audio[-RATE // 2:] ** 2))) > 1e-3, "vocoded speech expected"
            client.send({"type": "response.cancel"})
            done = await client.wait_event("response.done", timeout=10, response_id=rid)
            assert done["response"]["status"] in ("cancelled", "completed")
            await asyncio.sleep(1.0)
            late = [e for e in client.events if e["seq"] > done["seq"] and e.get("response_id") == rid
                    and e["type"].startswith("response.output")]
            assert not late
            tail = client.received.signal()[-RATE // 2:]
            assert float(np.abs(tail).max()) < 1e-3, "nothing of the cancelled response may still play"
            for ev in client.events:
                validate_server_event(ev)
            assert playing["epoch"] == started.get("epoch", playing["epoch"])
        finally:
            await client.close()
