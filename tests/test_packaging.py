"""The package as a user or an image build installs it: from its wheel, not from this checkout.

The wheel is built from the checkout and unpacked into a folder outside it; a server started from
there (with the checkout out of reach) must find everything it reads at run time: the event
schema, the web client and the shipped profiles.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import aiohttp
import pytest

from conftest import free_port
from lychee_rtc.bench.client import RtcClient

# Building and installing the wheel (allowed 600 s on its own) happens inside the first test's limit.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel's contents as site-packages would hold them."""
    work = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                            "--disable-pip-version-check", "-w", str(work / "dist"), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    wheel = next((work / "dist").glob("lychee_rtc-*.whl"))
    site = work / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def _env(site: Path) -> dict[str, str]:
    # The installed copy comes first on the path; the checkout's editable install is only a fallback
    # finder, so anything missing from the wheel would fail here instead of being found in ROOT.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LYCHEE_RTC_")}
    env["PYTHONPATH"] = str(site)
    return env


def test_the_wheel_carries_its_run_time_files(installed):
    share = installed / "lychee_rtc" / "_share"
    for path in ("signaling/events.schema.json", "signaling/openapi.yaml", "web/index.html", "web/app.js",
                 "configs/echo.yaml", "configs/loopback.yaml", "configs/lychee-c1.yaml"):
        assert (share / path).is_file(), path
    assert (installed / "lychee_rtc" / "engine" / "data" / "silero_vad.onnx").is_file()
    probe = subprocess.run([sys.executable, "-c", "import lychee_rtc.config as c; print(c.DEFAULT_PROFILE)"],
                           capture_output=True, text=True, env=_env(installed), cwd=installed.parent, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(installed)


async def test_a_server_installed_from_the_wheel_takes_a_call_with_a_session(installed, tmp_path):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lychee_rtc.cli", "--log-level", "WARNING", "serve", "--port", str(port),
        env=_env(installed), cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(600):  # up to a minute for a slow start on a busy machine
                if proc.returncode is not None:
                    pytest.fail(f"server exited: {(await proc.stdout.read()).decode()}")
                try:
                    async with http.get(f"{url}/healthz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
            async with http.get(f"{url}/") as resp:
                assert resp.status == 200 and "<html" in await resp.text()
        client = RtcClient(url)
        try:
            # The session object is validated against the event schema: this needs the schema file.
            await client.connect(session={"metrics": True, "temperature": 0.7})
            created = await client.wait_event("session.created", timeout=60)
            assert created["session"]["metrics"] is True
        finally:
            await client.close()
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
