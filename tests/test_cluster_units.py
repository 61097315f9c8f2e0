"""The cluster entry's own rules, without Ray: ids, how many workers, which worker, worker states.

The registry is driven here with status dictionaries shaped like a worker's (what Ray would carry);
the whole path through Ray is in test_cluster.py.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from conftest import free_port, serving

from lychee_rtc.cluster.fleet import Fleet, NoPlacement
from lychee_rtc.cluster.ids import is_worker_id, session_prefix, worker_of
from lychee_rtc.cluster.metrics import EntryMetrics
from lychee_rtc.cluster.placement import actor_options, no_room_reason, waiting_reason, worker_count, worker_settings
from lychee_rtc.cluster.registry import DEAD_AFTER_ERRORS, DOWN_AFTER_SLOW_CHECKS, NOT_PLACED, HttpFailure, Registry, WorkerView
from lychee_rtc.config import ConfigError, ClusterSettings, load_settings


def test_session_ids_name_their_worker():
    assert worker_of("sess_" + session_prefix("w3") + "0123456789abcdef") == "w3"
    assert worker_of("sess_w12-abc") == "w12"
    for foreign in ("sess_0123456789abcdef", "sess_x1-abc", "w1-abc", "sess_w1", "", "sess_w1-a/b"):
        assert worker_of(foreign) is None
    assert is_worker_id("w0") and not is_worker_id("w") and not is_worker_id("x1")
    with pytest.raises(ValueError):
        session_prefix("../w1")


def test_worker_count_follows_gpus_or_slot_groups():
    assert worker_count(ClusterSettings(workers=3), {}) == 3
    gpus = ClusterSettings(worker_gpus=1)
    assert worker_count(gpus, {"GPU": 8.0, "CPU": 64.0}) == 8
    assert worker_count(ClusterSettings(worker_gpus=2), {"GPU": 8.0}) == 4
    assert worker_count(gpus, {"CPU": 64.0}) == 0
    assert "0 GPUs" in no_room_reason(gpus, {})
    cpu = ClusterSettings()
    assert worker_count(cpu, {"lychee_rtc_worker": 3.0, "CPU": 4.0}) == 3
    assert "ray start --resources" in no_room_reason(cpu, {})


def test_actor_options_take_a_gpu_or_a_slot_group():
    gpu = actor_options(ClusterSettings(worker_gpus=1, worker_cpus=2, max_restarts=5), "w1")
    assert gpu["num_gpus"] == 1 and gpu["num_cpus"] == 2 and "resources" not in gpu
    assert gpu["name"] == "lychee-rtc-w1" and gpu["lifetime"] == "detached" and gpu["max_restarts"] == 5
    assert gpu["max_task_retries"] == 0
    cpu = actor_options(ClusterSettings(worker_resource="slots"), "w0")
    assert cpu["num_gpus"] == 0 and cpu["resources"] == {"slots": 1}


def test_worker_settings_keep_the_profile_but_not_the_entry_port():
    settings = load_settings(None, environ={}, overrides={"server": {"port": 9000}, "session": {"max_sessions": 7}})
    worker = type(settings).model_validate_json(worker_settings(settings))
    assert worker.server.port == 0 and worker.session.max_sessions == 7 and worker.engine == settings.engine


def test_cluster_settings_are_checked_at_load():
    with pytest.raises(ConfigError, match="cluster.worker_ports"):
        load_settings(None, environ={}, overrides={"cluster": {"worker_ports": [9100, 9000]}})
    with pytest.raises(ConfigError, match="cluster.workers"):
        load_settings(None, environ={}, overrides={"cluster": {"workers": 0}})
    settings = load_settings(None, environ={"LYCHEE_RTC_CLUSTER__ADDRESS": "10.0.0.1:6379"})
    assert settings.cluster.address == "10.0.0.1:6379"


def _status(worker: str, free: int, capacity: int = 4, boot: str = "b1", **extra) -> dict:
    return {"worker_id": worker, "boot": boot, "url": f"http://10.0.0.1:{9100 + int(worker[1:])}",
            "node_ip": "10.0.0.1", "pid": 100, "engine": "echo", "capacity": capacity, "free": free,
            "active": capacity - free, "ready": True, "draining": False, "drained": False, **extra}


class _Handle:
    """Stands in for a Ray actor handle: ``status.remote()`` gives an awaitable, as Ray's does."""

    def __init__(self) -> None:
        self.answers: list = []
        self.status = self

    def remote(self):
        answer = self.answers.pop(0)

        async def result():
            if isinstance(answer, BaseException):
                raise answer
            if isinstance(answer, asyncio.Future):  # answered when the test says so
                return await answer
            if answer is None:
                await asyncio.sleep(3600)  # a process Ray is restarting answers later
            return answer
        return result()


def _registry(status_timeout_s: float = 0.05) -> Registry:
    return Registry(EntryMetrics(), poll_interval_s=0.01, status_timeout_s=status_timeout_s)


def test_least_loaded_worker_with_room_is_chosen():
    registry = _registry()
    for worker, free in (("w0", 1), ("w1", 3), ("w2", 0)):
        view = registry.add(worker, None)
        view.status, view.state = _status(worker, free), "ready"
    assert registry.choose(set()).worker_id == "w1"
    for _ in range(2):  # offers being forwarded count against it
        registry.workers["w1"].placements.begin()
    assert registry.choose(set()).worker_id in ("w0", "w1")
    registry.workers["w1"].placements.begin().taken()  # and so does a call no report shows yet
    assert registry.choose(set()).worker_id == "w0"
    # By the count w1 has no room left either, but only its own answer says so (the count may hold
    # a call its report already shows): it is asked. w2 reported no room and is not.
    assert registry.workers["w1"].free == 0 and registry.choose({"w0"}).worker_id == "w1"
    assert registry.choose({"w0", "w1"}) is None
    registry.mark_full(registry.workers["w1"])  # it answered full
    registry.workers["w0"].state = "draining"
    assert registry.choose(set()) is None
    assert registry.capacity == 8 and registry.free == 0
    # A request that takes no slot (minting a client key) goes to any ready worker, full or not.
    assert registry.choose_any(set()).worker_id == "w1"  # the least active of the ready ones
    assert registry.choose_any({"w1"}).worker_id == "w2"  # full, still able to mint
    registry.workers["w2"].state = "down"
    assert registry.choose_any({"w1"}) is None  # draining and down workers are not asked


async def test_a_refused_websocket_handshake_comes_back_as_a_json_error():
    from aiohttp import web

    from lychee_rtc.cluster.proxy import refused_handshake

    async def refuse(request):
        return web.json_response({"error": {"code": "x"}}, status=int(request.query["status"]),
                                 headers={"WWW-Authenticate": "Bearer", "X-Other": "1"})
    app = web.Application()
    app.router.add_get("/ws", refuse)
    async with serving(app) as url, aiohttp.ClientSession() as http:
        for status, code in ((401, "unauthorized"), (404, "not_found"), (409, "conflict"), (418, "refused")):
            with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
                await http.ws_connect(f"{url}/ws?status={status}")
            response = refused_handshake(caught.value)
            assert response.status == status and response.content_type == "application/json"
            assert json.loads(response.body)["error"]["code"] == code
            assert response.headers["WWW-Authenticate"] == "Bearer" and "X-Other" not in response.headers


async def test_a_worker_that_stops_answering_is_down_and_a_new_process_counts_as_a_restart():
    registry = _registry()
    handle = _Handle()
    view: WorkerView = registry.add("w0", handle)
    handle.answers = [_status("w0", 2), None]  # two calls on it
    await registry._poll(view)
    assert view.state == "ready" and registry.capacity == 4 and view.free == 2
    for _ in range(DOWN_AFTER_SLOW_CHECKS - 1):  # a late answer or two: a busy host, still ready
        await registry._poll(view)
        assert view.state == "ready" and registry.capacity == 4
    await registry._poll(view)  # no answer in time again: down, no capacity, not chosen
    assert view.state == "down" and registry.capacity == 0 and registry.choose(set()) is None
    assert f"{DOWN_AFTER_SLOW_CHECKS} polls in a row" in view.reason
    view.probe.cancel()
    view.probe = None
    handle.answers = [_status("w0", 4, boot="b2")]
    await registry._poll(view)
    assert view.state == "ready" and view.restarts == 1 and view.lost_sessions == 2
    assert registry.capacity == 4


async def test_a_worker_whose_http_port_fails_stays_down_while_ray_still_answers():
    registry = _registry()
    handle = _Handle()
    view = registry.add("w0", handle)
    # Asked from the second poll on: the first one learns the worker's URL.
    failures: list[HttpFailure | None] = [HttpFailure("connection refused"), HttpFailure("connection refused"), None]

    async def http_alive(url: str) -> HttpFailure | None:
        return failures.pop(0)
    registry.http_alive = http_alive
    handle.answers = [_status("w0", 4)] * 4
    await registry._poll(view)
    assert view.state == "ready"
    await registry._poll(view)
    assert view.state == "down" and "refused" in view.reason
    await registry._poll(view)
    assert view.state == "down"  # the same process answers Ray, but cannot take calls
    await registry._poll(view)
    assert view.state == "ready"


async def test_a_slow_health_check_on_a_busy_host_is_not_a_dead_worker():
    registry = _registry()
    handle = _Handle()
    view = registry.add("w0", handle)
    slow = HttpFailure("/healthz: no answer in time", timed_out=True)
    failures: list[HttpFailure | None] = [slow, None] + [slow] * DOWN_AFTER_SLOW_CHECKS

    async def http_alive(url: str) -> HttpFailure | None:
        return failures.pop(0)
    registry.http_alive = http_alive
    handle.answers = [_status("w0", 4)] * (3 + DOWN_AFTER_SLOW_CHECKS)
    await registry._poll(view)  # learns the URL
    await registry._poll(view)  # one late answer
    assert view.state == "ready" and registry.free == 4
    await registry._poll(view)  # on time again: the count starts over
    for k in range(DOWN_AFTER_SLOW_CHECKS):
        await registry._poll(view)
        assert view.state == ("down" if k == DOWN_AFTER_SLOW_CHECKS - 1 else "ready")
    assert "no answer in time" in view.reason


async def test_a_worker_still_loading_its_engine_is_starting_not_down():
    registry = _registry()
    handle = _Handle()
    view = registry.add("w0", handle)
    handle.answers = [None]  # its constructor (the engine start) has not returned yet
    await registry._poll(view)
    await registry._poll(view)
    assert view.state == "starting" and registry.capacity == 0
    view.probe.cancel()


async def test_a_worker_ray_is_restarting_stays_down_however_long_it_takes():
    class Restarting(Exception):
        pass

    registry = _registry()
    registry.restarting = lambda exc: isinstance(exc, Restarting)
    handle = _Handle()
    view = registry.add("w0", handle)
    # Its node was lost: every status request fails at once until Ray finds it room again.
    handle.answers = [_status("w0", 4)] + [Restarting("the actor is restarting")] * (3 * DEAD_AFTER_ERRORS) \
        + [dict(_status("w0", 4), boot="b2", pid=2)]
    await registry._poll(view)
    for _ in range(3 * DEAD_AFTER_ERRORS):
        await registry._poll(view)
        assert view.state == "down" and registry.capacity == 0
    await registry._poll(view)
    assert view.state == "ready" and view.restarts == 1


@pytest.mark.allowed_logs('worker w0 is dead: RuntimeError: actor died')
async def test_a_worker_ray_gave_up_on_is_dead():
    registry = _registry()
    handle = _Handle()
    view = registry.add("w0", handle)
    handle.answers = [_status("w0", 4)] + [RuntimeError("actor died")] * DEAD_AFTER_ERRORS
    await registry._poll(view)
    for _ in range(DEAD_AFTER_ERRORS - 1):
        await registry._poll(view)
        assert view.state == "down"
    await registry._poll(view)
    assert view.state == "dead" and "actor died" in view.reason and registry.capacity == 0
    await registry._poll(view)  # not asked again


async def _poll_in_background(registry: Registry, view: WorkerView, answer: asyncio.Future) -> asyncio.Task:
    """A poll whose status request is on its way (sent, not answered) when this returns."""
    view.handle.answers = [answer]
    poll = asyncio.ensure_future(registry._poll(view))
    while view.probe is None:
        await asyncio.sleep(0)
    return poll


async def test_a_report_requested_before_a_placement_does_not_erase_it():
    registry = _registry(status_timeout_s=30)
    handle = _Handle()
    view = registry.add("w0", handle)
    handle.answers = [_status("w0", 2, capacity=2)]
    await registry._poll(view)
    assert view.free == 2

    stale = asyncio.get_running_loop().create_future()
    poll = await _poll_in_background(registry, view, stale)  # requested before the call exists
    placed = view.placements.begin()
    assert view.free == 1  # in flight: counted already
    placed.taken()  # the worker answered the offer: the call is there now
    stale.set_result(_status("w0", 2, capacity=2))  # computed before the call: still 2 free
    await poll
    assert view.state == "ready" and view.status["free"] == 2
    assert view.free == 1 and registry.choose(set()) is view  # the call still counts

    handle.answers = [_status("w0", 1, capacity=2)]  # requested after the answer: it counts the call
    await registry._poll(view)
    assert view.placements.count == 0 and view.free == 1  # counted once, by the worker


async def test_a_fresh_report_replaces_what_the_entry_counted():
    registry = _registry()
    handle = _Handle()
    view = registry.add("w0", handle)
    handle.answers = [_status("w0", 2, capacity=2)]
    await registry._poll(view)
    for _ in range(2):
        view.placements.begin().taken()
    assert view.free == 0
    # One of the two calls ended at the worker before the next report: that report says so.
    handle.answers = [_status("w0", 1, capacity=2)]
    await registry._poll(view)
    assert view.placements.count == 0 and view.free == 1


async def test_a_placement_that_failed_or_was_refused_counts_no_longer():
    registry = _registry()
    handle = _Handle()
    view = registry.add("w0", handle)
    handle.answers = [_status("w0", 2, capacity=2)]
    await registry._poll(view)
    unreachable, refused = view.placements.begin(), view.placements.begin()
    assert view.free == 0
    unreachable.released()
    refused.released()
    refused.taken()  # a placement ends once: a late second outcome changes nothing
    assert view.free == 2 and view.placements.count == 0


async def test_a_worker_that_answered_full_takes_nothing_until_a_fresh_report():
    registry = _registry(status_timeout_s=30)
    handle = _Handle()
    view = registry.add("w0", handle)
    handle.answers = [_status("w0", 2, capacity=2)]
    await registry._poll(view)
    stale = asyncio.get_running_loop().create_future()
    poll = await _poll_in_background(registry, view, stale)
    registry.mark_full(view)  # another entry filled it
    stale.set_result(_status("w0", 2, capacity=2))
    await poll
    assert view.free == 0 and registry.choose(set()) is None
    handle.answers = [_status("w0", 1, capacity=2)]
    await registry._poll(view)
    assert view.free == 1


def test_a_worker_ray_cannot_place_says_why():
    cpu = ClusterSettings(worker_cpus=0)
    plain_node = {"CPU": 4.0, "memory": 1e9}
    reason = waiting_reason(cpu, [plain_node, plain_node], plain_node)
    assert "no node offers the resource 'lychee_rtc_worker'" in reason
    assert "--resources '{\"lychee_rtc_worker\": N}'" in reason
    slot_node = {**plain_node, "lychee_rtc_worker": 1.0}
    taken = waiting_reason(cpu, [slot_node], plain_node)  # the one slot is another worker's
    assert taken.startswith("waiting for room") and "cluster.workers" in taken
    assert waiting_reason(cpu, [slot_node], slot_node) is None  # room: Ray is about to place it
    gpu = ClusterSettings(worker_gpus=1)
    assert "no node has 1 GPU" in waiting_reason(gpu, [plain_node], plain_node)
    many_cpus = ClusterSettings(worker_cpus=8)
    assert "worker_cpus" in waiting_reason(many_cpus, [{**plain_node, "lychee_rtc_worker": 2.0}], plain_node)


async def test_a_starting_worker_shows_why_it_is_not_placed_until_it_is():
    registry = _registry()
    handle = _Handle()
    view = registry.add("w0", handle)
    why: list[str | None] = ["no node offers the resource 'x'", None]

    async def unplaced(v: WorkerView) -> str | None:
        return why.pop(0)
    registry.unplaced = unplaced
    handle.answers = [None]  # Ray holds the status request until the actor runs somewhere
    await registry._poll(view)
    assert view.state == "starting" and view.reason == NOT_PLACED + "no node offers the resource 'x'"
    assert view.describe()["reason"] == view.reason
    await registry._poll(view)  # placed now, loading: the reason goes
    assert view.state == "starting" and view.reason == ""
    view.probe.cancel()


def _fleet_with(*free: int) -> Fleet:
    fleet = Fleet(load_settings(None, environ={}))
    for index, slots in enumerate(free):
        view = fleet.registry.add(f"w{index}", None)
        view.status, view.state = _status(f"w{index}", slots, capacity=2), "ready"
    return fleet


async def test_the_fleet_tries_the_next_worker_and_counts_what_it_placed():
    from lychee_rtc.cluster.proxy import WorkerUnreachable

    fleet = _fleet_with(2, 1)
    w0, w1 = fleet.registry.workers["w0"], fleet.registry.workers["w1"]

    async def unreachable(view):
        raise WorkerUnreachable("connection refused")
    refused = await fleet.on_a_worker(unreachable, lambda a: False, lambda a: True)
    assert isinstance(refused, NoPlacement) and refused.status == 503 and refused.code == "no_worker_ready"
    assert w0.state == w1.state == "down" and w0.placements.count == w1.placements.count == 0

    fleet = _fleet_with(2, 2)
    w0, w1 = fleet.registry.workers["w0"], fleet.registry.workers["w1"]
    answers = {"w0": "full", "w1": "call"}
    placed = await fleet.on_a_worker(lambda view: _answer(answers[view.worker_id]), lambda a: a == "full",
                                     lambda a: a == "call")
    assert placed.view is w1 and placed.answer == "call"
    assert w0.free == 0 and w0.placements.count == 0  # full until a fresh report, nothing placed there
    assert w1.free == 1 and w1.placements.count == 1  # counted until a fresh report

    later = await fleet.on_a_worker(lambda view: _answer("call"), lambda a: False, lambda a: True, settle_later=True)
    assert later.view is w1 and w1.placements.in_flight == 1  # the caller ends it
    later.placement.taken()
    assert w1.placements.in_flight == 0 and w1.placements.count == 2 and w1.free == 0
    # The count says w1 is full now, but its last report said 2 free: it is asked, and answers.
    asked: list[str] = []

    async def full_now(view):
        asked.append(view.worker_id)
        return "full"
    nothing = await fleet.on_a_worker(full_now, lambda a: a == "full", lambda a: a == "call")
    assert isinstance(nothing, NoPlacement) and nothing.code == "server_full"
    assert asked == ["w1"]  # w0 had answered full before: not asked again
    asked.clear()
    again = await fleet.on_a_worker(full_now, lambda a: a == "full", lambda a: a == "call")
    assert isinstance(again, NoPlacement) and again.code == "server_full" and asked == []


async def test_a_call_counted_twice_by_a_stale_report_is_not_refused_while_the_worker_has_room():
    """A report requested before an answer but written after it shows the call the entry still
    counts: by the count the worker is full, but it has a slot, and the next offer gets it."""
    fleet = Fleet(load_settings(None, environ={}))
    registry = fleet.registry
    registry.http_alive = None  # the workers' HTTP ports are not checked here
    handle = _Handle()
    view = registry.add("w0", handle)
    handle.answers = [_status("w0", 2, capacity=2)]
    await registry._poll(view)
    stale = asyncio.get_running_loop().create_future()
    poll = await _poll_in_background(registry, view, stale)  # requested before the call
    view.placements.begin().taken()  # the worker answered with a call
    stale.set_result(_status("w0", 1, capacity=2))  # ... and ran the request after that: it shows it
    await poll
    assert view.free == 0 and view.placements.count == 1  # counted twice
    placed = await fleet.on_a_worker(lambda v: _answer("call"), lambda a: a == "full", lambda a: a == "call")
    assert not isinstance(placed, NoPlacement) and placed.view is view
    handle.answers = [_status("w0", 0, capacity=2)]  # a fresh report: both calls, counted by the worker
    await registry._poll(view)
    assert view.placements.count == 0 and view.free == 0 and registry.choose(set()) is None


async def _answer(value: str) -> str:
    return value


async def test_the_relay_reports_the_workers_first_frame():
    """A carrier's stream: the worker sends nothing until it has admitted the call."""
    from aiohttp import web

    from lychee_rtc.cluster.proxy import open_websocket, relay_websocket

    async def worker(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        connected.set()
        async for message in ws:
            await ws.send_str("admitted: " + message.data)
        return ws

    replies: list[str] = []
    connected = asyncio.Event()
    relayed: asyncio.Future = asyncio.get_running_loop().create_future()

    async def entry(request):
        async with aiohttp.ClientSession() as http:
            upstream = await open_websocket(http, f"http://127.0.0.1:{worker_port}", request, 10)
            on_first = lambda: replies.append("first")  # noqa: E731
            response = await relay_websocket(request, upstream, on_first_reply=on_first)
        relayed.set_result(None)
        return response

    worker_app, entry_app = web.Application(), web.Application()
    worker_app.router.add_get("/ws", worker)
    entry_app.router.add_get("/ws", entry)
    runners = []
    worker_port, entry_port = free_port(), free_port()
    for app, port in ((worker_app, worker_port), (entry_app, entry_port)):
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"http://127.0.0.1:{entry_port}/ws") as carrier:
                await asyncio.wait_for(connected.wait(), 10)  # the relay is up; the worker has said nothing
                assert replies == []
                await carrier.send_str("start")
                assert (await carrier.receive_str(timeout=10)) == "admitted: start"
                assert replies == ["first"]
                await carrier.send_str("media")
                assert (await carrier.receive_str(timeout=10)) == "admitted: media"
                assert replies == ["first"]  # once
            await asyncio.wait_for(relayed, 10)
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_the_entry_lists_and_streams_recordings_from_the_worker_that_holds_them(tmp_path):
    """The entry's recording routes against two workers that are plain HTTP servers (what the
    workers answer is tested with real servers in test_recording*.py; the path through Ray in
    test_cluster.py). A recording larger than any answer the entry holds whole passes through."""
    import hashlib
    import os

    from aiohttp import web

    from lychee_rtc.cluster.entry import FLEET_KEY, create_entry_app
    from lychee_rtc.cluster.proxy import MAX_RESPONSE_BYTES

    audio = os.urandom(MAX_RESPONSE_BYTES + 1_000_003)
    audio_file = tmp_path / "audio.ogg"
    audio_file.write_bytes(audio)
    kept = {"w0": {"sess_w0-aaaa": 20.0}, "w1": {"sess_w1-bbbb": 10.0, "sess_w1-cccc": 30.0}}
    seen_auth: list[str | None] = []

    def worker_app(worker: str) -> web.Application:
        async def listing(request):
            if request.headers.get("Authorization") != "Bearer key":
                return web.json_response({"error": {"code": "unauthorized"}}, status=401)
            return web.json_response({"recordings": [{"session_id": s, "started_at": t} for s, t in kept[worker].items()]})

        async def recording(request):
            seen_auth.append(request.headers.get("Authorization"))
            session = request.match_info["session_id"]
            if session not in kept[worker]:
                return web.json_response({"error": {"code": "recording_not_found"}}, status=404)
            if request.method == "DELETE":
                return web.json_response({"error": {"code": "recording_in_progress"}}, status=409)
            if request.path.endswith("/events"):
                return web.Response(body=b'{"type": "session.created"}\n', content_type="application/x-ndjson")
            return web.FileResponse(audio_file, headers={"Content-Type": "audio/ogg"})  # as a worker serves it

        app = web.Application()
        app.router.add_get("/v1/recordings", listing)
        app.router.add_get("/v1/sessions/{session_id}/recording", recording)
        app.router.add_get("/v1/sessions/{session_id}/recording/events", recording)
        app.router.add_delete("/v1/sessions/{session_id}/recording", recording)
        return app

    entry_app = create_entry_app(load_settings(None, environ={}))
    entry_app.on_startup.clear()  # no Ray: the fleet's workers are set up by hand below
    entry_app.on_cleanup.clear()
    fleet = entry_app[FLEET_KEY]
    runners = []
    ports = {"w0": free_port(), "w1": free_port(), "entry": free_port()}
    try:
        for name, app in (("w0", worker_app("w0")), ("w1", worker_app("w1")), ("entry", entry_app)):
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", ports[name]).start()
            runners.append(runner)
        fleet.http = aiohttp.ClientSession(auto_decompress=False)
        for worker in ("w0", "w1"):
            view = fleet.registry.add(worker, None)
            view.status, view.state = _status(worker, 4, url=f"http://127.0.0.1:{ports[worker]}"), "ready"
        entry = f"http://127.0.0.1:{ports['entry']}"
        key = {"Authorization": "Bearer key"}
        async with aiohttp.ClientSession() as http:
            async with http.get(entry + "/v1/recordings", headers=key) as r:
                assert r.status == 200
                assert [m["session_id"] for m in (await r.json())["recordings"]] == [
                    "sess_w1-bbbb", "sess_w0-aaaa", "sess_w1-cccc"]  # oldest first, across workers
            async with http.get(entry + "/v1/recordings") as r:
                assert r.status == 401  # the workers' refusal, as it came
            async with http.get(entry + "/v1/sessions/sess_w1-cccc/recording", headers={"Authorization": "Bearer t"}) as r:
                assert r.status == 200 and r.content_type == "audio/ogg" and r.content_length == len(audio)
                digest = hashlib.sha256()
                async for chunk in r.content.iter_chunked(1 << 16):
                    digest.update(chunk)
                assert digest.digest() == hashlib.sha256(audio).digest()
            assert seen_auth[-1] == "Bearer t"  # the session's token reached the worker
            async with http.get(entry + "/v1/sessions/sess_w1-cccc/recording", headers={"Range": "bytes=100-"}) as r:
                assert r.status == 206 and await r.read() == audio[100:]  # resuming a download
            async with http.get(entry + "/v1/sessions/sess_w0-aaaa/recording/events") as r:
                assert r.status == 200 and r.content_type == "application/x-ndjson"
            async with http.delete(entry + "/v1/sessions/sess_w0-aaaa/recording") as r:
                assert r.status == 409 and (await r.json())["error"]["code"] == "recording_in_progress"
            async with http.get(entry + "/v1/sessions/sess_w0-zzzz/recording") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "recording_not_found"
            for unknown in ("sess_w7-aaaa", "nonsense"):  # no such worker: the entry answers itself
                async with http.get(f"{entry}/v1/sessions/{unknown}/recording") as r:
                    assert r.status == 404 and (await r.json())["error"]["code"] == "recording_not_found"
            fleet.registry.workers["w1"].state = "dead"
            async with http.get(entry + "/v1/sessions/sess_w1-bbbb/recording") as r:
                body = await r.json()
                assert r.status == 404 and "its worker w1 is dead" in body["error"]["message"]
    finally:
        if fleet.http is not None:
            await fleet.http.close()
        for runner in runners:
            await runner.cleanup()


def test_the_entry_serves_every_route_a_single_server_does(tmp_path):
    """The entry fronts the same routes as a single server of the same profile (every surface on),
    with the same access level each, plus its own /v1/cluster/* routes."""
    from lychee_rtc.cluster.entry import create_entry_app
    from lychee_rtc.server.app import create_app
    from lychee_rtc.server.route_table import table_of

    overrides = {"gateway": {"janus": {"enabled": True}}, "recording": {"directory": str(tmp_path)}}
    settings = load_settings("configs/cluster-echo.yaml", environ={}, overrides=overrides)
    single = {(r.method, r.shown_path): r.access for r in table_of(create_app(settings)).routes}
    entry_app = create_entry_app(settings)
    entry = {(r.method, r.shown_path): r.access for r in table_of(entry_app).routes}
    missing = sorted(set(single) - set(entry))
    assert not missing, f"routes a single server serves and the entry does not: {missing}"
    assert {k: entry[k] for k in single} == single
    assert {path for _, path in set(entry) - set(single)} == {
        "/v1/cluster/workers", "/v1/cluster/workers/{worker_id}/drain", "/v1/cluster/workers/{worker_id}/metrics"}
    assert table_of(entry_app).undeclared(entry_app) == []
