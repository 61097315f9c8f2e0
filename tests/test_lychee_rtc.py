"""A real WebRTC session served by the ``lychee`` engine with a tiny random checkpoint on CPU.

aiortc client -> Opus -> server -> 16 kHz windows -> Lychee-FD (tiny, released layout) -> text and
speech codes back as data-channel events. No vocoder is attached yet, so the path ends at codes
and the events say so (``vocoder: false``).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import running_server, wait_until
from lychee_rtc.bench.client import RATE, RtcClient
from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint
from lychee_rtc.session.protocol import validate_server_event


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory) -> str:
    spec = TinySpec(decision_bias=4.0)  # listens until asked, then talks until <tts_end>
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("lychee-rtc") / "tiny", seed=11, spec=spec))


async def test_lychee_tiny_serves_a_webrtc_session(tiny_root):
    lychee = {"model_root": tiny_root, "device": "cpu", "dtype": "fp32", "max_seq": 1024, "torch_threads": 1,
              "progress": False, "seed": 1, "token2wav": None}  # no vocoder: the path ends at codes
    async with running_server("configs/lychee-c1.yaml", server={"host": "127.0.0.1"},
                              engine={"lychee": lychee}) as (url, _app):
        client = RtcClient(url)
        await client.connect(session={"metrics": True})  # a metrics event per engine window
        try:
            created = await client.wait_event("session.created", timeout=60)
            # The context policy, from the engine: the system prompt (37 byte tokens here) always
            # stays, the recent conversation slides (derived from max_seq 1024: 1024 // 5 dropped
            # per slide, 1024 - 200 - 37 - 20 kept).
            assert created["session"]["capabilities"]["context"] == {
                "mode": "sliding", "max_positions": 1024, "positions_per_second": 25.0, "sink_positions": 37,
                "window_positions": 760, "slide_positions": 200}
            rng = np.random.default_rng(0)
            client.mic.feed((0.05 * rng.standard_normal(RATE * 30)).astype(np.float32))
            client.send({"type": "input_audio_buffer.commit"})  # "answer now": the next decision is S-S
            started = await client.wait_event("response.created", timeout=60)
            rid = started["response_id"]
            first = await client.wait_event("response.output_audio_codes.delta", timeout=60)
            assert first["response_id"] == rid and first["vocoder"] is False
            await client.wait_event("response.output_audio_transcript.delta", timeout=60)
            # Speech lags text by the delay prefix: codes start in the second speaking window.
            client.send({"type": "response.cancel"})
            done = await client.wait_event("response.done", timeout=60)
            assert done["response"]["status"] == "cancelled"
            codes = [c for e in client.events if e["type"] == "response.output_audio_codes.delta" for c in e["codes"]]
            assert codes and all(0 <= c < 64 for c in codes)  # the tiny codec block
            # Nothing of the cancelled response follows its response.done, for three more engine windows.
            await wait_until(lambda: sum(e["seq"] > done["seq"] for e in client.events_of("metrics")) >= 3,
                             what="three engine windows after the cancel")
            late = [e for e in client.events if e["seq"] > done["seq"] and e.get("response_id") == rid
                    and e["type"].startswith("response.output")]
            assert not late
            for ev in client.events:
                validate_server_event(ev)
        finally:
            await client.close()


async def test_lychee_tiny_takes_the_agents_instructions_over_the_ga_dialect(tiny_root):
    from test_openai_realtime import assert_ga_events_valid, open_call

    from lychee_rtc.server.app import ENGINE_KEY, REGISTRY_KEY

    lychee = {"model_root": tiny_root, "device": "cpu", "dtype": "fp32", "max_seq": 1024, "torch_threads": 1,
              "progress": False, "seed": 1, "token2wav": None}
    async with running_server("configs/lychee-c1.yaml", server={"host": "127.0.0.1"},
                              engine={"lychee": lychee}) as (url, app):
        client, call_id = await open_call(url, {})
        try:
            created = await client.wait_event("session.created", timeout=20)
            assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
            rng = np.random.default_rng(0)
            client.mic.feed((0.05 * rng.standard_normal(RATE * 30)).astype(np.float32))
            # The agent's set-up arrives on channel open, before the model has spoken: its
            # instructions become the system prompt of a fresh conversation.
            client.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}})
            updated = await client.wait_event("session.updated", timeout=20)
            assert updated["lychee_rtc"]["instructions"] == "applied"
            session = app[REGISTRY_KEY].calls[call_id].session
            backend = app[ENGINE_KEY].backend
            slot = backend.runner.slots[session.slot.index]
            # The restart runs on the engine thread, which sets the instructions, then the prefix from them.
            prefix = "<|BOT|>system\nBe brief.<|EOT|>"
            await wait_until(lambda: backend.tokenizer.decode(slot.prefix_ids) == prefix, 10, "the new system prefix")

            client.send({"type": "response.create"})  # "answer now"
            created = await client.wait_event("response.created", timeout=30)
            rid = created["response"]["id"]
            delta = await client.wait_event("response.output_audio_transcript.delta", timeout=20)
            assert delta["response_id"] == rid and delta["item_id"].startswith("item_")
            # Mid-conversation the model keeps its context: the change waits for its next reset.
            n = len(client.events)
            client.send({"type": "session.update", "session": {"instructions": "Be very brief."}})
            later = await client.wait_event("session.updated", timeout=20, after=n)
            assert later["lychee_rtc"]["instructions"] == "next_context_reset"
            client.send({"type": "response.cancel"})
            done = await client.wait_event("response.done", timeout=20)
            assert done["response"]["status"] == "cancelled"
            transcript = await client.wait_event("response.output_audio_transcript.done", timeout=5)
            deltas = "".join(e["delta"] for e in client.events_of("response.output_audio_transcript.delta"))
            assert transcript["transcript"] == deltas == done["response"]["output"][0]["content"][0]["transcript"]
            assert_ga_events_valid(client.events)
        finally:
            await client.close()
