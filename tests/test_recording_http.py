"""Recordings over HTTP (fetch, list, delete, who may), turned on and off by the session itself,
and retention by age and total size."""

from __future__ import annotations

import json
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from contract import check_response
from conftest import running_server, wait_until
from recording_support import decode

from lychee_rtc.bench.client import RATE, RtcClient
from lychee_rtc.config import RecordingSettings
from lychee_rtc.media.recording.store import RecordingBusy, RecordingStore

KEY = "server-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
TONE = (0.2 * np.sin(2 * np.pi * 440 * np.arange(RATE * 2) / RATE)).astype(np.float32)


async def _call(url: str, **session) -> RtcClient:
    client = RtcClient(url, auth_token=KEY)
    await client.connect(session=session or None)
    await client.wait_event("session.created", timeout=60)
    return client


async def recording_finished(folder: Path) -> None:
    """Wait until the recording in ``folder`` is complete, as its meta.json says."""
    meta = folder / "meta.json"
    await wait_until(lambda: meta.exists() and json.loads(meta.read_text())["status"] == "complete", 60,
                     "the recording to be finished")


async def test_recordings_are_fetched_listed_and_deleted_by_who_may(tmp_path):
    recording = {"enabled": True, "directory": str(tmp_path)}
    async with running_server(server={"auth_token": KEY}, recording=recording) as (url, _):
        a, b = await _call(url), await _call(url)
        try:
            start = a.mic.feed(TONE)
            await a.wait_sent(round(start * RATE) + len(TONE))
            async with aiohttp.ClientSession() as http:
                rec = f"{url}/v1/sessions/{a.session_id}/recording"
                # During the call: its own token or the server key; another session's token is no key.
                for headers, status in ((a.auth_headers, 200), (ADMIN, 200), (b.auth_headers, 401), ({}, 401)):
                    async with http.get(f"{rec}/events", headers=headers) as resp:
                        assert resp.status == status, (headers, await resp.text())
                        if status == 401:
                            check_response("/v1/sessions/{session_id}/recording/events", "GET", resp.status,
                                           resp.headers, await resp.read())
                async with http.get(f"{url}/v1/sessions/{a.session_id}", headers=a.auth_headers) as resp:
                    body = await resp.read()
                    check_response("/v1/sessions/{session_id}", "GET", resp.status, resp.headers, body)
                    assert json.loads(body)["recording"]["state"] == "recording"
                async with http.delete(rec, headers=a.auth_headers) as resp:
                    assert resp.status == 409
                    body = await resp.read()
                    check_response("/v1/sessions/{session_id}/recording", "DELETE", 409, resp.headers, body)
                    assert json.loads(body)["error"]["code"] == "recording_in_progress"
                async with http.get(f"{url}/v1/recordings", headers=a.auth_headers) as resp:
                    assert resp.status == 401  # the listing is the operator's
                async with http.get(f"{url}/v1/recordings", headers=ADMIN) as resp:
                    body = await resp.read()
                    check_response("/v1/recordings", "GET", resp.status, resp.headers, body)
                    listed = {r["session_id"]: r for r in json.loads(body)["recordings"]}
                assert listed[a.session_id]["status"] == "recording" and b.session_id in listed
                assert "token_sha256" not in listed[a.session_id]

                for client in (a, b):
                    async with http.delete(f"{url}/v1/sessions/{client.session_id}", headers=client.auth_headers):
                        pass

                async def finished() -> bool:
                    async with http.get(f"{url}/v1/recordings", headers=ADMIN) as resp:
                        return all(r["status"] == "complete" for r in (await resp.json())["recordings"])

                await wait_until(finished, 60, "both recordings to be finished")
                # After the call the session is gone; its token still opens its recording.
                async with http.get(rec, headers=a.auth_headers) as resp:
                    assert resp.status == 200 and resp.headers["Content-Type"].startswith("audio/ogg")
                    audio = decode(await resp.read())
                assert np.max(np.abs(audio[:, 0])) > 0.1  # the tone the caller sent
                async with http.get(rec, headers=b.auth_headers) as resp:
                    assert resp.status == 401
                async with http.get(f"{url}/v1/sessions/sess_nope/recording", headers=ADMIN) as resp:
                    body = await resp.read()
                    check_response("/v1/sessions/{session_id}/recording", "GET", 404, resp.headers, body)
                    assert json.loads(body)["error"]["code"] == "recording_not_found"
                async with http.get(f"{url}/v1/sessions/..%2F..%2Fetc/recording", headers=ADMIN) as resp:
                    assert resp.status == 404
                async with http.delete(rec, headers=a.auth_headers) as resp:
                    assert resp.status == 204
                async with http.get(rec, headers=ADMIN) as resp:
                    assert resp.status == 404
                assert not (tmp_path / a.session_id).exists() and (tmp_path / b.session_id).exists()
        finally:
            await a.close()
            await b.close()


async def test_a_session_turns_its_recording_on_pauses_and_resumes_it(tmp_path):
    async with running_server(recording={"directory": str(tmp_path)}) as (url, _):
        client = RtcClient(url)
        await client.connect()
        try:
            created = await client.wait_event("session.created", timeout=60)
            assert created["session"]["recording"] == "off"
            assert not any(tmp_path.iterdir())  # off by default: nothing written
            for on in (True, False, True):
                client.send({"type": "session.update", "session": {"recording": on}})
                updated = await client.wait_event("session.updated", timeout=60, after=len(client.events))
                assert updated["session"]["recording"] == ("recording" if on else "paused")
            async with aiohttp.ClientSession() as http:
                async with http.delete(f"{url}/v1/sessions/{client.session_id}", headers=client.auth_headers):
                    pass
            folder = tmp_path / client.session_id
            await recording_finished(folder)
            kinds = [json.loads(line)["type"] for line in (folder / "events.jsonl").read_text().splitlines()]
            # Paused means nothing captured: not even the session.updated that said so.
            paused = kinds.index("recording.paused")
            assert kinds[paused + 1] == "recording.resumed"
            assert kinds[0] == "recording.started" and kinds[-1] == "recording.stopped"
            assert kinds.count("session.updated") == 2  # the one that started it, the one that resumed it
        finally:
            await client.close()


async def test_a_profile_that_keeps_recording_to_itself_refuses_the_client(tmp_path):
    recording = {"enabled": True, "client_control": False, "directory": str(tmp_path)}
    async with running_server(recording=recording) as (url, _):
        client = RtcClient(url)
        await client.connect()
        try:
            await client.wait_event("session.created", timeout=60)
            client.send({"type": "session.update", "session": {"recording": False}})
            error = await client.wait_event("error", timeout=60)
            assert error["error"]["code"] == "recording_not_allowed"
            # The recording's writer creates its file on its own thread.
            await wait_until(lambda: (tmp_path / client.session_id / "audio.ogg").exists(), 10, "the recording's file")
        finally:
            await client.close()


# --- retention (the store alone) ----------------------------------------------------------------------

def _finished_recording(store: RecordingStore, session_id: str, size: int, ended_at: float) -> None:
    folder = store.directory / session_id
    folder.mkdir(parents=True)
    (folder / "audio.ogg").write_bytes(b"\0" * size)
    meta = {"session_id": session_id, "status": "complete", "started_at": ended_at - 10, "ended_at": ended_at}
    (folder / "meta.json").write_text(json.dumps(meta))


def test_retention_removes_what_is_too_old(tmp_path):
    mb = 1 << 20
    store = RecordingStore(RecordingSettings(directory=tmp_path, max_age_s=3600, max_total_bytes=4 * mb))
    now = time.time()
    _finished_recording(store, "sess_ancient", 1000, now - 7200)
    _finished_recording(store, "sess_old", mb, now - 1800)
    _finished_recording(store, "sess_new", mb, now - 60)
    assert store.enforce_retention(now) == ["sess_ancient"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sess_new", "sess_old"]
    assert store.enforce_retention(now + 2000) == ["sess_old"]  # its hour is up
    assert [r["session_id"] for r in store.list()] == ["sess_new"]


def test_retention_over_the_total_goes_oldest_first_and_spares_a_live_recording(tmp_path):
    mb = 1 << 20
    store = RecordingStore(RecordingSettings(directory=tmp_path, max_total_bytes=2 * mb + 4096))
    now = time.time()
    for i, name in enumerate(["sess_a", "sess_b", "sess_c", "sess_d"]):
        _finished_recording(store, name, mb, now - 100 + i)
    store.active["sess_a"] = object()  # type: ignore[assignment]  # still being written
    removed = store.enforce_retention(now)
    assert removed == ["sess_b", "sess_c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sess_a", "sess_d"]
    with pytest.raises(RecordingBusy):
        store.delete("sess_a")


# --- upload to S3-compatible storage (moto's server, a real S3 API over HTTP) ----------------------------

async def test_a_finished_recording_is_uploaded_to_object_storage(tmp_path):
    import asyncio

    import boto3
    from moto.server import ThreadedMotoServer

    from conftest import free_port
    from recording_support import decode

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        creds = {"access_key_id": "test", "secret_access_key": "test", "region": "us-east-1"}
        s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
        await asyncio.to_thread(s3.create_bucket, Bucket="calls")
        recording = {"enabled": True, "directory": str(tmp_path),
                     "s3": {"bucket": "calls", "prefix": "rec/", "endpoint_url": endpoint, **creds}}
        async with running_server(recording=recording) as (url, _):
            client = RtcClient(url)
            await client.connect()
            try:
                start = client.mic.feed(TONE)
                await client.wait_sent(round(start * RATE) + len(TONE))
                async with aiohttp.ClientSession() as http:
                    async with http.delete(f"{url}/v1/sessions/{client.session_id}", headers=client.auth_headers):
                        pass
                meta_path = tmp_path / client.session_id / "meta.json"
                await wait_until(lambda: "uploaded_to" in json.loads(meta_path.read_text())
                                 or "upload_error" in json.loads(meta_path.read_text()), 60, "the upload")
            finally:
                await client.close()
        meta = json.loads(meta_path.read_text())
        assert meta["uploaded_to"] == f"s3://calls/rec/{client.session_id}/", meta
        listed = await asyncio.to_thread(s3.list_objects_v2, Bucket="calls", Prefix=f"rec/{client.session_id}/")
        keys = sorted(o["Key"].rsplit("/", 1)[1] for o in listed["Contents"])
        assert keys == ["audio.ogg", "events.jsonl", "meta.json"]
        body = await asyncio.to_thread(s3.get_object, Bucket="calls", Key=f"rec/{client.session_id}/audio.ogg")
        assert body["ContentType"].startswith("audio/ogg")
        audio = decode(body["Body"].read())
        assert np.max(np.abs(audio[:, 0])) > 0.1
    finally:
        server.stop()


# --- the OpenAI surface: no recording switch of its own, so this server's `lychee_rtc.recording` --------

async def test_an_openai_call_asks_for_its_recording_with_the_lychee_rtc_extension(tmp_path):
    from test_openai_realtime import assert_ga_events_valid, open_call

    from lychee_rtc.server.app import REGISTRY_KEY

    async with running_server(server={"auth_token": KEY}, recording={"directory": str(tmp_path)}) as (url, app):
        client, call_id = await open_call(url, ADMIN, session={"type": "realtime", "lychee_rtc": {"recording": True}})
        try:
            await client.wait_event("session.created", timeout=60)
            assert app[REGISTRY_KEY].recording_of[call_id].state() == "recording"
            client.send({"type": "session.update", "session": {"type": "realtime", "lychee_rtc": {"recording": False}}})
            updated = await client.wait_event("session.updated", timeout=60)
            assert updated["lychee_rtc"]["recording"] == "paused"
            # Applied, so not listed as ignored: neither the field nor the block it is in.
            assert updated["lychee_rtc"]["ignored"] == []
            client.send({"type": "session.update",
                         "session": {"type": "realtime", "lychee_rtc": {"recording": False, "colour": "red"}}})
            unknown = await client.wait_event("session.updated", timeout=60, after=len(client.events))
            assert unknown["lychee_rtc"]["ignored"] == ["lychee_rtc.colour"]
            client.send({"type": "session.update", "session": {"type": "realtime", "lychee_rtc": {"recording": 1}}})
            error = await client.wait_event("error", timeout=60)
            assert error["error"]["code"] == "invalid_session"
            assert_ga_events_valid(client.events)
        finally:
            await client.close()
        # The sidecar is complete once the recording is: the writer takes what the call queued a
        # poll later, and the call ends after its client goes.
        folder = tmp_path / call_id
        await recording_finished(folder)
        lines = (folder / "events.jsonl").read_text().splitlines()
        assert [json.loads(line)["type"] for line in lines[:2]] == ["recording.started", "session.created"]

    # A profile that keeps recording to itself refuses the request before a call is made.
    async with running_server(server={"auth_token": KEY},
                              recording={"directory": str(tmp_path), "client_control": False}) as (url, app):
        client = RtcClient(url, channel_label="oai-events")
        form = aiohttp.FormData()
        form.add_field("sdp", await client.make_offer(), content_type="application/sdp")
        form.add_field("session", json.dumps({"type": "realtime", "lychee_rtc": {"recording": True}}),
                       content_type="application/json")
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/realtime/calls", data=form, headers=ADMIN) as resp:
                    body = await resp.read()
                    assert resp.status == 400, body
                    check_response("/v1/realtime/calls", "POST", 400, resp.headers, body)
                    assert json.loads(body)["error"]["code"] == "recording_not_allowed"
            assert not app[REGISTRY_KEY].calls
            # A client secret asking for it would open no call either: refused when it is minted.
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/realtime/client_secrets", headers=ADMIN,
                                     json={"session": {"type": "realtime", "lychee_rtc": {"recording": True}}}) as resp:
                    body = await resp.read()
                    assert resp.status == 400, body
                    check_response("/v1/realtime/client_secrets", "POST", 400, resp.headers, body)
                    assert json.loads(body)["error"]["code"] == "recording_not_allowed"
        finally:
            await client.close()


def readme_recording_event() -> dict:
    """The event README.md shows for turning a call's recording on, as written there."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("**Call recording**"):]
    block = section[section.index("```json") + len("```json"):section.index("```", section.index("```json") + 7)]
    return json.loads(block)


async def test_the_readme_event_turns_a_call_recording_on_as_written(tmp_path):
    event = readme_recording_event()
    async with running_server(recording={"directory": str(tmp_path)}) as (url, _):
        client = RtcClient(url)
        await client.connect()
        try:
            created = await client.wait_event("session.created", timeout=60)
            assert created["session"]["recording"] == "off"
            client.send(event)
            updated = await client.wait_event("session.updated", timeout=60)
            assert updated["session"]["recording"] == "recording"
            assert not [e for e in client.events if e["type"] == "error"]
            await wait_until(lambda: (tmp_path / client.session_id / "audio.ogg").exists(), 30, "the recording")
        finally:
            await client.close()


async def test_a_native_offer_asks_for_its_recording_from_the_start(tmp_path):
    async with running_server(recording={"directory": str(tmp_path)}) as (url, _):
        client = RtcClient(url)
        await client.connect(session={"recording": True})
        try:
            created = await client.wait_event("session.created", timeout=60)
            assert created["session"]["recording"] == "recording"
            sidecar = tmp_path / client.session_id / "events.jsonl"
            await wait_until(lambda: len(sidecar.read_text().splitlines()) >= 2, 30, "the sidecar's first lines")
            assert json.loads(sidecar.read_text().splitlines()[1])["type"] == "session.created"
        finally:
            await client.close()


async def test_a_whip_call_is_recorded_like_any_other(tmp_path):
    async with running_server(recording={"enabled": True, "directory": str(tmp_path)}) as (url, app):
        client = RtcClient(url)
        try:
            offer = await client.make_offer()
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/whip", data=offer, headers={"Content-Type": "application/sdp"}) as resp:
                    assert resp.status == 201, await resp.text()
                    location, answer = resp.headers["Location"], await resp.text()
                await client.accept_answer(answer, timeout=30)
                start = client.mic.feed(TONE)
                await client.wait_sent(round(start * RATE) + len(TONE))
                (session_id,) = [sid for sid in app_calls(app)]
                async with http.delete(f"{url}{location}") as resp:
                    assert resp.status == 200
                folder = tmp_path / session_id
                await recording_finished(folder)
                recording = f"{url}/v1/sessions/{session_id}/recording"
                async with http.get(recording) as resp:
                    assert resp.status == 401
                # The WHIP resource is the client's capability: its id opens the call's recording.
                whip_secret = {"Authorization": f"Bearer {location.rsplit('/', 1)[1]}"}
                async with http.get(recording, headers=whip_secret) as resp:
                    assert resp.status == 200
                    audio = decode(await resp.read())
            assert np.max(np.abs(audio[:, 0])) > 0.1
            assert json.loads((folder / "meta.json").read_text())["transport"] == "webrtc"
        finally:
            await client.close()


def app_calls(app) -> list[str]:
    from lychee_rtc.server.app import REGISTRY_KEY

    return list(app[REGISTRY_KEY].calls)
