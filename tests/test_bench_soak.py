"""The soak bench, briefly: two callers, two calls each (one plain, one cancelled, one barged into,
one vanished), through the CLI against an echo server in this process."""

from __future__ import annotations

import argparse
import gc
import json
import os

import pytest
from conftest import PATIENT_WINDOWS, running_server, speech_fixture
from lychee_rtc.bench.cli import run_bench
from lychee_rtc.bench.soak import PLANS
from lychee_rtc.server.app import ENGINE_KEY, REGISTRY_KEY
from lychee_rtc.session.session import DuplexSession

# A vanished call is suspended after media_timeout_s and freed after resume_window_s more.
SHORT_LOSS = {"media_timeout_s": 1.5, "resume_window_s": 1.0}


@pytest.mark.timeout(600)  # four calls of speech in real time, one left to vanish and time out
async def test_a_short_soak_ends_every_call_and_leaves_no_session(tmp_path):
    # Callers 0 and 1 start at rotation entries 0 and 4: their first two calls cover every kind.
    kinds = [PLANS[i] for i in (0, 1, 4, 5)]
    assert {p.interrupt for p in kinds} == {"none", "cancel", "barge"}
    assert {p.end for p in kinds} == {"close", "vanish"}
    async with running_server(session={**PATIENT_WINDOWS, **SHORT_LOSS}) as (url, app):
        # The server shares this process, so its samples include the callers: only the shape is checked.
        args = argparse.Namespace(bench="soak", extra_args=[
            "--url", url, "--pid", str(os.getpid()), "--calls", "2", "--rounds", "2", "--minutes", "10",
            "--sample-every", "2", "--drain-timeout", "120", "--out", str(tmp_path / "soak"),
            # The suite's recordings: no synthesizer needed.
            "--wav", str(speech_fixture("Hello there. This is a test of the echo engine, one two three.")),
            "--interjection-wav", str(speech_fixture("Wait, stop, stop please, I have a question for you.", "en+f3"))])
        status = await run_bench(args)
        assert not app[REGISTRY_KEY].calls
        assert app[ENGINE_KEY].free_slots == app[ENGINE_KEY].capabilities.max_sessions
        # And nothing of the ended calls is still reachable (a task that outlived its session's close
        # used to keep the whole call, peer connection included).
        gc.collect()
        # type(), not isinstance(): the latter reads __class__, which some lazy module attributes warn on
        assert not [o for o in gc.get_objects() if issubclass(type(o), DuplexSession)]

    report = json.loads((tmp_path / "soak.json").read_text())
    tally = report["tally"]
    assert tally["error_kinds"] == {} and tally["errors"] == 0, tally
    assert status == 0
    assert tally["placed"] == 4 and tally["refused"] == 0
    assert tally["completed"] == 3 and tally["vanished"] == 1
    assert tally["cancelled"] == 1 and tally["barged"] == 1
    # Every call's answer ended (the barged call's interjection was answered too), the vanished one aside.
    assert tally["responses"] == 4

    assert report["drained"] is True and report["drain_s"] >= 0
    samples = report["samples"]
    assert [s["phase"] for s in samples][0] == "calls" and samples[-1]["phase"] == "drained"
    assert all(s["t_s"] <= t["t_s"] for s, t in zip(samples, samples[1:]))
    last = samples[-1]
    assert last["active"] == 0 and last["listed"] == 0 and last["free"] == 4
    assert last["rss_mb"] > 0 and last["threads"] >= 1 and last["fds"] >= 3
    assert max(s["active"] for s in samples) >= 1  # the calls were seen while they lasted
    for series in ("rss_mb", "threads", "fds"):
        assert set(report[series]) == {"start", "end", "max", "slope_per_hour"}
        assert report[series]["max"] >= report[series]["end"]
    # The vanished call was not closed by the client: the server ended it after its resume window.
    assert report["closed_by_reason"].get("client_closed") == 3
    assert sum(report["closed_by_reason"].values()) == 4 == report["sessions_created"]

    markdown = (tmp_path / "soak.md").read_text()
    assert "| t (s) | phase | RSS MB | threads | fds | active | listed | free | load (1 min) |" in markdown
    assert markdown.count("\n| ") >= len(samples) + 2 + 3
