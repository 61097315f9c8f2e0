"""The web client in headless Chromium, against a real echo server.

Chromium's fake capture device plays a WAV as the microphone: silence, a sentence, long silence
(the file loops, so the silence keeps the next loop from barging in while we measure). What the page
receives is measured inside the page, from its AnalyserNode on the remote stream and from getStats,
so the test proves the echo actually came back, not only that events were sent.

The system Chromium is used (never a downloaded one); `make test` installs it when missing.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import pytest
from conftest import PATIENT_WINDOWS, running_server
from playwright.async_api import BrowserContext, Page, async_playwright, expect

from lychee_rtc.bench.browser import CHROMIUM, CHROMIUM_FLAGS
from lychee_rtc.bench.client import RtcClient
from lychee_rtc.pcm import write_wav
from lychee_rtc.rtc.consent import ice_connections
from lychee_rtc.server.app import REGISTRY_KEY

# Headless Chromium starts for each test and plays seconds of speech in real time.
pytestmark = pytest.mark.timeout(600)

RATE = 48000
# A level the echoed speech is far above and the server's silence frames far below.
SPEECH_RMS = 0.01


def write_mic_wav(path: Path, speech: np.ndarray) -> Path:
    signal = np.concatenate([np.zeros(RATE, np.float32), speech, np.zeros(15 * RATE, np.float32)])
    return write_wav(path, signal, RATE)


@asynccontextmanager
async def chromium(tmp_path: Path, mic_wav: Path | None = None) -> AsyncIterator[BrowserContext]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is required for the browser test (Debian package 'chromium'; `make test` installs it)")
    args = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream", *CHROMIUM_FLAGS]
    if mic_wav is not None:
        args.append(f"--use-file-for-fake-audio-capture={mic_wav}")
    profile = tmp_path / "chromium-profile"  # a new, empty --user-data-dir
    async with async_playwright() as p:
        context = await p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=args,
            permissions=["microphone"], timeout=60_000)
        try:
            yield context
        finally:
            await context.close()


def log_entry(page: Page, event_type: str, **data: str):
    selector = f'#log li[data-type="{event_type}"]'
    for k, v in data.items():
        selector += f'[data-{k}="{v}"]'
    return page.locator(selector)


async def logged_json(page: Page, event_type: str) -> dict:
    """The full JSON of the last logged event of a type, as a user sees it by opening the row."""
    row = log_entry(page, event_type).last
    await row.locator("summary").click()
    return json.loads(await row.locator("pre").inner_text())


async def open_page(context: BrowserContext, url: str) -> tuple[Page, list[str]]:
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(url + "/")
    await expect(page).to_have_title("lychee-rtc")
    return page, errors


# Samples what the page hears for `seconds`: the peak RMS of the AnalyserNode on the remote stream,
# and the mean RMS of the decoded inbound audio from getStats (totalAudioEnergy over duration); and
# the peak of the microphone meter.
RECEIVED = """
async (seconds) => {
  const before = await window.lychee.inboundAudio();
  let peak = 0, mic = 0;
  const end = performance.now() + seconds * 1000;
  while (performance.now() < end) {
    peak = Math.max(peak, window.lychee.agentLevel());
    mic = Math.max(mic, window.lychee.micLevel());
    await new Promise((r) => setTimeout(r, 20));
  }
  const after = await window.lychee.inboundAudio();
  const energy = after.totalAudioEnergy - before.totalAudioEnergy;
  const duration = after.totalSamplesDuration - before.totalSamplesDuration;
  return {
    peak,
    mic,
    statsRms: duration > 0 ? Math.sqrt(Math.max(energy, 0) / duration) : 0,
    samples: after.totalSamplesReceived - before.totalSamplesReceived,
  };
}
"""


async def received(page: Page, seconds: float) -> dict[str, float]:
    return await page.evaluate(RECEIVED, seconds)


async def test_page_talks_to_the_echo_engine_and_interrupts(tmp_path, utterance):
    mic = write_mic_wav(tmp_path / "mic.wav", utterance)
    async with running_server(session=PATIENT_WINDOWS) as (url, app), chromium(tmp_path, mic) as context:
        page, errors = await open_page(context, url)
        await page.click("#connect")
        await expect(page.locator("#conn-status")).to_have_attribute("data-status", "connected", timeout=60_000)
        await expect(log_entry(page, "session.created")).to_have_count(1, timeout=60_000)
        await expect(page.locator("#engine-name")).to_have_text("echo")
        await expect(page.locator("#voice")).to_be_disabled()  # the echo engine has no voices
        await expect(page.locator("#epoch")).to_have_text("0")

        # Sampling settings go to the server with session.update and come back in session.updated.
        await page.fill("#temperature", "0.7")
        await page.fill("#seed", "42")
        await page.click("#apply-settings")
        await expect(log_entry(page, "session.update")).to_have_count(1)
        await expect(log_entry(page, "session.updated")).to_have_count(1, timeout=60_000)
        sent = await logged_json(page, "session.update")
        assert sent["session"] == {"temperature": 0.7, "seed": 42}, sent  # no voice: echo has none
        updated = await logged_json(page, "session.updated")
        assert updated["session"]["temperature"] == 0.7 and updated["session"]["seed"] == 42, updated

        # Uplink: the server's VAD heard the fake microphone's sentence.
        await expect(log_entry(page, "input_audio_buffer.speech_started").first).to_be_attached(timeout=60_000)
        quiet = await received(page, 1.0)  # the server sends silence while the user talks
        assert quiet["samples"] > 0, "no audio decoded from the server's track"
        assert quiet["mic"] > SPEECH_RMS, f"the microphone meter did not move while the user spoke: {quiet}"

        # Downlink: the echo of that sentence comes back and the page hears it.
        await expect(log_entry(page, "output_audio_buffer.started")).to_have_count(1, timeout=60_000)
        await expect(page.locator("#agent-state")).to_have_attribute("data-state", "speaking", timeout=60_000)
        echo = await received(page, 1.2)
        assert echo["peak"] > SPEECH_RMS and echo["statsRms"] > SPEECH_RMS, (quiet, echo)
        assert echo["peak"] > 10 * max(quiet["peak"], 1e-4), (quiet, echo)

        # Interrupt: the answer is cut, the epoch moves on, and what the page hears falls silent.
        await expect(page.locator("#interrupt")).to_be_enabled()
        await page.click("#interrupt")
        await expect(log_entry(page, "response.cancel")).to_have_count(1)
        await expect(log_entry(page, "output_audio_buffer.cleared")).to_have_count(1, timeout=60_000)
        await expect(log_entry(page, "response.done", status="cancelled")).to_have_count(1, timeout=60_000)
        types = await page.locator("#log li").evaluate_all("(lis) => lis.map((li) => li.dataset.type)")
        assert types.index("output_audio_buffer.cleared") < types.index("response.done")
        await expect(page.locator("#epoch")).to_have_text("1")
        await expect(page.locator("#interrupt")).to_be_disabled()
        # What was already in the page's jitter buffer plays out (longer on a busy machine); then it
        # stays silent.
        for _ in range(60):
            if (await received(page, 0.3))["peak"] < echo["peak"] / 10:
                break
        after = await received(page, 1.2)
        assert after["samples"] > 0, "the stream stopped instead of carrying silence"
        assert after["peak"] < echo["peak"] / 10 and after["statsRms"] < echo["statsRms"] / 10, (echo, after)
        await expect(log_entry(page, "response.created")).to_have_count(1)
        await expect(page.locator('#transcript .turn[data-status="cancelled"]')).to_contain_text("interrupted")

        # Hold to listen: turn.listen while pressed, turn.release on release. (The fake microphone
        # is in its long silence now, so nothing else moves the turn state.)
        await page.locator("#hold").hover()
        await page.mouse.down()
        await expect(page.locator("#agent-state")).to_have_attribute("data-state", "held", timeout=60_000)
        await expect(page.locator("#hold")).to_have_attribute("aria-pressed", "true")
        await page.mouse.up()
        await expect(page.locator("#agent-state")).to_have_attribute("data-state", "listening", timeout=60_000)
        await expect(log_entry(page, "turn.listen")).to_have_count(1)
        await expect(log_entry(page, "turn.release")).to_have_count(1)

        # End of speech with nothing said: the server's error event is shown, and the call goes on.
        await page.click("#commit")
        await expect(log_entry(page, "input_audio_buffer.commit")).to_have_count(1)
        await expect(page.locator("#alert")).to_contain_text("input_audio_buffer_commit_empty", timeout=60_000)
        await page.click("#alert-close")
        await expect(page.locator("#alert")).to_be_hidden()
        await expect(page.locator("#conn-status")).to_have_attribute("data-status", "connected")

        # The transcript renders the model's text channel (the echo engine has none: feed one
        # delta through the page's own event handler).
        await expect(page.locator("#transcript")).to_contain_text("no text channel")
        await page.evaluate("""() => window.lychee.handleServerEvent({
            type: "response.output_audio_transcript.delta", seq: 100000, event_id: "synthetic",
            epoch: window.lychee.epoch(), response_id: "resp_synthetic", delta: "Hello from the text channel."})""")
        await expect(page.locator('#transcript [data-response-id="resp_synthetic"]')).to_have_text(
            "Hello from the text channel.")
        # A long answer wraps inside the box, also a run without spaces (a URL, CJK text).
        await page.evaluate("""() => window.lychee.handleServerEvent({
            type: "response.output_audio_transcript.delta", seq: 100001, event_id: "synthetic-2",
            epoch: window.lychee.epoch(), response_id: "resp_synthetic",
            delta: " and more".repeat(200) + " " + "x".repeat(600) + "\\nsecond line"})""")
        box = await page.locator("#transcript").evaluate(
            """(el) => ({scroll: el.scrollWidth, client: el.clientWidth,
                        height: el.querySelector('[data-response-id="resp_synthetic"]').getBoundingClientRect().height,
                        line: parseFloat(getComputedStyle(el).lineHeight) || 20})""")
        assert box["scroll"] <= box["client"] + 1, f"the transcript scrolls sideways: {box}"
        assert box["height"] > 5 * box["line"], f"the long answer did not wrap onto several lines: {box}"

        # The latency panel fills from getStats and the server's metrics events.
        await expect(page.locator("#stat-jb")).to_contain_text("ms", timeout=60_000)
        await expect(page.locator("#srv-step")).to_contain_text("ms", timeout=60_000)
        await expect(page.locator("#m2e")).to_contain_text("ms", timeout=60_000)
        # Answer audio queued for playout is shown apart, not counted as a delay of the path.
        await expect(page.locator("#answer-queued")).to_contain_text("ms", timeout=60_000)
        names = await page.locator("#m2e-parts li span:first-child").all_inner_texts()
        assert len(names) == 6 and not [n for n in names if "playout" in n or "queued" in n], names
        estimate = await page.evaluate("""async () => {
            const m = await import("/static/stats.js");
            const server = {deadline_ms: 20, queue_wait_ms: 1, step_ms: 4, playout_depth_ms: 5000};
            return {total: m.mouthToEar({rttMs: 40, jitterBufferMs: 30, server}).totalMs,
                    queued: m.answerQueuedMs(server)};
        }""")
        assert estimate == {"total": 20 + 20 + 1 + 4 + 20 + 30, "queued": 5000}, estimate

        # Disconnect frees the server's slot.
        await page.click("#disconnect")
        await expect(page.locator("#conn-status")).to_have_attribute("data-status", "idle")
        await expect(page.locator("#connect")).to_be_enabled()
        for _ in range(600):
            if not app[REGISTRY_KEY].calls:
                break
            await asyncio.sleep(0.1)
        assert not app[REGISTRY_KEY].calls, "the session outlived the page's disconnect"
        assert not errors, errors


async def test_a_full_server_refusal_is_shown(tmp_path):
    async with running_server(session={"max_sessions": 1, "retry_after_s": 6}) as (url, _):
        occupant = RtcClient(url)
        await occupant.connect()
        try:
            async with chromium(tmp_path) as context:
                page, errors = await open_page(context, url)
                await page.click("#connect")
                alert = page.locator("#alert")
                await expect(alert).to_be_visible(timeout=60_000)
                await expect(alert).to_have_attribute("role", "alert")
                await expect(alert).to_contain_text("server is full")
                await expect(alert).to_contain_text("Try again in 6 s")  # the Retry-After the server sent (long enough for the checks below on a busy machine)
                await expect(page.locator("#conn-status")).to_have_text("Server full")
                await expect(page.locator("#connect")).to_be_disabled()
                await expect(page.locator("#connect")).to_contain_text("Retry in")
                await expect(page.locator("#log")).to_contain_text("503")
                # Connect comes back once Retry-After has passed.
                await expect(page.locator("#connect")).to_have_text("Connect", timeout=60_000)
                await expect(page.locator("#connect")).to_be_enabled()
                assert not errors, errors
        finally:
            await occupant.close()


async def test_the_page_resumes_its_session_after_the_path_breaks(tmp_path):
    async with running_server(session={"media_timeout_s": 2.0}) as (url, app), chromium(tmp_path) as context:
        page, errors = await open_page(context, url)
        await page.click("#connect")
        await expect(page.locator("#conn-status")).to_have_attribute("data-status", "connected", timeout=30_000)
        await expect(log_entry(page, "session.created")).to_have_count(1, timeout=15_000)
        (session_id, call), = app[REGISTRY_KEY].calls.items()
        # The network path breaks: nothing of this call gets through any more, either way.
        for connection in ice_connections(call.pc):
            for protocol in connection._protocols:
                protocol.datagram_received = lambda data, addr: None
                protocol.transport.sendto = lambda data, addr=None: None
        await expect(page.locator("#conn-status")).to_have_text("Connected (resumed)", timeout=90_000)
        await expect(page.locator("#log")).to_contain_text("resuming the session, attempt 1")
        await expect(log_entry(page, "session.resumed")).to_have_count(1)
        assert list(app[REGISTRY_KEY].calls) == [session_id] and call.resumes == 1
        await expect(page.locator("#session-id")).to_have_text(session_id)
        # Events after the resume arrive once each, in order.
        seqs = await page.locator("#log li[data-seq]").evaluate_all("(lis) => lis.map((li) => Number(li.dataset.seq))")
        assert seqs == sorted(set(seqs)), seqs
        await page.click("#disconnect")
        for _ in range(100):
            if not app[REGISTRY_KEY].calls:
                break
            await asyncio.sleep(0.1)
        assert not app[REGISTRY_KEY].calls
        assert not errors, errors
