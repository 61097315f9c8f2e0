"""Call recordings over HTTP: fetch, list, delete (docs/recording.md).

``GET /v1/sessions/{id}/recording`` (the Ogg/Opus audio: caller left, agent right) and
``.../recording/events`` (the JSON-lines sidecar) open with the session's token (a WHIP call's:
its resource id) or the server key, during the call (what has been written so far) and after it,
when the session is gone: the recording keeps a hash of the secret. ``DELETE`` on the recording removes it once the call has
ended; ``GET /v1/recordings`` (server key) lists them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.config import Settings
from lychee_rtc.media.recording.store import (AUDIO_FILE, AUDIO_TYPE, EVENTS_FILE, EVENTS_TYPE, RecordingBusy,
                                              RecordingStore)
from lychee_rtc.server import auth, http
from lychee_rtc.server.auth import Policy



@dataclass(frozen=True)
class _Routes:
    store: RecordingStore
    registry: CallRegistry
    settings: Settings


ROUTES_KEY = web.AppKey("recordings", _Routes)


async def _recording(request: web.Request) -> dict[str, Any] | web.Response:
    """The meta of the recording named in the path, if the request may open it."""
    routes = request.app[ROUTES_KEY]
    store = routes.store
    session_id = request.match_info["session_id"]
    meta = await asyncio.to_thread(store.meta, session_id)  # file reads stay off the event loop
    if meta is None:
        return http.error_response(404, "recording_not_found", f"no recording of session {session_id!r}")
    server_key = routes.settings.server.auth_token
    # The recording keeps a hash of its call's secret: the same rule during the call and after it.
    if meta.get("token_sha256"):
        allowed = store.token_matches(meta, auth.bearer(request)) or auth.is_admin(request, server_key)
    else:
        allowed = auth.has_server_key(request, server_key)
    if not allowed:
        return http.unauthorized("this recording needs its session's session_token (or the server key) as bearer token")
    return meta


async def _file(request: web.Request, name: str, content_type: str) -> web.StreamResponse:
    meta = await _recording(request)
    if isinstance(meta, web.Response):
        return meta
    path = await asyncio.to_thread(request.app[ROUTES_KEY].store.path, meta["session_id"], name)
    if path is None:
        return http.error_response(404, "recording_not_found", f"recording of {meta['session_id']!r} has no {name}")
    # What has been written so far while the call goes on; the whole file once it has ended.
    return web.FileResponse(path, headers={"Content-Type": content_type, "Cache-Control": "no-store"})


@auth.policy(Policy.SESSION)
async def get_audio(request: web.Request) -> web.StreamResponse:
    return await _file(request, AUDIO_FILE, AUDIO_TYPE)


@auth.policy(Policy.SESSION)
async def get_events(request: web.Request) -> web.StreamResponse:
    return await _file(request, EVENTS_FILE, EVENTS_TYPE)


@auth.policy(Policy.SESSION)
async def delete_recording(request: web.Request) -> web.Response:
    meta = await _recording(request)
    if isinstance(meta, web.Response):
        return meta
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
    """Add the routes, and start-up (recover what a killed server left) and shutdown (let the writers
    finish) hooks; call it after the hook that closes every call, so the writers finish after it."""
    app[ROUTES_KEY] = _Routes(store, registry, settings)
    app.router.add_get("/v1/recordings", list_recordings)
    app.router.add_get("/v1/sessions/{session_id}/recording", get_audio)
    app.router.add_delete("/v1/sessions/{session_id}/recording", delete_recording)
    app.router.add_get("/v1/sessions/{session_id}/recording/events", get_events)

    async def recover(app: web.Application) -> None:
        await asyncio.to_thread(store.recover)

    async def finish(app: web.Application) -> None:
        await asyncio.to_thread(store.wait_idle, settings.server.shutdown_grace_s)

    app.on_startup.append(recover)
    app.on_shutdown.append(finish)
