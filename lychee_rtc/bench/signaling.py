"""``lychee-rtc bench signaling``: time from posting an offer to holding the answer.

Against a cluster entry and against one of its workers directly, the difference is what the entry
adds (choosing a worker, one more HTTP hop). Each offer is a real aiortc offer (audio and the events
channel, candidates gathered first, as a browser's); each session is deleted before the next offer,
so every offer finds a free slot.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import aiohttp
from aiortc import RTCConfiguration, RTCPeerConnection

from lychee_rtc.bench.probes import percentile


@dataclass
class SignalingResult:
    url: str
    offers: int
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None


async def _offer_sdp() -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def measure(url: str, count: int) -> SignalingResult:
    url = url.rstrip("/")
    times: list[float] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(count):
            pc, sdp = await _offer_sdp()
            try:
                started = time.perf_counter()
                async with http.post(f"{url}/v1/rtc/offer", json={"type": "offer", "sdp": sdp}) as r:
                    body = await r.json()
                elapsed = (time.perf_counter() - started) * 1000.0
                if r.status != 200:
                    raise RuntimeError(f"offer refused: {r.status} {body}")
                times.append(elapsed)
                async with http.delete(f"{url}/v1/sessions/{body['session_id']}") as r:
                    await r.read()
            finally:
                await pc.close()
    return SignalingResult(url, len(times), percentile(times, 50), percentile(times, 90), max(times, default=None))


async def _main(args: argparse.Namespace) -> int:
    results = []
    for url in args.url:
        result = await measure(url, args.count)
        results.append(result)
        print(f"{result.url}: {result.offers} offers, offer -> answer p50 {result.p50_ms:.1f} ms, "
              f"p90 {result.p90_ms:.1f} ms, max {result.max_ms:.1f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("signaling", help="offer -> answer time of running servers (an entry, a worker)")
    p.add_argument("--url", action="append", required=True,
                   help="a running server or cluster entry; repeat to compare several")
    p.add_argument("--count", type=int, default=20, help="offers per URL, one after the other")
    p.add_argument("--json", help="also write the results as JSON here")
    p.set_defaults(func=_main)
