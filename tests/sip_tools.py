"""Tools for the SIP tests: G.711 and RTP, classic pcap files, SIPp scenarios and a loopback capture.

Everything a real SIP caller needs that no package gives us ready-made: SIPp's ``play_pcap_audio``
plays an Ethernet/IPv4/UDP pcap of RTP packets, and what the caller receives is captured on the
loopback interface by tshark and decoded here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lychee_rtc.pcm import PcmResampler
from lychee_rtc.telephony.g711 import g711_decode, g711_encode

RATE = 8000
FRAME = 160  # 20 ms of G.711
PT_PCMU = 0
PT_TELEPHONE_EVENT = 101
DTMF_CODES = {d: i for i, d in enumerate("0123456789*#ABCD")}
REPO = Path(__file__).resolve().parents[1]


def ulaw_encode(x: np.ndarray) -> bytes:
    return g711_encode(x, "mulaw")


def ulaw_decode(data: bytes) -> np.ndarray:
    return g711_decode(data, "mulaw")


def to_8k(x: np.ndarray, rate: int) -> np.ndarray:
    r = PcmResampler(rate, RATE)
    return np.concatenate([r.process(x.astype(np.float32)), r.flush()])


# --- RTP and pcap ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rtp:
    arrival: float
    payload_type: int
    seq: int
    timestamp: int
    ssrc: int
    marker: bool
    payload: bytes


def rtp_packet(pt: int, seq: int, ts: int, ssrc: int, payload: bytes, marker: bool = False) -> bytes:
    return struct.pack("!BBHII", 0x80, (0x80 if marker else 0) | pt, seq & 0xFFFF, ts & 0xFFFFFFFF, ssrc) + payload


def _ip_checksum(header: bytes) -> int:
    total = sum(struct.unpack("!10H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _frame(udp_payload: bytes, src_port: int = 6000, dst_port: int = 6002) -> bytes:
    udp = struct.pack("!HHHH", src_port, dst_port, 8 + len(udp_payload), 0) + udp_payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                     socket.inet_aton("127.0.0.1"), socket.inet_aton("127.0.0.1"))
    ip = ip[:10] + struct.pack("!H", _ip_checksum(ip)) + ip[12:]
    return b"\x00" * 12 + b"\x08\x00" + ip + udp  # Ethernet: zero MACs, IPv4


def write_pcap(path: Path, packets: list[tuple[float, bytes]]) -> None:
    """A classic (not pcapng) Ethernet pcap of UDP datagrams at the given times, as SIPp wants."""
    with path.open("wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        for t, payload in packets:
            frame = _frame(payload)
            sec = int(t)
            f.write(struct.pack("<IIII", sec, int(round((t - sec) * 1e6)), len(frame), len(frame)))
            f.write(frame)


def speech_pcap(path: Path, parts: list[np.ndarray | str], ssrc: int = 0x1234ABCD) -> float:
    """RTP/PCMU at 20 ms per packet for 8 kHz float signals; a string part is DTMF keys (RFC 4733,
    each 100 ms plus 60 ms of silence). Returns the duration in seconds."""
    packets: list[tuple[float, bytes]] = []
    seq, ts, t = 1, 0, 0.0
    marker = True
    for part in parts:
        if isinstance(part, str):
            for key in part:
                # One press: updates every 20 ms with the same timestamp, the last one (E bit)
                # three times, then the stream moves on past the event's duration.
                steps = [(n * FRAME, False) for n in range(1, 5)] + [(5 * FRAME, True)] * 3
                for i, (duration, end) in enumerate(steps):
                    payload = bytes([DTMF_CODES[key], (0x80 if end else 0) | 10]) + struct.pack("!H", duration)
                    packets.append((t, rtp_packet(PT_TELEPHONE_EVENT, seq, ts, ssrc, payload, marker=i == 0)))
                    seq, t = seq + 1, t + 0.02
                ts += 5 * FRAME
                seq, ts, t = _add_audio(packets, np.zeros(3 * FRAME, np.float32), seq, ts, t, ssrc)
            continue
        seq, ts, t = _add_audio(packets, part, seq, ts, t, ssrc, marker)
        marker = False
    write_pcap(path, packets)
    return t


def _add_audio(packets, signal: np.ndarray, seq: int, ts: int, t: float, ssrc: int, marker: bool = False):
    n = len(signal) // FRAME
    coded = ulaw_encode(signal[: n * FRAME])
    for i in range(n):
        packets.append((t, rtp_packet(PT_PCMU, seq, ts, ssrc, coded[i * FRAME:(i + 1) * FRAME], marker and i == 0)))
        seq, ts, t = seq + 1, ts + FRAME, t + 0.02
    return seq, ts, t


def read_pcap_udp(path: Path, with_ports: bool = False) -> list:
    """(time, UDP payload) of each IPv4/UDP packet of a classic pcap (Ethernet, Linux cooked or null);
    with ``with_ports``, (time, source port, destination port, payload)."""
    data = path.read_bytes()
    if len(data) < 24:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    endian = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    nano = magic in (0xA1B23C4D, 0x4D3CB2A1)
    linktype = struct.unpack(endian + "I", data[20:24])[0]
    offset = {1: 14, 113: 16, 0: 4, 276: 20}.get(linktype)
    if offset is None:
        raise ValueError(f"unsupported pcap link type {linktype}")
    out, pos = [], 24
    while pos + 16 <= len(data):
        sec, frac, incl, _ = struct.unpack(endian + "IIII", data[pos:pos + 16])
        frame = data[pos + 16:pos + 16 + incl]
        pos += 16 + incl
        ip = frame[offset:]
        if len(ip) < 28 or ip[0] >> 4 != 4 or ip[9] != 17:
            continue
        ihl = (ip[0] & 0x0F) * 4
        src, dst, udp_len = struct.unpack("!HHH", ip[ihl:ihl + 6])
        at = sec + frac / (1e9 if nano else 1e6)
        out.append((at, src, dst, ip[ihl + 8:ihl + udp_len]) if with_ports else (at, ip[ihl + 8:ihl + udp_len]))
    return out


def parse_rtp(packets: list[tuple[float, bytes]]) -> list[Rtp]:
    out = []
    for t, data in packets:
        if len(data) < 12 or data[0] >> 6 != 2:
            continue
        cc = data[0] & 0x0F
        start = 12 + 4 * cc
        if data[0] & 0x10 and len(data) >= start + 4:  # header extension
            start += 4 + 4 * struct.unpack("!H", data[start + 2:start + 4])[0]
        end = len(data) - (data[-1] if data[0] & 0x20 else 0)
        seq, ts, ssrc = struct.unpack("!HII", data[2:12])
        out.append(Rtp(t, data[1] & 0x7F, seq, ts, ssrc, bool(data[1] & 0x80), data[start:end]))
    return out


def pcmu_audio(packets: list[Rtp]) -> np.ndarray:
    """The audio itself, for comparing content: payloads in RTP timestamp order, each timestamp once,
    the gaps between them closed. A server that skipped the slots of a stall sent its audio on, with
    the timestamps jumping over them (rtc/outbound.py); ``pcmu_signal`` keeps that timing, gaps as
    silence, and a content comparison of it would measure the stall, not what was heard."""
    audio = [p for p in packets if p.payload_type == PT_PCMU]
    if not audio:
        return np.zeros(0, np.float32)
    base = audio[0].timestamp
    seen: dict[int, bytes] = {}
    for p in audio:
        seen.setdefault((p.timestamp - base) & 0xFFFFFFFF, p.payload)
    return np.concatenate([ulaw_decode(seen[t]) for t in sorted(seen)])


def pcmu_signal(packets: list[Rtp]) -> tuple[np.ndarray, int]:
    """The caller's received audio placed by RTP timestamp (gaps as silence), and its first timestamp."""
    audio = [p for p in packets if p.payload_type == PT_PCMU]
    if not audio:
        return np.zeros(0, np.float32), 0
    base = audio[0].timestamp
    span = max((p.timestamp - base) & 0xFFFFFFFF for p in audio) + FRAME
    out = np.zeros(min(span, RATE * 600), np.float32)
    for p in audio:
        at = (p.timestamp - base) & 0xFFFFFFFF
        chunk = ulaw_decode(p.payload)[: max(0, len(out) - at)]
        out[at:at + len(chunk)] = chunk
    return out, base


# --- capture -----------------------------------------------------------------------------------------

class LoopbackCapture:
    """tshark on ``lo`` for UDP to one port (or a BPF ``udp dst portrange a-b``), as a classic pcap."""

    def __init__(self, path: Path, port: int | str) -> None:
        self.path = path
        self.filter = f"udp dst port {port}" if isinstance(port, int) else port
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> "LoopbackCapture":
        self._proc = await asyncio.create_subprocess_exec(
            "tshark", "-i", "lo", "-f", self.filter, "-F", "pcap", "-w", str(self.path), "-q",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        assert self._proc.stderr is not None
        # tshark says "Capturing on ..." once the capture runs; nothing sent before that is seen.
        async def ready() -> None:
            while True:
                line = await self._proc.stderr.readline()
                if not line:
                    raise RuntimeError("tshark exited before capturing")
                if b"Capturing on" in line:
                    return
        try:
            await asyncio.wait_for(ready(), 60)
        except BaseException:  # not ready (or the test gave up): no capture outlives it
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def stop(self) -> list[Rtp]:
        if self._proc is not None and self._proc.returncode is None:
            # tshark and its dumpcap child: the whole group, so no capture outlives the test.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), 30)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                await self._proc.wait()
        return parse_rtp(read_pcap_udp(self.path)) if self.path.exists() else []


# --- SIPp --------------------------------------------------------------------------------------------

def sipp_invite_sdp(dtmf: bool = True) -> str:
    pts = f"{PT_PCMU} {PT_TELEPHONE_EVENT}" if dtmf else f"{PT_PCMU}"
    lines = ["v=0", "o=user1 53655765 2353687637 IN IP[local_ip_type] [local_ip]", "s=-",
             "c=IN IP[media_ip_type] [media_ip]", "t=0 0", f"m=audio [media_port] RTP/AVP {pts}",
             f"a=rtpmap:{PT_PCMU} PCMU/8000"]
    if dtmf:
        lines += [f"a=rtpmap:{PT_TELEPHONE_EVENT} telephone-event/8000", f"a=fmtp:{PT_TELEPHONE_EVENT} 0-15"]
    lines += ["a=ptime:20", "a=sendrecv"]
    return "\n".join(lines) + "\n"


def sipp_uac_scenario(pcap: Path | None, hold_ms: int, hangup: str = "caller", info_digits: str = "",
                      info_after_ms: int = 0, expect_busy: bool = False, refused_with: int | None = None) -> str:
    """A SIPp caller: INVITE with G.711 (and telephone-event), play ``pcap``, hold ``hold_ms``, then
    hang up (``hangup="caller"``) or wait for the callee's BYE (``"callee"``). ``expect_busy``: the
    call must be refused with 486; ``refused_with``: with that status."""
    invite = f"""
  <send retrans="500">
    <![CDATA[
INVITE sip:[service]@[remote_ip]:[remote_port] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: "Test caller" <sip:caller[call_number]@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:[service]@[remote_ip]:[remote_port]>
Call-ID: [call_id]
CSeq: 1 INVITE
Contact: <sip:caller[call_number]@[local_ip]:[local_port]>
Max-Forwards: 70
Subject: lychee-rtc test
Content-Type: application/sdp
Content-Length: [len]

{sipp_invite_sdp()}
    ]]>
  </send>
  <recv response="100" optional="true"/>
  <recv response="180" optional="true"/>
  <recv response="183" optional="true"/>
"""
    if expect_busy or refused_with:
        return _scenario(invite + f"""
  <recv response="{refused_with or 486}"/>
  <send>
    <![CDATA[
ACK sip:[service]@[remote_ip]:[remote_port] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: "Test caller" <sip:caller[call_number]@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:[service]@[remote_ip]:[remote_port]>[peer_tag_param]
Call-ID: [call_id]
CSeq: 1 ACK
Max-Forwards: 70
Content-Length: 0

    ]]>
  </send>
""")
    body = invite + """
  <recv response="200" rrs="true" rtd="true"/>
  <send>
    <![CDATA[
ACK [next_url] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: "Test caller" <sip:caller[call_number]@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:[service]@[remote_ip]:[remote_port]>[peer_tag_param]
[routes]
Call-ID: [call_id]
CSeq: 1 ACK
Contact: <sip:caller[call_number]@[local_ip]:[local_port]>
Max-Forwards: 70
Content-Length: 0

    ]]>
  </send>
"""
    if pcap is not None:
        body += f"""
  <nop>
    <action>
      <exec play_pcap_audio="{pcap}"/>
    </action>
  </nop>
"""
    cseq = 2
    if info_digits:
        body += f'  <pause milliseconds="{info_after_ms}"/>\n'
        for digit in info_digits:
            body += f"""
  <send>
    <![CDATA[
INFO [next_url] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: "Test caller" <sip:caller[call_number]@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:[service]@[remote_ip]:[remote_port]>[peer_tag_param]
[routes]
Call-ID: [call_id]
CSeq: {cseq} INFO
Contact: <sip:caller[call_number]@[local_ip]:[local_port]>
Max-Forwards: 70
Content-Type: application/dtmf-relay
Content-Length: [len]

Signal={digit}
Duration=160
    ]]>
  </send>
  <recv response="200"/>
"""
            cseq += 1
    if hangup == "caller":
        body += f"""
  <pause milliseconds="{hold_ms}"/>
  <send retrans="500">
    <![CDATA[
BYE [next_url] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: "Test caller" <sip:caller[call_number]@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:[service]@[remote_ip]:[remote_port]>[peer_tag_param]
[routes]
Call-ID: [call_id]
CSeq: {cseq} BYE
Contact: <sip:caller[call_number]@[local_ip]:[local_port]>
Max-Forwards: 70
Content-Length: 0

    ]]>
  </send>
  <recv response="200" crlf="true"/>
"""
    else:  # wait for the server's BYE (up to hold_ms) and answer it
        body += f"""
  <recv request="BYE" timeout="{hold_ms}"/>
  <send>
    <![CDATA[
SIP/2.0 200 OK
[last_Via:]
[last_From:]
[last_To:]
[last_Call-ID:]
[last_CSeq:]
Contact: <sip:caller[call_number]@[local_ip]:[local_port]>
Content-Length: 0

    ]]>
  </send>
"""
    return _scenario(body)


def _scenario(body: str) -> str:
    return f'<?xml version="1.0" encoding="ISO-8859-1" ?>\n<scenario name="lychee-rtc caller">\n{body}\n</scenario>\n'


@dataclass
class SippResult:
    returncode: int
    stdout: str
    stderr: str
    stats: str

    def explain(self) -> str:
        return f"sipp exit {self.returncode}\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}\n{self.stats[-2000:]}"


async def listening(uas: "Uas", run: "asyncio.Task[SippResult]", timeout_s: float = 30.0) -> None:
    """Wait until the callee SIPp that ``run`` started listens; if it exits first, say why it did."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not uas.ready():
        if run.done():
            result = run.result()
            raise AssertionError(f"SIPp exited before it listened on {uas.sip_port}: {result.explain()}")
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for SIPp to listen on {uas.sip_port}")
        await asyncio.wait({run}, timeout=0.05)


async def run_sipp(scenario: str, workdir: Path, sip_port: int, media_port: int, calls: int = 1,
                   service: str = "lychee", timeout_s: float = 120.0, tag: str = "uac") -> SippResult:
    """Run SIPp as a caller through the registrar at 127.0.0.1:``sip_port``; ``calls`` at once."""
    return await _sipp(scenario, workdir, tag, timeout_s, [
        f"127.0.0.1:{sip_port}", "-s", service, "-i", "127.0.0.1", "-p", str(_free_udp_port()),
        "-mi", "127.0.0.1", "-mp", str(media_port), "-m", str(calls), "-l", str(calls), "-r", str(calls),
        "-rp", "1000", "-max_invite_retrans", "3", "-trace_stat", "-stf", str(workdir / f"{tag}_stats.csv")])


async def _sipp(scenario: str, workdir: Path, tag: str, timeout_s: float, args: list[str],
                message_tail: bool = False) -> SippResult:
    """One SIPp run of ``scenario`` with ``args``; its errors (and with ``message_tail`` the end of its
    message trace) in the result's ``stats``."""
    xml = workdir / f"{tag}.xml"
    for stale in workdir.glob(f"{tag}_*"):
        stale.unlink()
    xml.write_text(scenario)
    errors = workdir / f"{tag}_errors.log"
    messages = workdir / f"{tag}_messages.log"
    argv = ["sipp", "-sf", str(xml), *args, "-nostdin", "-timeout", f"{int(timeout_s)}s", "-timeout_error",
            "-trace_err", "-error_file", str(errors), "-trace_msg", "-message_file", str(messages)]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=workdir, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s + 30)
    except asyncio.TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
    except BaseException:  # the test ended without waiting for it (it failed, or was cancelled): SIPp goes too
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    stats = errors.read_text(errors="replace") if errors.exists() else ""
    if message_tail:
        stats += "\n" + (messages.read_text(errors="replace")[-4000:] if messages.exists() else "")
    return SippResult(proc.returncode if proc.returncode is not None else -1, out.decode(errors="replace"),
                      err.decode(errors="replace"), stats)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MEDIA_BLOCKS: set[int] = set()  # media bases handed to SIPp in this run: a later one must not overlap them


def free_media_port() -> int:
    """A base for SIPp's media (``-mp``), which binds it and the three UDP ports above it (RTP and RTCP, audio
    and video): all four free, held together while checked, and clear of every block handed out before in this
    run (SIPp's calls of one test run side by side). A base picked alone once had SIPp fail to bind its video
    RTP two ports up (errno 98) on a busy machine."""
    while True:
        held = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
        try:
            held[0].bind(("127.0.0.1", 0))
            base = held[0].getsockname()[1]
            for k, s in enumerate(held[1:], 1):
                s.bind(("127.0.0.1", base + k))
        except (OSError, OverflowError):  # one of the three above is taken (or beyond 65535): another base
            continue
        finally:
            for s in held:
                s.close()
        if all(abs(base - other) >= 4 for other in _MEDIA_BLOCKS):
            _MEDIA_BLOCKS.add(base)
            return base


def ensure_tools() -> None:
    """The Debian packages the SIP tests drive, installed through the repository's helper if missing."""
    needed = {"sipp": "sip-tester", "tshark": "tshark", "baresip": "baresip", "kamailio": "kamailio",
              "janus": "janus"}
    missing = [pkg for exe, pkg in needed.items() if shutil.which(exe) is None]
    if missing:
        subprocess.run([str(REPO / "scripts" / "system-packages"), *missing], check=True,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


# --- the far end of a call the server places -------------------------------------------------------

def sip_register(registrar_port: int, user: str, contact_port: int | None, expires: int = 300,
                 timeout: float = 5.0) -> int | None:
    """REGISTER ``sip:user@127.0.0.1`` at the registrar with a Contact on ``contact_port`` (where a
    SIPp UAS listens), or with ``contact_port=None`` remove every binding of the user (``Contact: *``);
    returns the final status (None: no answer). Kamailio here asks no password."""
    contact = "*" if contact_port is None else f"<sip:{user}@127.0.0.1:{contact_port}>"
    expires = 0 if contact_port is None else expires
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
        tag = os.urandom(6).hex()
        msg = (f"REGISTER sip:127.0.0.1:{registrar_port} SIP/2.0\r\n"
               f"Via: SIP/2.0/UDP 127.0.0.1:{local};branch=z9hG4bK{tag}\r\n"
               "Max-Forwards: 70\r\n"
               f"From: <sip:{user}@127.0.0.1:{registrar_port}>;tag={tag}\r\n"
               f"To: <sip:{user}@127.0.0.1:{registrar_port}>\r\n"
               f"Call-ID: {tag}@127.0.0.1\r\n"
               "CSeq: 1 REGISTER\r\n"
               f"Contact: {contact}\r\n"
               f"Expires: {expires}\r\nContent-Length: 0\r\n\r\n")
        s.settimeout(timeout)
        try:
            s.sendto(msg.encode(), ("127.0.0.1", registrar_port))
            while True:
                found = re.match(rb"SIP/2\.0 (\d{3}) ", s.recv(4096))
                if found is None:
                    return None
                if int(found[1]) >= 200:
                    return int(found[1])
        except OSError:
            return None


def _reply(status: str, sdp: bool = False, to_tag: bool = True) -> str:
    body = sipp_invite_sdp(dtmf=False) if sdp else ""
    return f"""
  <send{' retrans="500"' if sdp else ''}>
    <![CDATA[
SIP/2.0 {status}
[last_Via:]
[last_From:]
[last_To:]{';tag=[pid]SIPpTag01[call_number]' if to_tag else ''}
[last_Call-ID:]
[last_CSeq:]
[last_Record-Route:]
Contact: <sip:callee@[local_ip]:[local_port]>
{'Content-Type: application/sdp' + chr(10) if sdp else ''}Content-Length: [len]

{body}
    ]]>
  </send>
"""


def sipp_uas_scenario(answer: str, pcap: Path | None = None, ring_ms: int = 300, hold_ms: int = 60000) -> str:
    """A SIPp callee: rings, then ``answer``: "answer" (200 with G.711, plays ``pcap``, then waits up
    to ``hold_ms`` for the server's BYE), a status like "486 Busy Here" (refused), or "never" (rings
    until the caller's CANCEL, answered 200 and 487)."""
    body = '  <recv request="INVITE" crlf="true"/>\n' + _reply("180 Ringing")
    if answer == "never":
        body += """
  <recv request="CANCEL">
    <action><ereg regexp="[0-9]+" search_in="hdr" header="CSeq:" assign_to="cseq"/></action>
  </recv>
""" + _reply("200 OK", to_tag=False) + """
  <send>
    <![CDATA[
SIP/2.0 487 Request Terminated
[last_Via:]
[last_From:]
[last_To:];tag=[pid]SIPpTag01[call_number]
[last_Call-ID:]
CSeq: [$cseq] INVITE
Content-Length: 0

    ]]>
  </send>
  <recv request="ACK"/>
"""
        return _scenario(body)
    body += f'  <pause milliseconds="{ring_ms}"/>\n'
    if answer != "answer":
        return _scenario(body + _reply(answer) + '  <recv request="ACK"/>\n')
    body += _reply("200 OK", sdp=True) + '  <recv request="ACK" crlf="true"/>\n'
    if pcap is not None:
        body += f"""
  <nop>
    <action>
      <exec play_pcap_audio="{pcap}"/>
    </action>
  </nop>
"""
    body += f'  <recv request="BYE" timeout="{hold_ms}"/>\n' + _reply("200 OK", to_tag=False)
    return _scenario(body)


def udp_bound(port: int) -> bool:
    """Whether something on this host listens on UDP ``port`` (a SIPp that is ready for its INVITE)."""
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local = line.split()[1]
                if int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


@dataclass
class Uas:
    """A SIPp callee listening on ``sip_port`` (run it with ``run``; ``ready`` once it listens)."""

    sip_port: int
    media_port: int

    @classmethod
    def on_free_ports(cls) -> "Uas":
        """A callee on free UDP ports: a block for its media (``free_media_port``) and its SIP port outside
        it (SIPp that cannot bind its media never listens)."""
        media = free_media_port()
        while True:
            sip = _free_udp_port()
            if not media <= sip < media + 4:
                return cls(sip_port=sip, media_port=media)

    def ready(self) -> bool:
        return udp_bound(self.sip_port)

    async def run(self, scenario: str, workdir: Path, tag: str = "uas", timeout_s: float = 120.0,
                  calls: int = 1) -> SippResult:
        return await _sipp(scenario, workdir, tag, timeout_s, [
            "-i", "127.0.0.1", "-p", str(self.sip_port), "-mi", "127.0.0.1", "-mp", str(self.media_port),
            "-m", str(calls)], message_tail=True)
