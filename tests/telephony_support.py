"""Helpers for the telephony tests: fixtures, carrier credentials, the application's event stream."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
from twilio.request_validator import RequestValidator

from lychee_rtc.bench.carrier import CarrierEmulator
from lychee_rtc.telephony.auth import TELNYX_TOKEN, TWILIO_SIGNATURE

FIXTURES = Path(__file__).parent / "fixtures" / "telephony"
# The application's server key: a carrier's call holds no client secret, so its event stream opens
# with the server key only, in every mode (docs/reliability.md, routes).
APP_KEY = "app-token"
APP_AUTH = {"Authorization": f"Bearer {APP_KEY}"}
PROVIDERS = ("twilio", "telnyx", "plivo", "exotel", "vonage")
CREDENTIALS = {
    "twilio": {"auth_token": "twilio-auth-token"},
    "telnyx": {"token": "telnyx-stream-token"},
    "plivo": {"token": "plivoStreamToken7"},
    "exotel": {"username": "exokey", "password": "exotoken"},
    "vonage": {"token": "vonage-bearer-token"},
}


def spec(provider: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{provider}.json").read_text())


def carrier_auth(provider: str, ws_url: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(headers, template values) with which ``provider`` proves itself, as configured in CREDENTIALS.

    Signatures and encodings come from the carrier's own library or a client library, not from the
    code under test, so a test call cannot pass because both ends share a mistake.
    """
    creds = CREDENTIALS[provider]
    if provider == "twilio":
        return {TWILIO_SIGNATURE: RequestValidator(creds["auth_token"]).compute_signature(ws_url, {})}, {}
    if provider == "telnyx":
        return {TELNYX_TOKEN: creds["token"]}, {}
    if provider == "plivo":
        return {}, {"token": creds["token"]}
    if provider == "exotel":
        return {"Authorization": aiohttp.encode_basic_auth(creds["username"], creds["password"])}, {}
    return {"Authorization": f"Bearer {creds['token']}"}, {}


def media_url(http_url: str, provider: str | None = None) -> str:
    return http_url.replace("http://", "ws://") + "/v1/telephony/ws" + (f"/{provider}" if provider else "")


def carrier(http_url: str, provider: str) -> CarrierEmulator:
    url = media_url(http_url)
    headers, values = carrier_auth(provider, url)
    return CarrierEmulator(url, spec(provider), headers=headers, values=values)


class EventStream:
    """The application's side: our events vocabulary over the call's companion WebSocket."""

    def __init__(self, http_url: str, call: str, headers: dict[str, str] | None = None) -> None:
        self.url = f"{http_url.replace('http://', 'ws://')}/v1/telephony/calls/{call}/events"
        self.headers = APP_AUTH if headers is None else headers
        self.events: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.closed = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._task: asyncio.Task | None = None
        self._new = asyncio.Event()

    async def connect(self, timeout: float = 30.0) -> None:
        """Attach as soon as the call exists (the carrier's start frame creates it)."""
        self._http = aiohttp.ClientSession()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._ws = await self._http.ws_connect(self.url, headers=self.headers)
                break
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    await self._http.close()
                    raise
                await asyncio.sleep(0.05)
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for msg in self._ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    self.events.append(json.loads(msg.data))
                    self.arrivals.append(time.monotonic())
                    self._new.set()
        finally:
            self.closed.set()
            self._new.set()

    async def send(self, event: dict[str, Any]) -> None:
        assert self._ws is not None
        await self._ws.send_str(json.dumps(event))

    def of(self, event_type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == event_type]

    async def wait(self, event_type: str, timeout: float = 40.0, after: int = 0, **fields: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events[after:]:
                if event["type"] == event_type and all(event.get(k) == v for k, v in fields.items()):
                    return event
            left = deadline - time.monotonic()
            if left <= 0 or (self.closed.is_set() and not self._new.is_set()):
                raise AssertionError(f"no {event_type} {fields or ''} within {timeout} s; got "
                                     f"{[e['type'] for e in self.events]}")
            self._new.clear()
            try:
                await asyncio.wait_for(self._new.wait(), left)
            except asyncio.TimeoutError:
                pass

    def arrival_of(self, event: dict[str, Any]) -> float:
        return self.arrivals[self.events.index(event)]

    async def close(self) -> None:
        if self._ws is not None and not self._ws.closed:
            await self._ws.close()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=10)
        if self._http is not None:
            await self._http.close()


async def until(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        await asyncio.sleep(0.05)


async def get_json(http_url: str, path: str, method: str = "GET") -> tuple[int, Any]:
    """As the application (with APP_KEY, which the phone servers of these tests have)."""
    async with aiohttp.ClientSession() as http:
        async with http.request(method, http_url + path, headers=APP_AUTH) as resp:
            body = await resp.read()
            return resp.status, (json.loads(body) if body and resp.content_type == "application/json" else None)
