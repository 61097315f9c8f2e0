"""``lychee-rtc bench load``: its stage table, its client's accounting, and one real short run."""

from __future__ import annotations

import argparse

import numpy as np

from lychee_rtc.bench.load import run_bench
from lychee_rtc.bench.load_client import FRAME, downlink_gaps, encode
from lychee_rtc.bench.load_report import format_report
from lychee_rtc.bench.stages import OTHER, classify, parse_raw
from lychee_rtc.rtc import opus


def test_a_sample_counts_for_the_innermost_stage_and_waits_for_none():
    send = ["run_forever (asyncio/base_events.py:607)", "RTCRtpSender._run_rtp (aiortc/rtcrtpsender.py:401)",
            "RTCDtlsTransport._send_rtp (aiortc/rtcdtlstransport.py:716)", "Session.protect (pylibsrtp/__init__.py:236)"]
    assert classify(send) == "SRTP"
    assert classify(send[:2]) == "aiortc sender and receiver (Python)"
    assert classify(send[:1]) == "Python and asyncio overhead"
    assert classify(send[:1] + ["select (selectors.py:468)"]) is None  # the loop waiting: not work
    assert classify(["main (somewhere/else.py:1)"]) == OTHER
    profile = parse_raw("thread (1): MainThread;" + ";".join(send) + " 3\n"
                        "thread (1): MainThread;" + ";".join(send[:2]) + " 1\n"
                        "thread (2): decoder;select (selectors.py:468) 96\n")
    assert profile.samples == 4
    assert profile.per_call(4.0) == {"SRTP": 3.0, "aiortc sender and receiver (Python)": 1.0}


def test_the_client_counts_lost_packets_and_skipped_send_slots():
    packets = [(seq, seq * FRAME, b"", 0.02 * seq) for seq in range(10) if seq != 4]  # packet 4 lost
    packets.append((10, 12 * FRAME, b"", 0.2))  # the sender skipped two slots after packet 9
    gaps = downlink_gaps(packets)
    assert gaps.lost_packets == 1
    assert gaps.skipped_ms == 40.0


def test_the_clients_uplink_is_opus_it_encoded_once():
    sent = encode(np.zeros(48000, np.float32))
    assert len(sent) == 50
    assert all(len(opus.OpusDecoder(48000).decode(p)) == FRAME for p in sent[:3])


async def test_a_short_run_measures_server_client_relay_and_floor():
    # Real processes: a loopback server, one client process, the aiortc relay. Every step runs
    # (all_steps): a busy machine may lose a probe and judge N=1 over budget, which would stop the
    # climb; what is checked here is the measuring, not this machine's speed.
    args = argparse.Namespace(profile="loopback", config=None, url=None, server_pid=None, server_key=None,
                              sessions="1,2", workers="1", warmup=2.0, span=3.0, interval=0.5, budget_ms=100.0,
                              calls_per_client=12, relay_sessions="1", stages=None, all_steps=True, wav=None, no_floor=False,
                              json=None, markdown=None)
    report = await run_bench(args)
    steps = report.topologies[0].steps
    assert [s.sessions for s in steps] == [1, 2]
    for step in steps:
        assert step.connected == step.sessions and step.failures == []
        assert step.server_cpu_per_call is not None and step.server_cpu_per_call > 0
        assert step.client_cpu_per_call is not None and step.client_cpu_per_call > 0
        assert step.probes == 6 * step.sessions
        assert step.found >= step.probes - 1  # a busy machine may lose one; the path itself loses none
        assert step.p50_ms is not None and 0 < step.p50_ms < 1000
        assert step.within_budget is (step.found == step.probes and step.p90_ms <= args.budget_ms)
    assert report.relay[0].server_cpu_per_call > 0 and report.relay[0].found >= 5
    assert report.floor is not None and 0 < report.floor.libopus_percent < report.floor.aiortc_percent
    text = format_report(report)
    assert "plain aiortc relay" in text and "Largest N within budget" in text
