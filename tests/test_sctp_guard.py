"""Data-channel message limits enforced while SCTP fragments arrive."""

from __future__ import annotations

import json

from aiortc import RTCCertificate
from aiortc.rtcdtlstransport import RTCDtlsTransport
from aiortc.rtcicetransport import RTCIceGatherer, RTCIceTransport
from aiortc.rtcsctptransport import SCTP_DATA_FIRST_FRAG, SCTP_DATA_LAST_FRAG, DataChunk, RTCSctpTransport

from lychee_rtc.bench.client import RtcClient
from lychee_rtc.rtc.sctp_guard import SctpGuard
from lychee_rtc.server.app import REGISTRY_KEY
from lychee_rtc.session.protocol import MAX_MESSAGE_BYTES

FRAGMENT = 1172  # aiortc's user data per DATA chunk


class Association:
    """A real aiortc SCTP transport fed DATA chunks directly, as the wire would deliver them."""

    def __init__(self, guard: SctpGuard | None) -> None:
        dtls = RTCDtlsTransport(RTCIceTransport(RTCIceGatherer()), [RTCCertificate.generateCertificate()])
        self.transport = RTCSctpTransport(dtls)
        if guard is not None:
            assert guard.install(self.transport)
        self.window = self.transport._advertised_rwnd
        self.delivered: list[tuple[int, bytes]] = []
        self.transport._last_received_tsn = 999
        self.tsn = 1000

        async def receive(stream_id: int, pp_id: int, data: bytes) -> None:
            self.delivered.append((stream_id, data))

        self.transport._receive = receive

    def fragments(self, payload: bytes, stream_seq: int, stream_id: int = 1, last: bool = True) -> list[DataChunk]:
        count = max(1, -(-len(payload) // FRAGMENT))
        out = []
        for i in range(count):
            c = DataChunk()
            c.flags = (SCTP_DATA_FIRST_FRAG if i == 0 else 0) | (SCTP_DATA_LAST_FRAG if i == count - 1 and last else 0)
            c.tsn, self.tsn = self.tsn, self.tsn + 1
            c.stream_id, c.stream_seq, c.protocol = stream_id, stream_seq, 51
            c.user_data = payload[i * FRAGMENT:(i + 1) * FRAGMENT]
            out.append(c)
        return out

    async def feed(self, chunks: list[DataChunk]) -> None:
        for c in chunks:
            await self.transport._receive_data_chunk(c)


async def test_an_oversize_message_is_dropped_while_it_arrives_and_the_stream_goes_on():
    oversize: list[tuple[int, int]] = []
    guard = SctpGuard(MAX_MESSAGE_BYTES, on_oversize=lambda stream, size: oversize.append((stream, size)))
    a = Association(guard)
    await a.feed(a.fragments(b"a" * 100, 0))
    await a.feed(a.fragments(b"b" * (4 << 20), 1))  # 4 MB in one message
    await a.feed(a.fragments(b"c" * 200, 2))
    assert a.delivered == [(1, b"a" * 100), (1, b"c" * 200)]
    assert len(oversize) == 1 and oversize[0][0] == 1 and oversize[0][1] > MAX_MESSAGE_BYTES
    # Never more than one message's worth was held, and the dropped bytes went back to the window.
    assert guard.counters.peak_buffered <= MAX_MESSAGE_BYTES
    assert guard.buffered == 0 and a.transport._advertised_rwnd == a.window


async def test_fragments_of_a_message_that_never_ends_stay_bounded():
    guard = SctpGuard(MAX_MESSAGE_BYTES)
    a = Association(guard)
    await a.feed(a.fragments(b"x" * (1 << 20), 0, last=False))  # the last fragment never comes
    assert guard.buffered == 0 and guard.counters.oversize_messages == 1
    await a.feed(a.fragments(b"y" * 50_000, 0, stream_id=3, last=False))  # under the limit, on another stream
    assert guard.buffered == 50_000
    # Many streams each holding a large unfinished message: the total is bounded by the window.
    overflow: list[str] = []
    guard.on_overflow = overflow.append
    for stream_id in range(5, 40):
        await a.feed(a.fragments(b"z" * 60_000, 0, stream_id=stream_id, last=False))
    assert overflow and guard.violated
    assert guard.counters.peak_buffered <= guard.max_buffered
    assert a.delivered == []


async def test_unguarded_aiortc_buffers_the_whole_message():
    # The behaviour the guard exists for: without it, every fragment is kept until the last one.
    a = Association(None)
    await a.feed(a.fragments(b"x" * (1 << 20), 0, last=False))
    assert sum(len(c.user_data) for c in a.transport._inbound_streams[1].reassembly) == 1 << 20


async def test_the_answer_advertises_the_limit_and_an_oversize_message_gets_an_error(echo_server):
    url, app = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        await client.wait_event("session.created")
        answer = client.pc.remoteDescription.sdp
        assert f"a=max-message-size:{MAX_MESSAGE_BYTES}" in answer
        # A hostile peer ignores the advertised size (aiortc would refuse to send it otherwise).
        client.pc.sctp._remote_max_message_size = 0
        client.send(json.dumps({"type": "ping", "pad": "x" * (2 << 20)}))
        err = await client.wait_event("error", timeout=60)
        assert err["error"]["code"] == "message_too_large"
        client.send({"type": "ping", "client_time": 7.0})
        await client.wait_event("pong", timeout=20, client_time=7.0)
        guard = app[REGISTRY_KEY].calls[client.session_id].sctp_guard
        assert guard is not None and guard.counters.oversize_messages == 1
        assert guard.counters.peak_buffered <= MAX_MESSAGE_BYTES
    finally:
        await client.close()
