"""``lychee-rtc bench sip``: how long the SIP gateway's call control takes, on the local stack.

Kamailio and Janus run as the tests run them (``gateway/stack.py``); the server (``configs/
telephony.yaml``, the echo engine) runs in a child process; the phones are SIPp and baresip, driven
by the suite's own helpers (``tests/sip_tools.py``: the bench needs a checkout, root for SIPp's raw
sockets and tshark, and the packages ``make test`` installs). Per round:

* **dial**: ``POST /v1/telephony/calls`` to a SIPp callee that rings 300 ms and answers. *Dial to
  ringing* is the resource's ``ringing_at - created_at`` (the 180 back through Janus); *answer to
  first audio* is from ``answered_at`` to the first RTP packet of the server's leg captured (tshark)
  at the callee's media port, i.e. the WebRTC leg coming up through Janus plus the first frame.
* **blind transfer**: baresip calls the bot, and once it is answered, ``POST …/transfer`` to a SIPp
  person who answers at once: from the request to the ``call.transfer`` ``completed`` event, which
  the server sends on baresip's NOTIFY 200 (the REFER through Janus, baresip's INVITE to the person
  through Kamailio, the person's 200, the NOTIFY back).
* **attended transfer**: the same caller; ``POST …/consult`` to the person (answered), then ``POST
  …/transfer {"consult": id}``: from that request to ``completed``.

Times are wall-clock on one machine (the server's resource times and the bench's own clock).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from lychee_rtc.bench.server_process import spawned_server
from lychee_rtc.gateway.stack import StackPorts, TelephonyStack

TESTS = Path(__file__).resolve().parents[2] / "tests"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peers() -> Any:
    if not (TESTS / "sip_tools.py").exists():
        raise SystemExit("bench sip drives SIPp and baresip with the suite's helpers: run it from a checkout")
    if os.geteuid() != 0:
        raise SystemExit("bench sip needs root: SIPp plays RTP from a raw socket and tshark captures on loopback")
    sys.path.insert(0, str(TESTS))
    import sip_tools

    sip_tools.ensure_tools()
    return sip_tools


def _baresip(folder: Path, port: int, rtp: tuple[int, int]) -> Path:
    """A baresip that says nothing (a silent file) and follows REFERs, as the transfer tests' caller."""
    import wave

    folder.mkdir(parents=True, exist_ok=True)
    wav = folder / "silence.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(np.zeros(8000 * 120, "<i2").tobytes())
    (folder / "config").write_text(
        "module_path /usr/lib/baresip/modules\n"
        f"sip_listen 127.0.0.1:{port}\n"
        f"audio_source aufile,{wav}\naudio_player aubridge,nowhere\naudio_alert aubridge,nowhere\n"
        f"rtp_ports {rtp[0]}-{rtp[1]}\nnet_interface 127.0.0.1\n"
        "module stdio.so\nmodule g711.so\nmodule aufile.so\nmodule aubridge.so\n"
        "module_app account.so\nmodule_app menu.so\n")
    (folder / "accounts").write_text("<sip:baresip@127.0.0.1>;regint=0;audio_codecs=PCMU\n")
    return folder


async def _until(check, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := await check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:.0f} s")
        await asyncio.sleep(0.01)
    return found


async def _json(http: aiohttp.ClientSession, method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    async with http.request(method, url, json=body) as resp:
        raw = await resp.read()
        return resp.status, (json.loads(raw) if raw else {})


async def _callee(tools: Any, stack: TelephonyStack, user: str) -> Any:
    uas = tools.Uas.on_free_ports()
    await asyncio.to_thread(tools.sip_register, stack.ports.sip, user, None)
    assert await asyncio.to_thread(tools.sip_register, stack.ports.sip, user, uas.sip_port) == 200
    return uas


async def dial_round(tools: Any, stack: TelephonyStack, url: str, work: Path) -> dict[str, float]:
    work.mkdir(parents=True, exist_ok=True)
    uas = await _callee(tools, stack, "alice")
    pcap = work / "alice.pcap"
    tools.speech_pcap(pcap, [np.zeros(8000, np.float32)])
    async with aiohttp.ClientSession() as http, tools.LoopbackCapture(work / "rx.pcap", uas.media_port) as capture:
        far_end = asyncio.create_task(uas.run(tools.sipp_uas_scenario("answer", pcap), work))
        await _until(lambda: asyncio.sleep(0, uas.ready()), 30, "SIPp to listen")
        status, body = await _json(http, "POST", f"{url}/v1/telephony/calls", {"to": f"sip:alice@127.0.0.1:{stack.ports.sip}"})
        assert status == 201, body

        async def answered() -> dict | None:
            _, r = await _json(http, "GET", f"{url}/v1/telephony/calls/{body['id']}")
            return r if r.get("answered_at") else None

        resource = await _until(answered, 60, "the answer")
        await asyncio.sleep(1.0)  # the leg comes up and its first frames reach the callee
        await _json(http, "DELETE", f"{url}/v1/telephony/calls/{body['id']}")
        await far_end
        rtp = await capture.stop()
    audio = [p.arrival for p in rtp if p.payload_type in (0, 8)]
    return {"dial_to_ringing_ms": 1000 * (resource["ringing_at"] - resource["created_at"]),
            "answer_to_first_audio_ms": 1000 * (min(audio) - resource["answered_at"]) if audio else float("nan"),
            "callee_packets": len(rtp)}


async def transfer_round(tools: Any, stack: TelephonyStack, url: str, work: Path, attended: bool) -> dict[str, float]:
    work.mkdir(parents=True, exist_ok=True)
    caller_port, rtp = _free_port(), (24000, 24999)
    conf = _baresip(work / "baresip", caller_port, rtp)
    uas = await _callee(tools, stack, "bob")
    pcap = work / "bob.pcap"
    tools.speech_pcap(pcap, [np.zeros(8000, np.float32)])
    # The person answers at once (no ring): what is timed is the phones', Kamailio's, Janus's and the
    # server's own work.
    far_end = asyncio.create_task(uas.run(tools.sipp_uas_scenario("answer", pcap, ring_ms=0, hold_ms=60000), work,
                                          calls=2 if attended else 1, tag="bob", timeout_s=90))
    await _until(lambda: asyncio.sleep(0, uas.ready()), 30, "SIPp to listen")
    log = (work / "baresip.log").open("wb")
    proc = await asyncio.create_subprocess_exec("baresip", "-f", str(conf), "-e", f"/dial {stack.bot_uri}", "-t", "90",
                                                stdin=asyncio.subprocess.PIPE, stdout=log, stderr=asyncio.subprocess.STDOUT)
    events: list[tuple[float, dict]] = []
    try:
        async with aiohttp.ClientSession() as http:
            async def session_id() -> str | None:
                _, listing = await _json(http, "GET", f"{url}/v1/sessions")
                calls = [s for s in listing.get("sessions", []) if s.get("origin", {}).get("direction") != "outbound"]
                return calls[0]["session_id"] if calls else None

            try:
                sid = await _until(session_id, 60, "baresip's call")
            except RuntimeError:
                log.flush()
                raise RuntimeError("baresip's call never came: " +
                                   (work / "baresip.log").read_text(errors="replace")[-1500:]) from None
            ws = await http.ws_connect(f"{url}/v1/telephony/calls/{sid}/events")
            reader = asyncio.create_task(_read(ws, events))
            target = f"sip:bob@127.0.0.1:{stack.ports.sip}"
            body: dict[str, Any] = {"target_uri": target}
            if attended:
                status, consult = await _json(http, "POST", f"{url}/v1/telephony/calls/{sid}/consult", {"target_uri": target})
                assert status == 201, consult

                async def consult_answered() -> bool:
                    _, r = await _json(http, "GET", f"{url}/v1/telephony/calls/{consult['id']}")
                    return r.get("status") == "answered"

                try:
                    await _until(consult_answered, 60, "the person to answer")
                except RuntimeError:
                    _, r = await _json(http, "GET", f"{url}/v1/telephony/calls/{consult['id']}")
                    raise RuntimeError(f"the person's call: {r}") from None
                body = {"consult": consult["id"]}
            asked = time.time()
            status, answer = await _json(http, "POST", f"{url}/v1/telephony/calls/{sid}/transfer", body)
            assert status == 202, answer

            async def completed() -> float | None:
                done = [t for t, e in events if e.get("type") == "call.transfer" and e.get("status") in ("completed", "failed")]
                return done[0] if done else None

            done_at = await _until(completed, 60, "the transfer's end")
            outcome = [e for _, e in events if e.get("type") == "call.transfer"][-1]
            reader.cancel()
            await ws.close()
            # The caller hangs up on the person, whose SIPp then ends its scenario (and its process).
            assert proc.stdin is not None
            proc.stdin.write(b"/hangup\n")
            await proc.stdin.drain()
            await asyncio.wait_for(asyncio.shield(far_end), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if not far_end.done():
            await far_end  # SIPp's own timeout (its -timeout) ends it at the latest
        log.close()
    key = "attended_transfer_ms" if attended else "blind_transfer_ms"
    return {key: 1000 * (done_at - asked), f"{key}_outcome": outcome.get("status"),
            f"{key}_reason": outcome.get("reason")}


async def _read(ws: aiohttp.ClientWebSocketResponse, events: list[tuple[float, dict]]) -> None:
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.TEXT:
            events.append((time.time(), json.loads(msg.data)))


async def _main(args: argparse.Namespace) -> int:
    tools = _peers()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lychee-bench-sip-") as tmp:
        root = Path(tmp)
        with TelephonyStack(StackPorts(sip=_free_port(), janus_ws=_free_port()), log_to=root) as stack:
            env = {"LYCHEE_RTC_GATEWAY__JANUS__ENABLED": "true", "LYCHEE_RTC_GATEWAY__JANUS__URL": stack.janus_url,
                   "LYCHEE_RTC_GATEWAY__JANUS__REGISTRAR": stack.registrar,
                   "LYCHEE_RTC_SESSION__MAX_SESSIONS": "4", "PYTHONPATH": os.pathsep.join(sys.path)}
            async with spawned_server("configs/telephony.yaml", env) as (url, _):
                await asyncio.to_thread(_wait_registered, stack)
                for i in range(args.rounds):
                    work = root / f"round{i}"
                    work.mkdir()
                    row: dict[str, Any] = {}
                    for name, step in (("dial", lambda w: dial_round(tools, stack, url, w)),
                                       ("blind", lambda w: transfer_round(tools, stack, url, w, attended=False)),
                                       ("attended", lambda w: transfer_round(tools, stack, url, w, attended=True))):
                        try:  # a phone that misbehaves once (on a loaded machine) costs its step, not the run
                            row.update(await step(work / name))
                        except (RuntimeError, AssertionError, asyncio.TimeoutError) as exc:
                            row[f"{name}_error"] = str(exc)[:300]
                    rows.append(row)
                    print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    summary = {}
    for key in ("dial_to_ringing_ms", "answer_to_first_audio_ms", "blind_transfer_ms", "attended_transfer_ms"):
        values = [r[key] for r in rows if isinstance(r.get(key), float) and np.isfinite(r[key])]
        if values:
            summary[key] = {"p50": round(float(np.median(values)), 1), "min": round(min(values), 1),
                            "max": round(max(values), 1)}
    summary["failed_steps"] = [v for r in rows for k, v in r.items() if k.endswith("_error")]
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rows}, indent=2))
    return 0


def _wait_registered(stack: TelephonyStack, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not stack.registrar_knows_bot():
        if time.monotonic() > deadline:
            raise RuntimeError("the server's gateway did not register at Kamailio")
        time.sleep(0.2)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sip", help="dial, answer and transfer times through the local Kamailio + Janus stack",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="also write every round as JSON here")
    p.set_defaults(func=lambda args: asyncio.run(_main(args)))
