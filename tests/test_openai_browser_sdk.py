"""OpenAI's official browser SDK, ``@openai/agents-realtime`` (pinned in tests/openai_sdk/package.json),
in headless Chromium with a fake microphone, against this server.

The page is served from another origin than the server (as an application's page would be), so the
CORS rules are exercised for real. The application server's part (minting the ephemeral key with
the server key) is done by the test. The SDK is unmodified: only its calls URL points here.

Getting the SDK: the first run installs the exact locked packages (integrity-checked against
tests/openai_sdk/package-lock.json) with ``npm ci`` into
tests/openai_sdk/node_modules (git-ignored), so ``make test`` needs Node.js and npm and, once,
the npm registry; later runs reuse the folder while its version matches the pin.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from conftest import free_port, running_server, serving
from playwright.async_api import Page
from test_browser import SPEECH_RMS, chromium, write_mic_wav
from test_openai_realtime import KEY, assert_ga_events_valid

from lychee_rtc.server.app import REGISTRY_KEY

# The first run installs the SDK with `npm ci` (allowed 600 s on its own), then drives Chromium.
pytestmark = pytest.mark.timeout(900)

SDK_DIR = Path(__file__).resolve().parent / "openai_sdk"
PACKAGE = "@openai/agents-realtime"
BUNDLE = SDK_DIR / "node_modules" / PACKAGE / "dist" / "bundle" / "openai-realtime-agents.umd.js"


@pytest.fixture(scope="session")
def sdk_bundle() -> Path:
    pinned = json.loads((SDK_DIR / "package.json").read_text())["dependencies"][PACKAGE]
    installed = SDK_DIR / "node_modules" / PACKAGE / "package.json"
    if not installed.is_file() or json.loads(installed.read_text())["version"] != pinned:
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("npm (Node.js) is required to fetch the OpenAI browser SDK for this test")
        result = subprocess.run([npm, "ci", "--omit=optional", "--ignore-scripts", "--no-audit", "--no-fund",
                                 "--loglevel=error"],
                                cwd=SDK_DIR, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            pytest.fail(f"npm ci in {SDK_DIR} failed:\n{result.stderr[-2000:]}")
    assert BUNDLE.is_file(), f"{PACKAGE}@{pinned} has no browser bundle at {BUNDLE}"
    return BUNDLE


@asynccontextmanager
async def page_origin(bundle: Path) -> AsyncIterator[str]:
    """A second origin that serves the application's page and the SDK bundle."""
    async def page(_: web.Request) -> web.FileResponse:
        return web.FileResponse(SDK_DIR / "page.html")

    async def sdk(_: web.Request) -> web.FileResponse:
        return web.FileResponse(bundle)

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/sdk.js", sdk)
    async with serving(app) as url:
        yield url


async def until(page: Page, expression: str, timeout: float = 30.0, arg=None):
    """Poll a page expression until it is truthy; return its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await page.evaluate(expression, arg)
        if value:
            return value
        error = await page.evaluate("() => window.harness.error")
        assert error is None, error
        assert loop.time() < deadline, f"timed out waiting for {expression}"
        await asyncio.sleep(0.1)


def seen(event_type: str, **match) -> str:
    conditions = "".join(f" && e[{json.dumps(k)}] === {json.dumps(v)}" for k, v in match.items())
    return f"() => window.harness.events.some((e) => e.type === {json.dumps(event_type)}{conditions})"


async def test_official_browser_sdk_talks_interrupts_and_hangs_up(tmp_path, sdk_bundle, long_utterance):
    mic = write_mic_wav(tmp_path / "mic.wav", long_utterance)
    async with page_origin(sdk_bundle) as origin, \
            running_server(server={"auth_token": KEY, "cors_origins": [origin]}) as (url, app), \
            chromium(tmp_path, mic) as context:
        # The application server mints an ephemeral key with its server key and gives it to its page.
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/realtime/client_secrets", headers={"Authorization": f"Bearer {KEY}"},
                                 json={"session": {"type": "realtime"}}) as resp:
                assert resp.status == 200
                ek = (await resp.json())["value"]
        page = await context.new_page()
        page_errors: list[str] = []
        warnings: list[str] = []
        page.on("pageerror", lambda exc: page_errors.append(str(exc)))
        page.on("console", lambda msg: warnings.append(msg.text) if msg.type in ("warning", "error") else None)
        await page.goto(origin + "/")
        await page.evaluate("(c) => { window.config = c; }", {
            "callsUrl": f"{url}/v1/realtime/calls", "apiKey": ek, "instructions": "Reply briefly."})
        await page.click("#start")  # a user gesture, so the page may play audio

        # connect() resolved on session.updated, not on the SDK's 5 s fallback.
        call_id = await until(page, "() => window.harness.callId", timeout=60)
        assert not any("Timed out waiting for session.updated" in w for w in warnings), warnings
        assert call_id in app[REGISTRY_KEY].calls  # read from Location, exposed across origins
        offers = await page.evaluate("() => window.harness.offers")
        assert len(offers) == 1 and "m=audio" in offers[0] and "a=candidate" not in offers[0]
        await until(page, seen("session.created"))
        await until(page, seen("session.updated"))
        server_session = app[REGISTRY_KEY].calls[call_id].session
        assert server_session.options.instructions == "Reply briefly."  # the agent's, from session.update

        # The echo engine answers the fake microphone's sentence, and the page hears it.
        await until(page, seen("input_audio_buffer.speech_started"), timeout=60)
        await until(page, seen("output_audio_buffer.started"), timeout=90)
        echo = await page.evaluate("(s) => window.harness.listen(s)", 1.0)
        assert echo["peak"] > SPEECH_RMS and echo["statsRms"] > SPEECH_RMS, echo

        # interrupt(): the answer is cut and the page falls silent while the echo had seconds left.
        await page.evaluate("() => window.harness.session.interrupt()")
        await until(page, seen("output_audio_buffer.cleared"), timeout=10)
        await until(page, seen("response.done"), timeout=10)
        done = await page.evaluate("() => window.harness.events.find((e) => e.type === 'response.done')")
        assert done["response"]["status"] == "cancelled", done
        quiet = None
        for _ in range(25):  # what was already in the jitter buffer plays out, then silence
            quiet = await page.evaluate("(s) => window.harness.listen(s)", 0.2)
            if quiet["peak"] < echo["peak"] / 10:
                break
        after = await page.evaluate("(s) => window.harness.listen(s)", 1.5)
        assert after["samples"] > 0, "the stream stopped instead of carrying silence"
        assert after["peak"] < echo["peak"] / 10 and after["statsRms"] < echo["statsRms"] / 10, (echo, quiet, after)
        assert server_session.state != "speaking"

        # The SDK's history was built from the GA item events: the user's turn, the cut answer.
        history = await page.evaluate("() => window.harness.session.history.map((i) => [i.role, i.status])")
        assert ["user", "completed"] in history and ["assistant", "incomplete"] in history, history

        # Every event the SDK received is a valid GA event of ours.
        events = await page.evaluate("() => window.harness.events")
        assert_ga_events_valid(events)

        # close() ends the server's session.
        await page.evaluate("() => window.harness.session.close()")
        for _ in range(300):
            if call_id not in app[REGISTRY_KEY].calls:
                break
            await asyncio.sleep(0.1)
        assert call_id not in app[REGISTRY_KEY].calls, "the session outlived the SDK's close()"
        assert not page_errors, page_errors
