"""Run a lychee-rtc server in a child process for a benchmark, and read its CPU time."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@asynccontextmanager
async def spawned_http_process(argv: list[str], port: int, what: str, env: dict[str, str] | None = None,
                               ready_timeout_s: float = 60.0) -> AsyncIterator[tuple[str, int]]:
    """Run ``argv`` (an HTTP service listening on ``port``); yields (base_url, pid) once /readyz answers 200."""
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{what} exited with status {proc.returncode}")
                try:
                    async with http.get(f"{url}/readyz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not become ready within {ready_timeout_s:.0f} s")
                await asyncio.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@asynccontextmanager
async def spawned_server(config: str, env: dict[str, str] | None = None,
                         ready_timeout_s: float = 60.0) -> AsyncIterator[tuple[str, int]]:
    """Start ``lychee-rtc serve`` on a free port; yields (base_url, pid) once /readyz answers 200.

    ``ready_timeout_s``: a model server loads weights and captures graphs before it is ready."""
    port = free_port()
    argv = [sys.executable, "-m", "lychee_rtc.cli", "--log-level", "WARNING", "serve", "--config", config,
            "--port", str(port)]
    async with spawned_http_process(argv, port, "server", env, ready_timeout_s) as running:
        yield running


@asynccontextmanager
async def spawned_cluster(config: str, env: dict[str, str], workers: int,
                          ready_timeout_s: float = 180.0) -> AsyncIterator[tuple[str, int]]:
    """``lychee-rtc cluster serve`` (a local Ray, ``workers`` worker processes) on a free port; yields
    (base_url, entry pid) once every worker is ready."""
    port = free_port()
    argv = [sys.executable, "-m", "lychee_rtc.cli", "--log-level", "WARNING", "cluster", "serve", "--config", config,
            "--port", str(port)]
    async with spawned_http_process(argv, port, "cluster entry", env, ready_timeout_s) as (url, pid):
        deadline = time.monotonic() + ready_timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                async with http.get(f"{url}/readyz") as resp:
                    ready = (await resp.json()).get("workers", {}).get("ready", 0)
                if ready >= workers:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ready} of {workers} cluster workers ready after {ready_timeout_s:.0f} s")
                await asyncio.sleep(0.5)
        yield url, pid
