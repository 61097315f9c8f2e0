"""The session's event stream on its own: backlog, journal and resume, backpressure, listeners."""

from __future__ import annotations

import json

import pytest

from lychee_rtc.session.event_stream import CHANNEL_HARD_LIMIT, CHANNEL_HIGH_WATER, EventChannel, EventStream


class Peer:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.buffered = 0
        self.closed = False

    def send(self, text: str) -> None:
        if self.closed:
            raise ConnectionError("channel closed")
        self.texts.append(text)

    def channel(self) -> EventChannel:
        return EventChannel(self.send, lambda: self.buffered)

    def seqs(self) -> list[int]:
        return [json.loads(t)["seq"] for t in self.texts]


def test_events_before_a_channel_are_held_up_to_the_limit_then_sent_in_order():
    stream = EventStream("s", backlog_limit=3, journal_limit=16)
    for i in range(5):
        stream.emit("ping", n=i)
    peer = Peer()
    stream.attach(peer.channel())
    assert peer.seqs() == [3, 4, 5]
    assert stream.counters.events_dropped == 2 and stream.counters.events_out == 3
    stream.emit("pong")
    assert peer.seqs()[-1] == 6


def test_a_resumed_client_gets_what_it_missed_and_is_told_what_is_lost():
    stream = EventStream("s", backlog_limit=8, journal_limit=4)
    first = Peer()
    stream.attach(first.channel())
    for _ in range(6):
        stream.emit("ping")
    stream.detach()
    stream.emit("ping")  # seq 7, while nobody is attached
    second = Peer()
    replayed, lost = stream.resume(second.channel(), last_seq=5)
    assert (second.seqs(), replayed, lost) == ([6, 7], 2, 0)
    third = Peer()
    replayed, lost = stream.resume(third.channel(), last_seq=1)  # the journal kept only 4..7
    assert (third.seqs(), replayed, lost) == ([4, 5, 6, 7], 4, 2)


def test_a_congested_channel_loses_metrics_first_and_everything_when_the_peer_stops_reading():
    stream = EventStream("s", backlog_limit=8, journal_limit=16)
    peer = Peer()
    stream.attach(peer.channel())
    peer.buffered = CHANNEL_HIGH_WATER + 1
    stream.emit("metrics")
    stream.emit("turn.state")
    assert [json.loads(t)["type"] for t in peer.texts] == ["turn.state"]
    peer.buffered = CHANNEL_HARD_LIMIT + 1
    stream.emit("turn.state")
    assert len(peer.texts) == 1 and stream.counters.events_dropped == 2
    peer.buffered, peer.closed = 0, True
    stream.emit("turn.state")  # the channel refuses it: dropped, not raised
    assert stream.counters.events_dropped == 3
    assert stream.buffered() == 0


def test_a_channel_of_another_client_does_not_detach_the_attached_one():
    stream = EventStream("s", backlog_limit=8, journal_limit=16)
    old, new = Peer(), Peer()
    old_channel = old.channel()
    stream.attach(old_channel)
    stream.resume(new.channel(), last_seq=0)
    stream.detach(old_channel)  # the old channel's close arrives after the resume
    stream.emit("ping")
    assert new.seqs() == [1] and old.seqs() == []


@pytest.mark.allowed_logs(r"event listener failed")  # the failing listener it installs
def test_every_listener_gets_each_event_even_when_one_fails():
    stream = EventStream("s", backlog_limit=8, journal_limit=16)
    seen: list[dict] = []

    def broken(event: dict) -> None:
        raise RuntimeError("translator bug")

    stream.add_listener(broken)
    stream.add_listener(seen.append)
    event = stream.emit("turn.state", state="listening")
    assert seen == [event] and event["event_id"] == "evt_1"
    stream.remove_listener(seen.append)
    stream.emit("turn.state", state="speaking")
    assert len(seen) == 1
