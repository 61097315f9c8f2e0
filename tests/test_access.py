"""Who may call what: the route table of docs/reliability.md, walked against a live server.

Every route of a server with every surface on (WebRTC, WHIP, OpenAI Realtime, the SIP gateway's
routes, carriers, recordings) is asked three times in each of three modes (a server key; no key on
loopback; no key on a public address): with no credential, with a wrong one (another session's
own token, or another call's client key) and with the right one. A route the walk does not know
fails the test, so a new route cannot go unchecked; the docs' table must be the server's own.
Refused means 401 or 403, before the handler (no body read, no slot taken); let through means any
answer but those. Every answer is checked against signaling/openapi.yaml.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from conftest import running_server, wait_until
from contract import check_response, spec
from telephony_support import CREDENTIALS, carrier, carrier_auth, media_url

from lychee_rtc.bench.client import RtcClient
from lychee_rtc.calls.tokens import ClientKey, Opener, digest, new_session_token
from lychee_rtc.config import load_settings
from lychee_rtc.server.app import REGISTRY_KEY, create_app
from lychee_rtc.server.auth import Access
from lychee_rtc.server.route_table import RouteTable, table_of
from lychee_rtc.telephony.auth import TWILIO_SIGNATURE

pytestmark = pytest.mark.timeout(600)

KEY = "server-key-walk"
EVENTS = "/v1/telephony/calls/{call}/events"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
MODES = {"server_key": {"auth_token": KEY}, "keyless_loopback": {}, "keyless_public": {"host": "0.0.0.0"}}
# The SIP gateway's routes are on (Janus itself is not needed to decide who may call them).
GATEWAY = {"janus": {"enabled": True, "url": "ws://127.0.0.1:9", "reconnect_max_s": 60}}


def everything(tmp: Path, server: dict[str, Any]) -> dict[str, Any]:
    # Plivo left out: it proves itself only in its first frame, so with it configured any upgrade is let in.
    telephony = {**CREDENTIALS, "plivo": {"token": None}}
    return dict(server=server, gateway=GATEWAY, telephony=telephony,
                recording={"enabled": True, "directory": str(tmp)},
                session={"connect_timeout_s": 600, "media_timeout_s": 600, "max_sessions": 8})


def docs_table() -> str:
    text = DOCS.read_text()
    start = text.index("<!-- routes:begin -->") + len("<!-- routes:begin -->")
    return text[start:text.index("<!-- routes:end -->")].strip() + "\n"


def test_the_docs_table_is_the_servers(tmp_path):
    settings = load_settings("configs/echo.yaml", environ={}, overrides=everything(tmp_path, {}))
    table: RouteTable = table_of(create_app(settings))
    assert docs_table() == table.markdown(), (
        "docs/reliability.md's route table differs from the server's; it should read:\n" + table.markdown())


async def test_an_undeclared_route_stops_the_start(tmp_path):
    settings = load_settings("configs/echo.yaml", environ={}, overrides=everything(tmp_path, {}))
    app = create_app(settings)

    async def sneaky(request):
        raise AssertionError("never called")

    app.router.add_get("/v1/sneaky", sneaky)
    assert "GET /v1/sneaky" in table_of(app).undeclared(app)
    with pytest.raises(RuntimeError, match="/v1/sneaky"):
        await table_of(app).check(app)


@dataclass
class Targets:
    """What the walk calls routes about, and the credentials for each."""

    session_id: str
    token: str  # the session's own token
    other_token: str  # another live session's token: a wrong credential, though a real one
    other_session_id: str
    whip: str  # a WHIP resource path
    call_id: str  # an OpenAI realtime call
    call_token: str  # its X-Session-Token
    carrier_call: str  # a carrier's call (its call id, as the carrier names it)
    key_call: str | None = None  # a realtime call opened with an ek_ key (server key mode)
    key: str | None = None  # that key
    other_key: str | None = None  # another valid key


async def post_offer(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                     peers: list[RtcClient]) -> tuple[str, str]:
    """A connected realtime call: (call id, its token from X-Session-Token)."""
    client = RtcClient(url, channel_label="oai-events")
    peers.append(client)
    offer = await client.make_offer()
    async with http.post(f"{url}/v1/realtime/calls", data=offer,
                         headers={**headers, "Content-Type": "application/sdp"}) as resp:
        assert resp.status == 201, await resp.text()
        await client.accept_answer(await resp.text())
        return resp.headers["Location"].rsplit("/", 1)[1], resp.headers["X-Session-Token"]


async def whip_resource(http: aiohttp.ClientSession, url: str, headers: dict[str, str], peers: list[RtcClient]) -> str:
    """A connected WHIP call's resource path."""
    client = RtcClient(url)
    peers.append(client)
    offer = await client.make_offer()
    async with http.post(f"{url}/whip", data=offer, headers={**headers, "Content-Type": "application/sdp"}) as resp:
        assert resp.status == 201, await resp.text()
        await client.accept_answer(await resp.text())
        return resp.headers["Location"]


async def mint(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(f"{url}/v1/realtime/client_secrets", json={}, headers=bearer(KEY)) as resp:
        assert resp.status == 200
        return (await resp.json())["value"]


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


# Per route: how to ask it (path parameters from the targets, a body), and its three credentials.
BODIES = {"application/json": b"{}", "application/sdp": b"v=0\r\n", "application/trickle-ice-sdpfrag":
          b"a=end-of-candidates\r\n", "multipart/form-data": None}


def fill(route, t: Targets, wrong: bool) -> str:
    """The path for the target the route is about (``wrong``: a resource that is not the caller's)."""
    path = route.shown_path
    if route.query == "call_id":
        return f"{path}?call_id={t.call_id}"
    if path.startswith("/whip/"):
        return "/whip/whip_" + "x" * 32 if wrong else t.whip
    path = path.replace("{session_id}", t.session_id).replace("{call_id}", t.call_id)
    path = path.replace("{resource_id}", t.whip.rsplit("/", 1)[1]).replace("{provider}", "twilio")
    if path == EVENTS:
        return path.replace("{call}", t.carrier_call)
    if path.startswith("/v1/telephony/calls/{call}"):
        return path.replace("{call}", t.session_id)
    return path.replace("{file}", "app.js")


def credentials(access: Access, path: str, method: str, mode: str, t: Targets,
                url: str) -> dict[str, dict[str, str]]:
    """none / wrong / right headers for this route."""
    key = bearer(KEY) if mode == "server_key" else {}
    if access is Access.CARRIER:  # Twilio's signature of the URL it dialled
        return {"none": {}, "wrong": {TWILIO_SIGNATURE: "bm90IGEgc2lnbmF0dXJl"},
                "right": carrier(url, "twilio").headers if path == "/v1/telephony/ws" else
                carrier_auth("twilio", media_url(url, "twilio"))[0]}
    if access is not Access.SESSION:
        return {"none": {}, "wrong": bearer("not-the-server-key"), "right": key}
    if path == EVENTS:  # a carrier's call: the server key alone opens it
        return {"none": {}, "wrong": bearer(t.token), "right": key}
    if path.startswith("/v1/realtime"):
        return {"none": {}, "wrong": bearer(t.token), "right": bearer(t.call_token)}
    return {"none": {}, "wrong": bearer(t.other_token), "right": bearer(t.token)}


def expected(access: Access, path: str, mode: str, cred: str) -> str:
    """"refused" (401/403), "open" (anything else) or "absent" (404: not the caller's resource)."""
    if access in (Access.OPEN,):
        return "open"
    if access is Access.CARRIER:
        return "open" if cred == "right" else "refused"
    if access is Access.CREATE:
        return "open" if cred == "right" or mode != "server_key" else "refused"
    if access is Access.ADMIN:
        if mode == "keyless_loopback" or (cred == "right" and mode == "server_key"):
            return "open"
        return "refused"
    if path.startswith("/whip/"):  # the path is the secret: another names nothing
        return "open" if cred == "right" else "absent"
    if path == EVENTS and mode != "server_key":
        return "refused"  # no key to present: nobody opens a carrier's call
    if path.startswith("/v1/telephony/calls/{call}") and path.count("/") == 4 and cred != "none":
        return "absent"  # a placed call needs the SIP stack (tests/test_sip_dial_out.py walks it)
    return "open" if cred == "right" else "refused"


async def ask(http: aiohttp.ClientSession, url: str, route, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    if route.websocket:
        try:
            ws = await http.ws_connect(url + path, headers=headers)
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status, exc.headers
        await ws.close()
        return 101, None
    data = None
    headers = dict(headers)
    if route.body is not None:
        kind = route.body.types[0]
        data = BODIES[kind]
        headers["Content-Type"] = kind
    async with http.request(route.method, url + path, data=data, headers=headers) as resp:
        body = await resp.read()
        if resp.status >= 400:
            assert resp.content_type == "application/json", (route.method, path, resp.status, body[:200])
            if route.shown_path in spec()["paths"]:
                check_response(route.shown_path, route.method, resp.status, resp.headers, body)
        return resp.status, body


DESTRUCTIVE = {("DELETE", "/v1/sessions/{session_id}"), ("POST", "/v1/realtime/calls/{call_id}/hangup"),
               ("DELETE", "/whip/{resource_id}")}


@pytest.mark.parametrize("mode", list(MODES))
async def test_every_route_admits_exactly_who_the_table_says(mode, tmp_path):
    async with running_server(**everything(tmp_path, MODES[mode])) as (url, app):
        key = bearer(KEY) if mode == "server_key" else {}
        a, b = RtcClient(url, auth_token=KEY if key else None), RtcClient(url, auth_token=KEY if key else None)
        peers = [a, b]
        phone = carrier(url, "twilio")
        async with aiohttp.ClientSession() as http:
            try:
                await a.connect()
                await b.connect()
                call_id, call_token = await post_offer(http, url, key, peers)
                targets = Targets(a.session_id, a.session_token, b.session_token, b.session_id,
                                  await whip_resource(http, url, key, peers), call_id, call_token, phone.spec["call_id"])
                if mode == "server_key":
                    targets.key, targets.other_key = await mint(http, url), await mint(http, url)
                    targets.key_call, _ = await post_offer(http, url, bearer(targets.key), peers)
                await phone.connect()
                registry = app[REGISTRY_KEY]
                await wait_until(lambda: any(c.snapshot().get("transport") == "telephony"
                                             for c in registry.calls.values()), 60, "the carrier's call")
                routes = sorted(table_of(app).routes, key=lambda r: (r.method, r.shown_path) in DESTRUCTIVE)
                seen = []
                for route in routes:
                    creds = credentials(route.access, route.shown_path, route.method, mode, targets, url)
                    for cred in ("none", "wrong", "right"):
                        # Without a credential a WHIP resource is not known either: its path is its secret.
                        path = fill(route, targets, wrong=cred != "right")
                        status, _ = await ask(http, url, route, path, creds[cred])
                        want = expected(route.access, route.shown_path, mode, cred)
                        got = "refused" if status in (401, 403) else "absent" if status == 404 else "open"
                        ok = got == want or (want == "open" and got == "absent" and _may_be_absent(route))
                        assert ok, f"{mode}: {route.method} {path} with {cred} credential: {status}, expected {want}"
                        if mode == "keyless_public" and route.access is Access.ADMIN:
                            assert status == 403  # refused as "set a server key", not as a wrong key
                    seen.append((route.method, route.shown_path))
                assert len(seen) == len(table_of(app).routes)
                if mode == "server_key":
                    await client_keys_open_their_own_call_only(http, url, targets)
                    await a_session_token_resumes_its_own_session_only(http, url, targets)
            finally:
                await phone.close()
                for peer in peers:
                    await peer.close()


def _may_be_absent(route) -> bool:
    """Routes whose right credential still finds no such thing here (a SIP call's verbs on a WebRTC
    session, a static file that is not shipped)."""
    return route.shown_path in ("/static/{file}",) or route.shown_path.startswith(
        ("/v1/realtime/calls/{call_id}/accept", "/v1/realtime/calls/{call_id}/reject"))


async def client_keys_open_their_own_call_only(http: aiohttp.ClientSession, url: str, t: Targets) -> None:
    for headers, want in ((bearer(t.key), 200), (bearer(t.other_key), 401), (bearer(t.token), 401)):
        async with http.get(f"{url}/v1/sessions/{t.key_call}", headers=headers) as resp:
            assert resp.status == want, (headers, await resp.text())


async def a_session_token_resumes_its_own_session_only(http: aiohttp.ClientSession, url: str, t: Targets) -> None:
    """A session token is a credential for the offer route only as a resume of that very session
    (the last offer is let through, to fail on its SDP)."""
    for token, body, want in (
            (t.other_token, {"sdp": "v=0", "type": "offer"}, 401),  # a new session: the server key's
            (t.other_token, {"sdp": "v=0", "type": "offer", "resume": {"session_id": t.session_id}}, 401),
            (new_session_token(), {"sdp": "v=0", "type": "offer", "resume": {"session_id": t.session_id}}, 401),
            (t.other_token, {"sdp": "v=0", "type": "offer", "resume": {"session_id": t.other_session_id}}, 400)):
        async with http.post(f"{url}/v1/rtc/offer", json=body, headers=bearer(token)) as resp:
            assert resp.status == want, (body, await resp.text())


def test_the_contract_lists_what_each_route_may_answer(tmp_path):
    """signaling/openapi.yaml lists, for every route, the refusals its declaration implies: 401 where a
    credential is checked, 403 where a keyless server refuses, 404 for a route about one session,
    408 and 413 wherever a body is read; a WebSocket's description names its close codes."""
    settings = load_settings("configs/echo.yaml", environ={}, overrides=everything(tmp_path, {}))
    paths = spec()["paths"]
    missing = []
    for route in table_of(create_app(settings)).routes:
        operation = paths.get(route.shown_path, {}).get(route.method.lower())
        if operation is None:
            missing.append(f"{route.method} {route.shown_path}: not in the contract")
            continue
        want = set()
        if route.access in (Access.CREATE, Access.ADMIN, Access.CARRIER) or (
                route.access is Access.SESSION and not route.secret_in_path):
            want.add("401")
        if route.access is Access.ADMIN:
            want.add("403")
        if route.access is Access.SESSION:
            want.add("404")
        if route.body is not None:
            want |= {"408", "413"}
        if absent := want - set(operation["responses"]):
            missing.append(f"{route.method} {route.shown_path}: {sorted(absent)}")
        if route.websocket and route.access is Access.SESSION:
            text = operation.get("description", "")
            if not all(code in text for code in ("1000", "1001", "1009")):
                missing.append(f"{route.method} {route.shown_path}: close codes 1000, 1001, 1009 not described")
    assert not missing, "\n".join(missing)


def test_secrets_open_only_their_own_session_and_a_client_key_only_while_it_lasts():
    token, key = new_session_token(), "ek_abc.def"
    opener = Opener(secrets=(token,), client_key=ClientKey.of(key, expires_at=1000.0))
    assert opener.opens(token, now=5000.0)  # a session token does not expire with the call's key
    assert opener.opens(key, now=999.0) and not opener.opens(key, now=1000.0)
    assert not opener.opens(new_session_token(), now=0.0) and not opener.opens(None) and not opener.opens("")
    assert not opener.opens(token[:-1], now=0.0) and not opener.opens(token + "x", now=0.0)
    kept = Opener(digests=(digest(token),))  # a recording keeps only the hash of its call's token
    assert kept.opens(token) and not kept.opens(digest(token))
    assert not Opener().opens(token)  # a call nobody holds a secret for: the server key only


@pytest.mark.parametrize("path,content_type", [("/v1/rtc/offer", "application/json"), ("/whip", "application/sdp"),
                                               ("/v1/realtime/calls", "multipart/form-data; boundary=x"),
                                               ("/v1/telephony/calls", "application/json")])
async def test_a_caller_without_a_credential_is_refused_before_its_body_is_read(tmp_path, path, content_type):
    """The refusal comes while the body is still on its way: nothing of it was read, parsed or acted on."""
    async with running_server(**everything(tmp_path, MODES["server_key"])) as (url, app):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                         f"Content-Length: 60000\r\n\r\n".encode() + b"{" * 100)  # and the rest never comes
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert head.startswith(b"HTTP/1.1 401"), head
            assert not app[REGISTRY_KEY].calls
        finally:
            writer.close()
