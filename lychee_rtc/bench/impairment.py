"""A user-space impaired network path between a WebRTC client and a lychee-rtc server.

This machine's kernel has no ``netem`` qdisc, so the path is a UDP relay the client's ICE
candidates point at: an HTTP front forwards every request to the real server and, in the JSON offer
and answer (and WHIP's SDP), replaces each side's candidates with one relay socket. Every packet of
the call (STUN, DTLS, SRTP, SCTP) then goes browser → relay → server and back, and on its way each
is held for the configured delay plus a seeded random jitter, or dropped. Independent per-packet
jitter reorders packets the way a real path does. The relay counts what it did, so a result shows
the delay and loss that were actually applied, not only the settings.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

MAX_QUEUE_S = 0.5  # a rate-limited link's queue: a packet that would wait longer is dropped (tail drop)
MAX_SESSIONS = 16  # relays one path keeps open at most; a bench opens one or two
# Request and response headers the proxy must not copy: they describe one hop, not the message.
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


@dataclass(frozen=True)
class Impairment:
    """What one direction of the path does to each packet."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0  # extra delay, uniform in [0, jitter_ms], drawn per packet
    loss: float = 0.0  # probability a packet is dropped
    rate_kbps: float = 0.0  # a bottleneck: packets queue to leave at this bit rate (0: none)

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.rate_kbps < 0 or not 0.0 <= self.loss < 1.0:
            raise ValueError(f"impairment out of range: {self}")


@dataclass(frozen=True)
class PathSettings:
    up: Impairment = Impairment()  # client → server
    down: Impairment = Impairment()  # server → client
    seed: int = 1

    @classmethod
    def symmetric(cls, *, delay_up_ms: float = 0.0, delay_down_ms: float = 0.0, jitter_ms: float = 0.0,
                  loss: float = 0.0, rate_kbps: float = 0.0, seed: int = 1) -> PathSettings:
        return cls(Impairment(delay_up_ms, jitter_ms, loss, rate_kbps),
                   Impairment(delay_down_ms, jitter_ms, loss, rate_kbps), seed)


class PacketFate:
    """Seeded per-packet decisions for one direction: dropped (None) or the delay to hold it (s)."""

    def __init__(self, impairment: Impairment, seed: int) -> None:
        self.impairment = impairment
        self.rng = random.Random(seed)

    def __call__(self) -> float | None:
        # Both draws happen for every packet, so the delay sequence does not depend on the loss rate.
        dropped = self.rng.random() < self.impairment.loss
        jitter = self.rng.uniform(0.0, self.impairment.jitter_ms)
        return None if dropped else (self.impairment.delay_ms + jitter) / 1000.0


@dataclass
class DirectionCounters:
    packets: int = 0
    dropped: int = 0  # by the loss draw
    queue_dropped: int = 0  # by a full rate-limited queue
    link_free_at: float = 0.0  # when the rate-limited link has sent everything queued so far
    delays_ms: list[float] = field(default_factory=list)  # measured: received → handed to the socket

    def summary(self) -> dict[str, Any]:
        d = sorted(self.delays_ms)
        mean = sum(d) / len(d) if d else None
        return {"packets": self.packets, "dropped": self.dropped, "queue_dropped": self.queue_dropped,
                "loss": round((self.dropped + self.queue_dropped) / self.packets, 4) if self.packets else None,
                "delay_ms_mean": None if mean is None else round(mean, 3),
                "delay_ms_min": round(d[0], 3) if d else None, "delay_ms_max": round(d[-1], 3) if d else None}


class _Socket(asyncio.DatagramProtocol):
    def __init__(self, on_packet) -> None:
        self.on_packet = on_packet

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.on_packet(data, addr)


class UdpRelay:
    """One call's path: client ⇄ ``client_side`` [held, jittered, dropped] ``server_side`` ⇄ server."""

    def __init__(self, host: str, settings: PathSettings, index: int = 0) -> None:
        self.host = host
        self.settings = settings
        # Each relay of a path gets its own streams, still fixed by the seed.
        self.fate_up = PacketFate(settings.up, settings.seed * 1000 + 2 * index)
        self.fate_down = PacketFate(settings.down, settings.seed * 1000 + 2 * index + 1)
        self.up = DirectionCounters()
        self.down = DirectionCounters()
        self.client_addr: tuple[str, int] | None = None  # learned from the first packet the client sends
        self.server_addr: tuple[str, int] | None = None  # from the server's answer
        self.client_side: asyncio.DatagramTransport | None = None
        self.server_side: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.client_side, _ = await loop.create_datagram_endpoint(lambda: _Socket(self._from_client),
                                                                  local_addr=(self.host, 0))
        self.server_side, _ = await loop.create_datagram_endpoint(lambda: _Socket(self._from_server),
                                                                  local_addr=(self.host, 0))

    @property
    def client_facing(self) -> tuple[str, int]:
        return self.client_side.get_extra_info("sockname")[:2]

    @property
    def server_facing(self) -> tuple[str, int]:
        return self.server_side.get_extra_info("sockname")[:2]

    def _from_client(self, data: bytes, addr: tuple[str, int]) -> None:
        self.client_addr = addr
        if self.server_addr is not None:
            self._forward(data, self.fate_up, self.up, self.server_side, self.server_addr)

    def _from_server(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.client_addr is not None:  # before the client's first packet there is nowhere to send
            self._forward(data, self.fate_down, self.down, self.client_side, self.client_addr)

    def _forward(self, data: bytes, fate: PacketFate, counters: DirectionCounters,
                 transport: asyncio.DatagramTransport, addr: tuple[str, int]) -> None:
        counters.packets += 1
        hold = fate()
        if hold is None:
            counters.dropped += 1
            return
        loop = asyncio.get_running_loop()
        received = loop.time()
        rate = fate.impairment.rate_kbps
        if rate > 0:  # the bottleneck first: wait for the link, then the packet's own transmission time
            start = max(received, counters.link_free_at)
            if start - received > MAX_QUEUE_S:
                counters.queue_dropped += 1
                return
            counters.link_free_at = start + len(data) * 8 / (rate * 1000)
            hold += counters.link_free_at - received

        def send() -> None:
            counters.delays_ms.append(1000.0 * (loop.time() - received))
            if not transport.is_closing():
                transport.sendto(data, addr)

        if hold <= 0:
            send()
        else:
            loop.call_later(hold, send)

    def report(self) -> dict[str, Any]:
        return {"up": self.up.summary(), "down": self.down.summary()}

    def close(self) -> None:
        for t in (self.client_side, self.server_side):
            if t is not None:
                t.close()


# --- self-test -------------------------------------------------------------------------------------


async def self_test(settings: PathSettings, packets: int = 400, spacing_s: float = 0.002) -> dict[str, Any]:
    """Sends ``packets`` numbered datagrams each way through a relay on this host and reports what
    arrived: loss, one-way delay (send → receipt at the far socket) and how many came out of order,
    next to the settings, so a run can show the path applies what it claims."""
    loop = asyncio.get_running_loop()
    relay = UdpRelay("127.0.0.1", settings, index=MAX_SESSIONS)  # streams no call of a path uses
    await relay.start()
    arrivals: dict[str, list[tuple[int, float]]] = {"up": [], "down": []}

    class End(asyncio.DatagramProtocol):
        def __init__(self, direction: str) -> None:
            self.direction = direction

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            if len(data) == 164:
                arrivals[self.direction].append((int.from_bytes(data[:4], "big"), loop.time()))

    server, _ = await loop.create_datagram_endpoint(lambda: End("up"), local_addr=("127.0.0.1", 0))
    client, _ = await loop.create_datagram_endpoint(lambda: End("down"), local_addr=("127.0.0.1", 0))
    relay.server_addr = server.get_extra_info("sockname")[:2]
    sent: dict[str, dict[int, float]] = {"up": {}, "down": {}}
    try:
        client.sendto(b"hello", relay.client_facing)  # the relay learns where the client is
        await asyncio.sleep(0.05)
        for i in range(packets):
            for direction, sock, target in (("up", client, relay.client_facing), ("down", server, relay.server_facing)):
                sent[direction][i] = loop.time()
                sock.sendto(i.to_bytes(4, "big") + bytes(160), target)
            await asyncio.sleep(spacing_s)
        longest = max(settings.up.delay_ms + settings.up.jitter_ms, settings.down.delay_ms + settings.down.jitter_ms)
        queued = MAX_QUEUE_S if settings.up.rate_kbps or settings.down.rate_kbps else 0.0
        await asyncio.sleep(longest / 1000 + queued + 0.5)  # what is still held or queued arrives
    finally:
        relay.close()
        server.close()
        client.close()
    out: dict[str, Any] = {"settings": asdict(settings), "packets": packets}
    for direction in ("up", "down"):
        got = arrivals[direction]
        delays = sorted(1000 * (t - sent[direction][i]) for i, t in got)
        order = [i for i, _ in got]
        out[direction] = {
            "received": len(got), "loss": round(1 - len(got) / packets, 4),
            "delay_ms_mean": round(sum(delays) / len(delays), 3) if delays else None,
            "delay_ms_p50": round(delays[len(delays) // 2], 3) if delays else None,
            "delay_ms_max": round(delays[-1], 3) if delays else None,
            "reordered": sum(1 for a, b in itertools.pairwise(order) if b < a),
        }
    return out


# --- SDP -------------------------------------------------------------------------------------------

_CANDIDATE = re.compile(r"^a=candidate:\S+ (\d+) (\S+) \d+ (\S+) (\d+) typ (\S+)", re.IGNORECASE)


def host_candidates(sdp: str) -> list[tuple[str, int]]:
    """(ip, port) of the UDP host candidates of component 1 in an SDP, in order."""
    out = []
    for line in sdp.splitlines():
        m = _CANDIDATE.match(line)
        if m and m.group(1) == "1" and m.group(2).lower() == "udp" and m.group(5) == "host":
            out.append((m.group(3), int(m.group(4))))
    return out


def replace_candidates(sdp: str, ip: str, port: int) -> str:
    """The SDP with every candidate of every media section replaced by one host candidate ip:port."""
    lines = sdp.replace("\r\n", "\n").rstrip("\n").split("\n")
    out: list[str] = []
    in_media = False
    placed = False

    def close_section() -> None:
        if in_media and not placed:
            out.append(f"a=candidate:1 1 udp 2130706431 {ip} {port} typ host")

    for line in lines:
        if line.startswith("m="):
            close_section()
            in_media, placed = True, False
        elif line.startswith("a=candidate:"):
            continue
        elif line.startswith("a=end-of-candidates") and in_media and not placed:
            out.append(f"a=candidate:1 1 udp 2130706431 {ip} {port} typ host")
            placed = True
        out.append(line)
    close_section()
    return "\r\n".join(out) + "\r\n"


def local_ipv4() -> str:
    """A non-loopback IPv4 address of this machine (where the server's and Chromium's candidates are)."""
    import ifaddr  # aioice's own dependency: the addresses it gathers host candidates on

    for adapter in ifaddr.get_adapters():
        for address in adapter.ips:
            if isinstance(address.ip, str) and not address.ip.startswith("127."):
                return address.ip
    return "127.0.0.1"


# --- the HTTP front --------------------------------------------------------------------------------


class ImpairedPath:
    """An HTTP front for ``upstream`` whose calls' media go through seeded impaired UDP relays.

    ``async with ImpairedPath(url, settings) as path``: point the client (a browser page, the aiortc
    bench client) at ``path.url`` instead of ``url``.
    """

    def __init__(self, upstream: str, settings: PathSettings, host: str | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.settings = settings
        self.host = host or local_ipv4()
        self.relays: list[UdpRelay] = []
        self.url = ""
        self.changes: list[dict[str, Any]] = []  # update()s: when (s after the start) and to what
        self.started = 0.0
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ImpairedPath:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._http = aiohttp.ClientSession(auto_decompress=False)
        self.started = asyncio.get_running_loop().time()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for relay in self.relays:
            relay.close()
        if self._http is not None:
            await self._http.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def update(self, settings: PathSettings) -> None:
        """New settings from now on, for calls already open too (their random streams go on)."""
        self.changes.append({"at_s": round(asyncio.get_running_loop().time() - self.started, 3),
                             "settings": asdict(settings)})
        self.settings = settings
        for relay in self.relays:
            relay.settings = settings
            relay.fate_up.impairment = settings.up
            relay.fate_down.impairment = settings.down

    def report(self) -> dict[str, Any]:
        return {"kind": "user-space UDP relay (candidates rewritten to point at it)",
                "settings": asdict(self.settings), "changes": self.changes,
                "calls": [r.report() for r in self.relays]}

    async def _new_relay(self) -> UdpRelay:
        if len(self.relays) >= MAX_SESSIONS:
            raise web.HTTPServiceUnavailable(text="impaired path: too many calls")
        relay = UdpRelay(self.host, self.settings, len(self.relays))
        await relay.start()
        self.relays.append(relay)
        return relay

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        relay = None
        kind = None
        if request.method == "POST" and request.path == "/v1/rtc/offer":
            kind = "json"
            try:
                offer = json.loads(body)
                relay = await self._new_relay()
                offer["sdp"] = replace_candidates(offer["sdp"], *relay.server_facing)
                body = json.dumps(offer).encode()
            except (ValueError, KeyError, TypeError):
                relay, kind = None, None  # not an offer we understand: the server says why
        elif request.method == "POST" and request.path == "/whip":
            kind = "sdp"
            relay = await self._new_relay()
            body = replace_candidates(body.decode(), *relay.server_facing).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            async with self._http.request(request.method, self.upstream + str(request.rel_url), data=body,
                                          headers=headers, allow_redirects=False) as resp:
                data = await resp.read()
                out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
                if relay is not None and resp.status in (200, 201):
                    data = self._rewrite_answer(relay, kind, data)
        except aiohttp.ClientError as exc:
            raise web.HTTPBadGateway(text=f"impaired path: the server at {self.upstream} did not answer: {exc}")
        return web.Response(status=resp.status, body=data, headers=out_headers)

    def _rewrite_answer(self, relay: UdpRelay, kind: str, data: bytes) -> bytes:
        answer = json.loads(data) if kind == "json" else None
        sdp = answer["sdp"] if answer is not None else data.decode()
        candidates = host_candidates(sdp)
        if not candidates:
            raise web.HTTPBadGateway(text="impaired path: the server's answer has no UDP host candidate")
        # The server's candidate on the relay's own address if it has one, else its first.
        relay.server_addr = next((c for c in candidates if c[0] == relay.host), candidates[0])
        sdp = replace_candidates(sdp, *relay.client_facing)
        if answer is None:
            return sdp.encode()
        answer["sdp"] = sdp
        return json.dumps(answer).encode()


class PathPhases:
    """The knobs ``bench latency`` turns between its phases (``loss``, ``jitter_ms``), on a path.

    Setting either applies it to the path both ways at once, from the next packet on; the delay
    and the rate limit stay as the path was opened with.
    """

    def __init__(self, path: ImpairedPath, loss: float, jitter_ms: float) -> None:
        self._path = path
        self._loss = loss
        self._jitter_ms = jitter_ms
        self._apply()

    def _apply(self) -> None:
        s = self._path.settings
        self._path.update(PathSettings(Impairment(s.up.delay_ms, self._jitter_ms, self._loss, s.up.rate_kbps),
                                       Impairment(s.down.delay_ms, self._jitter_ms, self._loss, s.down.rate_kbps),
                                       s.seed))

    @property
    def loss(self) -> float:
        return self._loss

    @loss.setter
    def loss(self, value: float) -> None:
        self._loss = value
        self._apply()

    @property
    def jitter_ms(self) -> float:
        return self._jitter_ms

    @jitter_ms.setter
    def jitter_ms(self, value: float) -> None:
        self._jitter_ms = value
        self._apply()
