"""OpenAI's SIP call control against this server, with the ``openai`` package's own methods.

The gateway announces each incoming SIPp call to a webhook receiver run here; the receiver checks
the Standard Webhooks signature with ``client.webhooks.unwrap`` (the SDK's own verification), and
the test answers with ``client.realtime.calls.accept`` / ``reject`` / ``hangup`` and drives the
accepted call over the sideband (``client.realtime.connect(call_id=…)``), as an application written
for OpenAI's SIP interface does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import openai
import pytest
from aiohttp import web
from conftest import free_port, running_server
from openai import AsyncOpenAI
from sip_tools import RATE, LoopbackCapture, free_media_port, run_sipp, sipp_uac_scenario, speech_pcap
from test_rtc_echo import best_match
from test_openai_python_sdk import next_event, read_until_closed
from test_openai_realtime import assert_ga_events_valid
from test_sip_gateway import gateway_overrides, received_audio, registered, speech_8k, stack  # noqa: F401

from lychee_rtc.gateway.call_control import incoming_event, webhook_signature
from lychee_rtc.server.app import GATEWAY_KEY, REGISTRY_KEY

pytestmark = pytest.mark.timeout(600)

KEY = "sk-test-call-control"
SECRET = "whsec_" + base64.b64encode(b"lychee webhook test secret 32by").decode()


class WebhookReceiver:
    """The application's webhook endpoint: every delivery, as received (body bytes and headers)."""

    def __init__(self) -> None:
        self.deliveries: asyncio.Queue[tuple[bytes, dict[str, str]]] = asyncio.Queue()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/webhooks/openai"
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.deliveries.put_nowait((await request.read(), dict(request.headers)))
        return web.Response(status=200)

    async def __aenter__(self) -> "WebhookReceiver":
        app = web.Application()
        app.router.add_post("/webhooks/openai", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def next_call(self, client: AsyncOpenAI):
        body, headers = await asyncio.wait_for(self.deliveries.get(), 60)
        with pytest.raises(openai.InvalidWebhookSignatureError):  # a changed body is refused
            client.webhooks.unwrap(body.replace(b"realtime.call", b"realtime.cell"), headers)
        event = client.webhooks.unwrap(body, headers)  # verifies the signature, as against OpenAI
        assert event.type == "realtime.call.incoming"
        assert json.loads(body)["object"] == "event"
        return event


def test_webhook_signature_is_the_one_the_openai_package_verifies():
    client = openai.OpenAI(api_key=KEY, base_url="http://127.0.0.1:9/v1", webhook_secret=SECRET)
    event = incoming_event("sess_x", [{"name": "From", "value": "<sip:a@b>"}])
    body = json.dumps(event)
    stamp = int(time.time())
    headers = {"webhook-id": event["id"], "webhook-timestamp": str(stamp),
               "webhook-signature": webhook_signature(SECRET, event["id"], stamp, body)}
    assert client.webhooks.unwrap(body, headers).data.call_id == "sess_x"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body, {**headers, "webhook-timestamp": str(stamp - 1)})
    with pytest.raises(openai.InvalidWebhookSignatureError):  # another secret
        client.webhooks.unwrap(body, headers, secret="whsec_" + base64.b64encode(b"x" * 32).decode())


def controlled(stack, receiver: WebhookReceiver, **extra) -> dict:
    return gateway_overrides(stack, webhook_url=receiver.url, webhook_secret=SECRET, **extra)


async def test_incoming_call_is_announced_accepted_heard_and_hung_up(stack, tmp_path, speech_8k):
    pcap = tmp_path / "speech.pcap"
    speech_pcap(pcap, [np.zeros(RATE, np.float32), speech_8k, np.zeros(4 * RATE, np.float32)])
    async with WebhookReceiver() as receiver, \
            running_server("configs/telephony.yaml", gateway=controlled(stack, receiver),
                           server={"auth_token": KEY}, session={"window_grace_ms": 400}) as (url, app):
        client = AsyncOpenAI(api_key=KEY, base_url=f"{url}/v1", max_retries=0, webhook_secret=SECRET)
        await registered(app)
        media = free_media_port()
        async with LoopbackCapture(tmp_path / "rx.pcap", media) as capture:
            sipp = asyncio.create_task(run_sipp(sipp_uac_scenario(pcap, hold_ms=60000, hangup="callee"),
                                                tmp_path, stack.ports.sip, media))
            event = await receiver.next_call(client)
            call_id = event.data.call_id
            headers = {h.name: h.value for h in event.data.sip_headers}
            assert "sip:caller1@127.0.0.1" in headers["From"] and headers["Call-ID"].endswith("@127.0.0.1")
            assert not app[REGISTRY_KEY].calls  # it rings until the application decides
            await client.realtime.calls.accept(call_id, type="realtime", model="gpt-realtime",
                                               instructions="You are the front desk.")
            call = app[REGISTRY_KEY].calls[call_id]  # the call id is the session's id
            assert call.session.options.instructions == "You are the front desk."
            with pytest.raises(openai.ConflictError):  # decided once
                await client.realtime.calls.reject(call_id)
            # The application drives the phone call over the sideband, as it would OpenAI's.
            seen: list[dict] = []
            async with client.realtime.connect(call_id=call_id) as conn:
                await next_event(conn, "session.created", seen)
                await conn.session.update(session={"type": "realtime", "instructions": "Be very brief."})
                updated = await next_event(conn, "session.updated", seen)
                assert updated.session.instructions == "Be very brief."
                await next_event(conn, "output_audio_buffer.stopped", seen, timeout=90)  # the bot answered
                await client.realtime.calls.hangup(call_id)
                await asyncio.wait_for(read_until_closed(conn, seen), 10)  # the sideband ends with the call
            assert_ga_events_valid(seen)
            result = await sipp  # the caller got the BYE
            assert result.returncode == 0, result.explain()
            rtp = await capture.stop()
        assert call.session.close_reason == "hangup"
    score = best_match(received_audio(rtp), speech_8k, RATE)
    print(f"echo correlation {score:.3f}")
    assert score > 0.9, f"echo correlation {score:.2f}"


async def test_incoming_call_rejected_or_left_undecided(stack, tmp_path):
    async with WebhookReceiver() as receiver, \
            running_server("configs/telephony.yaml", gateway=controlled(stack, receiver, decision_timeout_s=3),
                           server={"auth_token": KEY}) as (url, app):
        client = AsyncOpenAI(api_key=KEY, base_url=f"{url}/v1", max_retries=0, webhook_secret=SECRET)
        await registered(app)
        with pytest.raises(openai.NotFoundError):
            await client.realtime.calls.accept("sess_nope", type="realtime")
        # Rejected with the application's status.
        sipp = asyncio.create_task(run_sipp(sipp_uac_scenario(None, 0, refused_with=486), tmp_path,
                                            stack.ports.sip, free_media_port(), tag="busy"))
        event = await receiver.next_call(client)
        with pytest.raises(openai.BadRequestError):
            await client.realtime.calls.reject(event.data.call_id, status_code=200)
        await client.realtime.calls.reject(event.data.call_id, status_code=486)
        result = await sipp
        assert result.returncode == 0, result.explain()
        with pytest.raises(openai.ConflictError):  # decided once
            await client.realtime.calls.accept(event.data.call_id, type="realtime")
        # Nobody decides: declined 480 after decision_timeout_s, and nothing is left behind.
        sipp = asyncio.create_task(run_sipp(sipp_uac_scenario(None, 0, refused_with=480), tmp_path,
                                            stack.ports.sip, free_media_port(), tag="undecided"))
        await receiver.next_call(client)
        result = await sipp
        assert result.returncode == 0, result.explain()
        assert not app[REGISTRY_KEY].calls and app[REGISTRY_KEY].free == app[REGISTRY_KEY].capacity
        assert not app[GATEWAY_KEY].control.pending and app[GATEWAY_KEY].control.delivered == 2
