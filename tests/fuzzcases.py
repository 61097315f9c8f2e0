"""Seeded generators of hostile input for the fuzz suite: HTTP bodies, SDP offers, data-channel messages.

Every case is a pure function of (seed, index), so a failure is replayed with the seed and index
the failing assertion prints: ``LYCHEE_FUZZ_SEED=<seed> pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable

EVENT_TYPES = ["session.update", "response.cancel", "input_audio_buffer.commit", "turn.listen", "turn.release",
               "playback.ack", "ping", "session.close", "response.create", "", "x" * 300]
ODD_STRINGS = ["", " ", "\x00", "\u202e", "\ud7ff", "NaN", "-1", "null", "{}", "[]", "\\", "\"", "a" * 5000,
               "v=0", "sess_0000000000000000", "<script>", "%s%n", "\r\n\r\n", "😀" * 50]
ODD_NUMBERS = [0, -1, 1, 2, 2.0000001, 1e308, -1e308, 5e-324, 2**63, -(2**63), 2**64, 10**30, 0.5, 3.14, -0.0]
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", "9" * 5000, "-0", "1E+2", "0x10", "01", ".5", "1."]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice(ODD_STRINGS)
    if kind == 1:
        return rng.choice(ODD_NUMBERS)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.randrange(-10, 10)
    if kind == 4:
        return "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(0, 20)))
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(["voice", "temperature", "seed", "metrics", "instructions", "type", "x", ""]):
            _value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _raw_splice(rng: random.Random, text: str) -> str:
    """Byte-level damage to JSON text: raw non-finite numbers, deep nesting, truncation, garbage."""
    choice = rng.randrange(6)
    if choice == 0:
        return text.replace("0.5", rng.choice(RAW_NUMBERS), 1) if "0.5" in text else text[:-1] + ', "n": ' + \
            rng.choice(RAW_NUMBERS) + "}"
    if choice == 1:
        depth = rng.choice([10, 100, 999, 1000, 5000, 100000])
        return text[:-1] + ', "deep": ' + "[" * depth + "]" * rng.choice([0, depth]) + "}"
    if choice == 2:
        return text[: rng.randrange(0, max(1, len(text)))]
    if choice == 3:
        pos = rng.randrange(0, max(1, len(text)))
        return text[:pos] + rng.choice(["\x00", "\ufffd", "}", "{", "\"", ",", "\\u", "\\ud800"]) + text[pos:]
    if choice == 4:
        return text * rng.randrange(2, 4)
    return text


def client_message(seed: int, index: int) -> str:
    """One data-channel message: a mutated client event."""
    rng = random.Random(f"dc-{seed}-{index}")
    event: dict[str, Any] = {"type": rng.choice(EVENT_TYPES)}
    if rng.random() < 0.7:
        event["event_id"] = rng.choice([f"e{index}", _value(rng), "x" * 200])
    fields = {"session": lambda: {k: _value(rng) for k in rng.sample(["voice", "temperature", "seed", "metrics",
                                                                    "instructions", "extra"], rng.randrange(0, 4))},
              "response_id": lambda: rng.choice(["resp_1", _value(rng)]),
              "played_ms": lambda: rng.choice(ODD_NUMBERS + [_value(rng)]),
              "client_time": lambda: rng.choice(ODD_NUMBERS + [0.5, _value(rng)])}
    for name in rng.sample(list(fields), rng.randrange(0, 3)):
        event[name] = fields[name]()
    text = json.dumps(event)
    return _raw_splice(rng, text) if rng.random() < 0.4 else text


def offer_body(seed: int, index: int, sdp: str) -> str:
    """One body for POST /v1/rtc/offer: mutated JSON around a real (possibly mutated) SDP offer."""
    rng = random.Random(f"http-{seed}-{index}")
    mutated = sdp_offer(seed, index, sdp) if rng.random() < 0.5 else rng.choice([sdp, _value(rng)])
    body: dict[str, Any] = {"type": rng.choice(["offer", "offer", "answer", _value(rng)]), "sdp": mutated}
    if rng.random() < 0.6:
        body["session"] = {k: _value(rng) for k in rng.sample(["voice", "temperature", "seed", "metrics",
                                                               "instructions", "x"], rng.randrange(0, 4))}
        if rng.random() < 0.3:
            body["session"]["temperature"] = 0.5
    if rng.random() < 0.2:
        body["resume"] = {k: _value(rng) for k in rng.sample(["session_id", "session_token", "last_seq", "x"],
                                                             rng.randrange(0, 4))}
    if rng.random() < 0.1:
        body[rng.choice(["extra", "", "sdp2"])] = _value(rng)
    text = json.dumps(body)
    return _raw_splice(rng, text) if rng.random() < 0.4 else text


SDP_MUTATIONS: list[Callable[[random.Random, list[str]], list[str]]] = [
    lambda rng, lines: [l for l in lines if not l.startswith(rng.choice(["a=mid", "a=ice-", "a=fingerprint", "m=",
                                                                          "a=rtpmap", "a=group", "c=", "a=setup"]))],
    lambda rng, lines: [l.replace("BUNDLE 0", rng.choice(["BUNDLE 1 0", "BUNDLE 7", "BUNDLE", "BUNDLE 0 0"]))
                        for l in lines],
    lambda rng, lines: [l.replace("a=mid:0", rng.choice(["a=mid:1", "a=mid:", "a=mid:0 0", "a=mid:\x00"]))
                        for l in lines],
    lambda rng, lines: [l if not l.startswith("m=audio") else rng.choice(
        ["m=audio 0 UDP/TLS/RTP/SAVPF 111", "m=audio 9 RTP/AVP", "m=audio x UDP/TLS/RTP/SAVPF 111",
         "m=audio 9 UDP/TLS/RTP/SAVPF " + " ".join(str(i) for i in range(200)), "m=video 9 UDP/TLS/RTP/SAVPF 96"])
        for l in lines],
    lambda rng, lines: lines + rng.choice([["m=application 9 UDP/DTLS/SCTP webrtc-datachannel", "a=mid:9"],
                                           ["a=candidate:1 1 udp 1 999.1.1.1 1 typ host"],
                                           ["a=rtpmap:111 opus/0/2"], ["a=sctp-port:99999999"],
                                           ["a=max-message-size:-1"], ["a=ssrc:1 cname:" + "x" * 3000]]),
    lambda rng, lines: [l.replace("opus/48000/2", rng.choice(["opus/0/2", "opus/48000/99", "opus", "x/y/z"]))
                        for l in lines],
    lambda rng, lines: [l for i, l in enumerate(lines) if rng.random() < 0.9],
    lambda rng, lines: lines[: rng.randrange(1, len(lines) + 1)],
    lambda rng, lines: [l.replace("a=setup:actpass", rng.choice(["a=setup:passive", "a=setup:x", "a=setup:"]))
                        for l in lines],
    lambda rng, lines: [l.replace("a=fingerprint:sha-256", rng.choice(["a=fingerprint:md5", "a=fingerprint:sha-256 zz",
                                                                        "a=fingerprint:"])) for l in lines],
]


def sdp_offer(seed: int, index: int, sdp: str) -> str:
    """A real offer with one to three mutations."""
    rng = random.Random(f"sdp-{seed}-{index}")
    lines = sdp.strip().split("\r\n")
    for _ in range(rng.randrange(1, 4)):
        lines = rng.choice(SDP_MUTATIONS)(rng, lines)
    return "\r\n".join(lines) + "\r\n"


def json_body(seed: int, index: int) -> str:
    """A body for any JSON route: an object of odd fields and values, often damaged."""
    rng = random.Random(f"json-{seed}-{index}")
    fields = ["to", "from", "session", "ring_timeout_s", "target_uri", "consult", "direction", "status_code",
              "type", "instructions", "expires_after", "sdp", "resume", "x"]
    body: Any = {rng.choice(fields): rng.choice([_value(rng), "sip:a@b" + rng.choice(ODD_STRINGS),
                                                 "tel:+1" + rng.choice(["\n", "\x00", "\r\nX: y", "1" * 300])])
                 for _ in range(rng.randrange(0, 5))}
    if rng.random() < 0.15:
        body = _value(rng)  # not an object at all
    text = json.dumps(body)
    return _raw_splice(rng, text) if rng.random() < 0.4 else text


def multipart_body(seed: int, index: int, sdp: str) -> tuple[bytes, str]:
    """(body, Content-Type) for a multipart offer: well-formed or damaged the ways a reader trips on."""
    rng = random.Random(f"multipart-{seed}-{index}")
    boundary = rng.choice(["lychee", "x" * 70, "a b", "", "--", "=?!", "b" * 200])
    session = rng.choice(['{"type": "realtime"}', "{", "[]", "null", '{"instructions": "' + "y" * 70000 + '"}',
                          json.dumps({"type": "realtime", "instructions": _value(rng)}), "\xff\xfe"])
    parts = [("sdp", "application/sdp", sdp_offer(seed, index, sdp) if rng.random() < 0.5 else sdp),
             ("session", "application/json", session)]
    if rng.random() < 0.2:
        parts.append((rng.choice(["sdp", "extra", "", "session"]), "text/plain", _value(rng) if rng.random() < 0.5 else "x"))
    if rng.random() < 0.2:
        rng.shuffle(parts)
    lines: list[str] = []
    if rng.random() < 0.1:
        lines.append("preamble garbage")
    for name, kind, content in parts:
        lines.append(f"--{boundary}")
        shape = rng.randrange(8)
        if shape == 0:
            lines.append("broken header line")
        elif shape == 1:
            lines.append("Content-Type: multipart/mixed; boundary=inner")
            lines.append(f'Content-Disposition: form-data; name="{name}"')
            lines += ["", "--inner", "", "nested", "--inner--"]
            continue
        elif shape == 2:
            lines.append(f"Content-Type: {kind}")  # no Content-Disposition at all
        elif shape == 3:
            lines.append(f'Content-Disposition: form-data; name="{name}"; filename="../../etc/passwd"')
            lines.append("Content-Transfer-Encoding: base64")
        else:
            lines.append(f'Content-Disposition: form-data; name="{name}"')
            lines.append(f"Content-Type: {kind}")
        lines += ["", str(content)]
    if rng.random() < 0.8:
        lines.append(f"--{boundary}--")
    text = "\r\n".join(lines) + rng.choice(["\r\n", "", "\n"])
    data = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.2:
        data = data[: rng.randrange(0, max(1, len(data)))]
    content_type = rng.choice([f"multipart/form-data; boundary={boundary}", "multipart/form-data",
                               f'multipart/form-data; boundary="{boundary}"', "multipart/form-data; boundary=other",
                               f"multipart/mixed; boundary={boundary}"])
    return data, content_type
