"""A local SIP stack for development and tests: Kamailio (registrar + proxy) and Janus (SIP plugin).

Both run as child processes with config files written into a run folder from the templates in
``configs/telephony/``; SIP, the Janus API and the caller-side RTP are bound to 127.0.0.1. Callers
reach the bot at ``sip:lychee@127.0.0.1:<sip_port>`` once the server's gateway connector has
registered. ``scripts/telephony-stack`` (or ``make telephony``) runs it in the foreground.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import glob
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lychee_rtc.resources import shared_path

PACKAGES = ("kamailio", "janus")
DUMMY_INTERFACE = "lytel0"
DUMMY_ADDRESS = "198.18.77.1"  # benchmarking range (RFC 2544): never routed anywhere


class StackError(RuntimeError):
    """The stack could not be set up or did not come up."""


@dataclass(frozen=True)
class StackPorts:
    sip: int = 5060
    janus_ws: int = 8188
    sip_rtp: tuple[int, int] = (20000, 20999)
    webrtc_rtp: tuple[int, int] = (21000, 21999)


def host_address() -> tuple[str, str] | None:
    """(interface, IPv4 address) of the first up, non-loopback interface, or None."""
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show", "up"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for link in json.loads(out or "[]"):
        for info in link.get("addr_info", []):
            address = info.get("local")
            if address and not ipaddress.ip_address(address).is_loopback:
                return link.get("ifname", ""), address
    return None


def _library_folder(kind: str) -> Path:
    for pattern in (f"/usr/lib/*/janus/{kind}", f"/usr/lib/janus/{kind}", f"/usr/local/lib/janus/{kind}"):
        found = sorted(glob.glob(pattern))
        if found:
            return Path(found[0])
    raise StackError(f"cannot find Janus's {kind} folder; is the janus package installed?")


def _kamailio_modules() -> Path:
    for pattern in ("/usr/lib/*/kamailio/modules", "/usr/lib/kamailio/modules", "/usr/local/lib64/kamailio/modules"):
        found = sorted(glob.glob(pattern))
        if found:
            return Path(found[0])
    raise StackError("cannot find Kamailio's modules folder; is the kamailio package installed?")


def install_packages() -> None:
    """Install Kamailio and Janus through the repository's system-packages helper when missing."""
    if all(shutil.which(exe) for exe in ("kamailio", "janus")):
        return
    helper = Path(__file__).resolve().parents[2] / "scripts" / "system-packages"
    if not helper.exists():
        raise StackError("kamailio and janus are not installed: apt-get install kamailio janus")
    subprocess.run([str(helper), *PACKAGES], check=True)


def _fill(template: Path, values: dict[str, str]) -> str:
    text = template.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    leftover = re.search(r"@[A-Z_]+@", text)
    if leftover:
        raise StackError(f"{template.name}: placeholder {leftover.group(0)} has no value")
    return text


@dataclass
class TelephonyStack:
    ports: StackPorts = field(default_factory=StackPorts)
    run_dir: Path | None = None
    create_dummy_interface: bool = True
    log_to: Path | None = None  # where the two logs go (default: the run folder)
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _own_run_dir: bool = False
    _dummy: bool = False
    ice_address: str = ""

    @property
    def bot_uri(self) -> str:
        return f"sip:lychee@127.0.0.1:{self.ports.sip}"

    @property
    def janus_url(self) -> str:
        return f"ws://127.0.0.1:{self.ports.janus_ws}"

    @property
    def registrar(self) -> str:
        return f"sip:127.0.0.1:{self.ports.sip}"

    def log_path(self, name: str) -> Path:
        assert self.run_dir is not None
        return (self.log_to or self.run_dir) / f"{name}.log"

    # --- set-up ------------------------------------------------------------------------------------

    def _ensure_host_address(self) -> str:
        found = host_address()
        if found is not None:
            return found[1]
        if not self.create_dummy_interface or os.geteuid() != 0:
            raise StackError("this host has no non-loopback IPv4 address, and Janus's ICE never uses loopback: "
                             f"add one (as root: ip link add {DUMMY_INTERFACE} type dummy; "
                             f"ip addr add {DUMMY_ADDRESS}/32 dev {DUMMY_INTERFACE}; ip link set {DUMMY_INTERFACE} up)")
        for cmd in (["ip", "link", "add", DUMMY_INTERFACE, "type", "dummy"],
                    ["ip", "addr", "add", f"{DUMMY_ADDRESS}/32", "dev", DUMMY_INTERFACE],
                    ["ip", "link", "set", DUMMY_INTERFACE, "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        self._dummy = True
        return DUMMY_ADDRESS

    def write_configs(self) -> None:
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="lychee-telephony-"))
            self._own_run_dir = True
        run = self.run_dir
        run.mkdir(parents=True, exist_ok=True)
        templates = shared_path("configs") / "telephony"
        values = {
            "RUN_DIR": str(run),
            "SIP_PORT": str(self.ports.sip),
            "JANUS_WS_PORT": str(self.ports.janus_ws),
            "SIP_RTP_RANGE": "%d-%d" % self.ports.sip_rtp,
            "WEBRTC_RTP_RANGE": "%d-%d" % self.ports.webrtc_rtp,
            "ICE_ADDRESS": self.ice_address,
            "MODULES": str(_kamailio_modules()),
        }
        for name in ("kamailio.cfg", "janus.jcfg", "janus.plugin.sip.jcfg", "janus.transport.websockets.jcfg"):
            (run / name).write_text(_fill(templates / name, values))
        # Janus loads every library in its plugin and transport folders: link only the two we use.
        for kind, library in (("plugins", "libjanus_sip.so"), ("transports", "libjanus_websockets.so")):
            folder = run / kind
            folder.mkdir(exist_ok=True)
            link = folder / library
            if not link.exists():
                link.symlink_to(_library_folder(kind) / library)
        (run / "none").mkdir(exist_ok=True)
        (run / "kamailio-run").mkdir(exist_ok=True)

    def start(self) -> None:
        install_packages()
        self.ice_address = self._ensure_host_address()
        self.write_configs()
        self.start_kamailio()
        self.start_janus()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.log_path(name).open("ab")
        # A process group of its own, so stopping it also stops the children it forks.
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
        log.close()

    def start_kamailio(self) -> None:
        assert self.run_dir is not None
        self._spawn("kamailio", ["kamailio", "-f", str(self.run_dir / "kamailio.cfg"), "-DD", "-E", "-m", "64",
                                 "-M", "8", "-Y", str(self.run_dir / "kamailio-run")])
        self._wait(lambda: sip_ping(self.ports.sip), "kamailio", "Kamailio to answer SIP")

    def start_janus(self) -> None:
        assert self.run_dir is not None
        self._spawn("janus", ["janus", "-C", str(self.run_dir / "janus.jcfg"), "-F", str(self.run_dir), "-o"])
        self._wait(lambda: janus_ping(self.ports.janus_ws), "janus", "Janus's WebSocket API")

    def _wait(self, probe, name: str, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            proc = self._procs[name]
            if proc.poll() is not None:
                raise StackError(f"{name} exited with status {proc.returncode}; see {self.log_path(name)}:\n"
                                 + self.log_path(name).read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                raise StackError(f"waited {timeout:.0f} s for {what}; see {self.log_path(name)}")
            time.sleep(0.1)

    # --- tear-down ---------------------------------------------------------------------------------

    def stop_process(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def registrar_knows_bot(self) -> bool:
        """True when Kamailio routes a request for the bot's URI (it holds a registration for it)."""
        status = sip_options(self.ports.sip, self.bot_uri, timeout=2.0)
        return status is not None and status != 404

    def restart(self, name: str) -> None:
        self.stop_process(name)
        (self.start_kamailio if name == "kamailio" else self.start_janus)()

    def stop(self) -> None:
        for name in ("janus", "kamailio"):
            self.stop_process(name)
        if self._dummy:
            subprocess.run(["ip", "link", "del", DUMMY_INTERFACE], capture_output=True)
            self._dummy = False
        if self._own_run_dir and self.run_dir is not None and self.log_to is None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "TelephonyStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def sip_options(port: int, request_uri: str | None = None, host: str = "127.0.0.1",
                timeout: float = 0.5) -> int | None:
    """Send one SIP OPTIONS to ``host:port`` and return the final status code (None: no answer).

    With ``request_uri`` naming a registered user, a registrar that knows the user forwards the
    request to it, and one that does not answers 404: the registrar's own view of a registration.
    """
    uri = request_uri or f"sip:{host}:{port}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
        call_id = os.urandom(6).hex()
        msg = (f"OPTIONS {uri} SIP/2.0\r\n"
               f"Via: SIP/2.0/UDP 127.0.0.1:{local};branch=z9hG4bK{call_id}\r\n"
               "Max-Forwards: 70\r\n"
               f"From: <sip:probe@127.0.0.1>;tag={call_id}\r\n"
               f"To: <{uri}>\r\n"
               f"Call-ID: {call_id}@127.0.0.1\r\n"
               "CSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n")
        s.settimeout(timeout)
        try:
            s.sendto(msg.encode(), (host, port))
            while True:  # skip provisional answers (a proxy's 100 Trying)
                status = re.match(rb"SIP/2\.0 (\d{3}) ", s.recv(4096))
                if status is None:
                    return None
                if int(status[1]) >= 200:
                    return int(status[1])
        except OSError:
            return None


def sip_ping(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """True when something answers a SIP OPTIONS on ``host:port`` (any status will do)."""
    return sip_options(port, host=host, timeout=timeout) is not None


def janus_ping(port: int, timeout: float = 2.0) -> bool:
    """True when Janus answers an ``info`` request on its WebSocket API."""
    async def probe() -> bool:
        import aiohttp

        try:
            async with aiohttp.ClientSession() as http:
                async with http.ws_connect(f"ws://127.0.0.1:{port}", protocols=("janus-protocol",),
                                           timeout=aiohttp.ClientWSTimeout(ws_close=timeout)) as ws:
                    await ws.send_json({"janus": "info", "transaction": "probe"})
                    msg = await asyncio.wait_for(ws.receive_json(), timeout)
                    return msg.get("janus") == "server_info"
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(probe())
    # Called from inside an event loop (a caller that starts the stack from async code): probe
    # from a thread of its own instead.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, probe()).result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="telephony-stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sip-port", type=int, default=5060)
    parser.add_argument("--janus-ws-port", type=int, default=8188)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where the generated configs and logs go (default: a temporary folder)")
    args = parser.parse_args(argv)
    stack = TelephonyStack(StackPorts(sip=args.sip_port, janus_ws=args.janus_ws_port), run_dir=args.run_dir)
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start()
    except (StackError, subprocess.CalledProcessError) as exc:
        stack.stop()
        print(f"telephony-stack: {exc}", file=sys.stderr)
        return 1
    print(f"telephony stack up: registrar/proxy {stack.registrar}, Janus API {stack.janus_url}, "
          f"WebRTC leg over {stack.ice_address}\n"
          f"start the server with the gateway (lychee-rtc serve --config telephony), then call {stack.bot_uri}\n"
          f"configs and logs: {stack.run_dir}; Ctrl-C stops both", flush=True)
    try:
        while not stop:
            for name, proc in list(stack._procs.items()):
                if proc.poll() is not None:
                    print(f"telephony-stack: {name} exited ({proc.returncode}); see {stack.log_path(name)}",
                          file=sys.stderr)
                    stop = True
            time.sleep(0.5)
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
