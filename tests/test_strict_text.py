"""Strict text at every boundary to SIP, SDP and HTTP headers: every value that ends up there is one
whole line of printable text, bounded, or it is refused where it comes in.

A SIP URI with a trailing LF used to pass (a pattern anchored with ``$`` matches before a final
newline) and reach the gateway. Each field is tried with CR, LF, NUL (at the end, where ``$`` let
it through, and inside) and an over-long value: over HTTP against a live server (the SIP gateway's
routes on, Janus absent: a value that passed would get as far as "gateway unavailable", 503, or
"not a phone call", 409), in SDP offers and fragments, and in every text setting of the profile.
"""

from __future__ import annotations

import re
import typing

import aiohttp
import pytest
from pydantic import BaseModel

from conftest import running_server
from contract import check_response

from lychee_rtc.bench.client import RtcClient
from lychee_rtc.config import ConfigError, Settings, load_settings
from lychee_rtc.gateway.dial_out import MAX_URI, sip_uri, valid_target
from lychee_rtc.strict_text import UnsafeText, header_value, strict_text

KEY = "strict-text-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GATEWAY = {"janus": {"enabled": True, "url": "ws://127.0.0.1:9", "reconnect_max_s": 60}}
GOOD = "sip:alice@example.com"
# Each hostile form of a good value: what a pattern anchored with $ let through, and the rest.
BAD = {
    "trailing LF": GOOD + "\n",
    "trailing CR LF": GOOD + "\r\n",
    "header injection": GOOD + "\r\nX-Evil: 1",
    "NUL": "sip:al\x00ice@example.com",
    "trailing NUL": GOOD + "\x00",
    "line separator": GOOD + "\u2028",
    "over-long": "sip:" + "a" * MAX_URI + "@example.com",
}


@pytest.mark.parametrize("name", list(BAD))
def test_sip_uris_are_matched_whole(name):
    assert valid_target(GOOD) and valid_target("tel:+14155550123")
    assert not valid_target(BAD[name])
    with pytest.raises(UnsafeText):
        sip_uri(BAD[name], "to")


def test_the_checker_refuses_every_control_character_and_any_partial_match():
    for code in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]:
        with pytest.raises(UnsafeText, match="control characters"):
            strict_text(f"a{chr(code)}b", "v", 10)
    with pytest.raises(UnsafeText, match="longer than 3"):
        strict_text("abcd", "v", 3)
    with pytest.raises(UnsafeText, match="not well-formed"):
        strict_text("ab", "v", 10, re.compile("a"))  # matches a prefix only
    assert header_value("Bearer x", "h") == "Bearer x"
    with pytest.raises(UnsafeText):
        header_value("caf\u00e9", "h")  # a header value this server sends is plain ASCII


# (method, path, body with the field at FIELD, the field) of every HTTP field that goes into SIP.
FIELDS = [
    ("POST", "/v1/telephony/calls", {"to": "FIELD"}, "to"),
    ("POST", "/v1/telephony/calls", {"to": GOOD, "from": "FIELD"}, "from"),
    ("POST", "/v1/telephony/calls/{call}/transfer", {"target_uri": "FIELD"}, "target_uri"),
    ("POST", "/v1/telephony/calls/{call}/consult", {"target_uri": "FIELD"}, "target_uri"),
    ("POST", "/v1/realtime/calls/{call_id}/refer", {"target_uri": "FIELD"}, "target_uri"),
]


async def test_every_sip_field_refuses_control_characters_and_long_values():
    async with running_server(server={"auth_token": KEY}, gateway=GATEWAY) as (url, _):
        client, realtime = RtcClient(url, auth_token=KEY), RtcClient(url)
        await client.connect()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/realtime/calls", data=await realtime.make_offer(),
                                     headers={**AUTH, "Content-Type": "application/sdp"}) as resp:
                    call_id = resp.headers["Location"].rsplit("/", 1)[1]
                for method, path, template, field in FIELDS:
                    where = path.replace("{call}", client.session_id).replace("{call_id}", call_id)
                    # The good value passes validation: it meets the absent gateway (503) or the
                    # call's kind (409), never a 400 about the field.
                    for name, value in [("good", GOOD), *BAD.items()]:
                        body = {k: value if v == "FIELD" else v for k, v in template.items()}
                        async with http.request(method, url + where, json=body, headers=AUTH) as resp:
                            raw = await resp.read()
                            check_response(path, method, resp.status, resp.headers, raw)
                            error = (await resp.json())["error"]
                            if name == "good":
                                assert resp.status in (503, 409), (path, field, raw)
                            else:
                                assert resp.status == 400, (path, field, name, raw)
                                assert error["code"] in ("invalid_target", "invalid_caller_id", "invalid_value"), raw
        finally:
            await client.close()
            await realtime.close()


@pytest.mark.parametrize("bad", ["\x00", "\r", "\x0b", "\u2028"])
async def test_sdp_with_control_characters_is_refused_everywhere_it_comes_in(echo_server, bad):
    url, _ = echo_server
    client = RtcClient(url)
    offer = await client.make_offer()
    hostile = offer.replace("a=mid:0", f"a=mid:0{bad}", 1)
    try:
        async with aiohttp.ClientSession() as http:
            for path, kw in (("/v1/rtc/offer", {"json": {"sdp": hostile, "type": "offer"}}),
                             ("/whip", {"data": hostile, "headers": {"Content-Type": "application/sdp"}}),
                             ("/v1/realtime/calls", {"data": hostile, "headers": {"Content-Type": "application/sdp"}})):
                async with http.post(url + path, **kw) as resp:
                    raw = await resp.read()
                    assert resp.status == 400, (path, raw)
                    assert "control characters" in (await resp.json())["error"]["message"]
            async with http.post(f"{url}/whip", data=offer, headers={"Content-Type": "application/sdp"}) as resp:
                assert resp.status == 201
                resource = resp.headers["Location"]
            fragment = f"a=candidate:1 1 udp 2130706431 127.0.0.1 9{bad} typ host\r\n"
            async with http.patch(url + resource, data=fragment,
                                  headers={"Content-Type": "application/trickle-ice-sdpfrag"}) as resp:
                assert resp.status == 400 and "control characters" in (await resp.json())["error"]["message"]
    finally:
        await client.close()


def text_settings(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type]]:
    """Every text setting of the profile (dotted key, the annotation), lists and maps of text included."""
    found = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = typing.get_args(annotation)
        section = next((a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if section is not None and typing.get_origin(annotation) is not list:
            found += text_settings(section, f"{prefix}{name}.")
        elif annotation is str or str in args or "list[str]" in str(annotation) or "dict[str, str]" in str(annotation):
            found.append((prefix + name, annotation))
    return found


def test_every_text_setting_refuses_control_characters():
    """A setting reaches a SIP message (Janus), a header (ICE servers' Link, CORS) or a URL as it is."""
    keys = text_settings(Settings)
    assert {"server.auth_token", "gateway.janus.sip_uri", "gateway.janus.registrar", "server.cors_origins",
            "telephony.public_url", "gateway.janus.display_name"} <= {k for k, _ in keys}
    for key, annotation in keys:
        for bad in ("\n", "\x00", "\r\nX: y"):
            value: typing.Any = "ok" + bad
            if "list" in str(annotation):
                value = [value]
            elif "dict" in str(annotation):
                value = {"0": value}
            tree: dict = {}
            node = tree
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
            with pytest.raises(ConfigError):
                load_settings("configs/echo.yaml", environ={}, overrides=tree)
    ice = {"rtc": {"ice_servers": [{"urls": ["stun:stun.example.org"], "username": "u\r\nLink: evil"}]}}
    with pytest.raises(ConfigError, match="control characters"):
        load_settings("configs/echo.yaml", environ={}, overrides=ice)
