"""A client of Janus's JSON API over its WebSocket transport: one socket, one Janus session.

Requests are matched to their answers by transaction id (``success``/``error`` for core requests,
``ack`` for plugin messages, whose results arrive later as events). Everything Janus sends on its
own (plugin events, ``hangup``, ``webrtcup``, ``detached``) is handed to ``on_event``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
from typing import Any, Callable

import aiohttp

log = logging.getLogger(__name__)

KEEPALIVE_S = 25.0  # Janus drops a session after 60 s without a request
MAX_MESSAGE_BYTES = 1 << 20


class JanusError(RuntimeError):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"Janus error {code}: {reason}")
        self.code = code
        self.reason = reason


class JanusApi:
    def __init__(self, url: str, api_secret: str | None, timeout_s: float,
                 on_event: Callable[[dict[str, Any]], None]) -> None:
        self.url = url
        self.api_secret = api_secret
        self.timeout_s = timeout_s
        self.on_event = on_event
        self.session_id: int | None = None
        self.closed = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._pending: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(4)

    async def open(self) -> None:
        self._http = aiohttp.ClientSession()
        self._ws = await self._http.ws_connect(self.url, protocols=("janus-protocol",), heartbeat=None,
                                               max_msg_size=MAX_MESSAGE_BYTES,
                                               timeout=aiohttp.ClientWSTimeout(ws_close=self.timeout_s))
        self._tasks.append(asyncio.create_task(self._reader(), name="janus-reader"))
        answer = await self.request({"janus": "create"})
        self.session_id = int(answer["data"]["id"])
        self._tasks.append(asyncio.create_task(self._keepalive(), name="janus-keepalive"))

    async def close(self) -> None:
        if self._ws is not None and not self._ws.closed and self.session_id is not None:
            with contextlib.suppress(Exception):  # Janus may already be gone
                await asyncio.wait_for(self.request({"janus": "destroy"}), 2.0)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        self._fail_pending(ConnectionError("the Janus connection closed"))
        self.closed.set()

    # --- requests ----------------------------------------------------------------------------------

    async def request(self, body: dict[str, Any], handle_id: int | None = None) -> dict[str, Any]:
        """Send one request and return Janus's answer (``success`` or ``ack``); raise on ``error``."""
        if self._ws is None or self._ws.closed:
            raise ConnectionError("not connected to Janus")
        transaction = f"{self._prefix}-{next(self._ids)}"
        message = dict(body, transaction=transaction)
        if self.session_id is not None and body.get("janus") != "create":
            message["session_id"] = self.session_id
        if handle_id is not None:
            message["handle_id"] = handle_id
        if self.api_secret:
            message["apisecret"] = self.api_secret
        future = asyncio.get_running_loop().create_future()
        self._pending[transaction] = future
        try:
            await self._ws.send_str(json.dumps(message))
            answer = await asyncio.wait_for(future, self.timeout_s)
        finally:
            self._pending.pop(transaction, None)
        if answer.get("janus") == "error":
            error = answer.get("error", {})
            raise JanusError(int(error.get("code", 0)), str(error.get("reason", "unknown error")))
        return answer

    async def attach(self, plugin: str) -> int:
        answer = await self.request({"janus": "attach", "plugin": plugin})
        return int(answer["data"]["id"])

    async def message(self, handle_id: int, body: dict[str, Any], jsep: dict[str, Any] | None = None) -> None:
        request: dict[str, Any] = {"janus": "message", "body": body}
        if jsep is not None:
            request["jsep"] = jsep
        await self.request(request, handle_id)

    # --- the socket --------------------------------------------------------------------------------

    async def _reader(self) -> None:
        assert self._ws is not None
        try:
            async for msg in self._ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                try:
                    data = json.loads(msg.data)
                except ValueError:
                    log.warning("Janus sent a message that is not JSON: %.80r", msg.data)
                    continue
                if not isinstance(data, dict):
                    continue
                kind = data.get("janus")
                future = self._pending.get(data.get("transaction", ""))
                if future is not None and kind in ("success", "error", "ack", "server_info") and not future.done():
                    future.set_result(data)
                    continue
                if kind in ("event", "hangup", "webrtcup", "media", "detached", "slowlink", "trickle", "timeout"):
                    try:
                        self.on_event(data)
                    except Exception:
                        log.exception("failed to handle a Janus %s event", kind)
        finally:
            self._fail_pending(ConnectionError("the Janus connection closed"))
            self.closed.set()

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            try:
                await self.request({"janus": "keepalive"})
            except JanusError as exc:  # 458: the session is gone (Janus restarted under us)
                log.warning("Janus keepalive failed: %s", exc)
                if self._ws is not None:
                    await self._ws.close()
                return
            except (ConnectionError, asyncio.TimeoutError):
                if self._ws is not None:
                    await self._ws.close()
                return

    def _fail_pending(self, exc: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()
