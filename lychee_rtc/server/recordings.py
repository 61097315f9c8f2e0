"""Call recordings over HTTP: fetch, list, delete (docs/recording.md).

``GET /v1/sessions/{id}/recording`` (the Ogg/Opus audio: caller left, agent right) and
``.../recording/events`` (the JSON-lines sidecar) open with the session's token (a WHIP call's:
its resource id) or the server key, during the call (what has been written so far) and after it,
when the session is gone: the recording keeps a hash of the secret (a recording of a call nobody
held a secret for opens with the server key only). ``DELETE`` on the recording removes it once the
call has ended; ``GET /v1/recordings`` (server key) lists them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.calls.tokens import Opener
from lychee_rtc.config import Settings
from lychee_rtc.media.recording.store import (AUDIO_FILE, AUDIO_TYPE, EVENTS_FILE, EVENTS_TYPE, RecordingBusy,
                                              RecordingStore)
from lychee_rtc.server import http
from lychee_rtc.server.auth import Access
from lychee_rtc.server.route_table import TARGET_KEY, Route, Target, table_of


@dataclass(frozen=True)
class _Routes:
    store: RecordingStore
    registry: CallRegistry
    settings: Settings


ROUTES_KEY = web.AppKey("recordings", _Routes)
OPENED_BY = "its session's token (a WHIP session's: its resource id), kept as a hash after the call"


async def locate_recording(request: web.Request) -> Target | web.Response:
    """The recording named in the path and what opens it: the hash of its call's secret, kept in its
    meta, during the call and after it; a recording of a call nobody held a secret for, the server
    key only."""
    store = request.app[ROUTES_KEY].store
    session_id = request.match_info["session_id"]
    meta = await asyncio.to_thread(store.meta, session_id)  # file reads stay off the event loop
    if meta is None:
        return http.error_response(404, "recording_not_found", f"no recording of session {session_id!r}")
    digest = meta.get("token_sha256")
    return Target(Opener(digests=(digest,) if digest else ()), meta)


async def _file(request: web.Request, name: str, content_type: str) -> web.StreamResponse:
    meta = request[TARGET_KEY]
    path = await asyncio.to_thread(request.app[ROUTES_KEY].store.path, meta["session_id"], name)
    if path is None:
        return http.error_response(404, "recording_not_found", f"recording of {meta['session_id']!r} has no {name}")
    # What has been written so far while the call goes on; the whole file once it has ended.
    return await http.file_response(request, path, {"Content-Type": content_type, "Cache-Control": "no-store"})


async def get_audio(request: web.Request) -> web.StreamResponse:
    return await _file(request, AUDIO_FILE, AUDIO_TYPE)


async def get_events(request: web.Request) -> web.StreamResponse:
    return await _file(request, EVENTS_FILE, EVENTS_TYPE)


async def delete_recording(request: web.Request) -> web.Response:
    meta = request[TARGET_KEY]
    try:
        await asyncio.to_thread(request.app[ROUTES_KEY].store.delete, meta["session_id"])
    except RecordingBusy:
        return http.error_response(409, "recording_in_progress",
                                   "the call is still being recorded; delete the recording once it has ended")
    return web.Response(status=204)


async def list_recordings(request: web.Request) -> web.Response:
    store = request.app[ROUTES_KEY].store
    return http.json_response({"recordings": await asyncio.to_thread(store.list)})


def install(app: web.Application, store: RecordingStore, registry: CallRegistry, settings: Settings) -> None:
    """Add the routes and the start-up hook (recover what a killed server left); the app's shutdown
    calls ``finish`` once its calls are closed."""
    app[ROUTES_KEY] = _Routes(store, registry, settings)
    table = table_of(app)
    table.add(app, Route("GET", "/v1/recordings", list_recordings, Access.ADMIN))
    for method, path, handler in (("GET", "/v1/sessions/{session_id}/recording", get_audio),
                                  ("DELETE", "/v1/sessions/{session_id}/recording", delete_recording),
                                  ("GET", "/v1/sessions/{session_id}/recording/events", get_events)):
        table.add(app, Route(method, path, handler, Access.SESSION, locate=locate_recording, opened_by=OPENED_BY))

    async def recover(app: web.Application) -> None:
        await asyncio.to_thread(store.recover)

    app.on_startup.append(recover)


async def finish(store: RecordingStore, timeout_s: float) -> None:
    """Let the recording writers finish their files (the calls are closed), for at most ``timeout_s``."""
    await asyncio.to_thread(store.wait_idle, timeout_s)
