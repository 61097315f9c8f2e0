"""A two-node Ray cluster on one machine, for the cluster tests.

Where the test may create network namespaces (root, iproute2), each Ray node lives in a namespace of
its own with its own address on a bridge, so a worker's ICE candidates and its media are that
node's address and nothing else: the test can assert where each call's media flows. Elsewhere both
nodes share the machine's addresses (Ray's cluster utilities); the tests then check the candidates
against the worker's advertised node address only, a weaker run that test_cluster.py warns about
and refuses under CI.

Every process started here is started in a session of its own and ended by its process group id.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER_RESOURCE = "lychee_rtc_worker"
RAY_PORT = 6379
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # signaling moves a few kB; Ray's smallest useful store
# Ray's token authentication, with a token of this run given to every process (no file in $HOME).
AUTH_TOKEN = "".join(random.choice("0123456789abcdef") for _ in range(64))


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, timeout=30)


def ray_env() -> dict[str, str]:
    """What every process of the test cluster (nodes, entry) needs in its environment."""
    return {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": AUTH_TOKEN}


def _env() -> dict[str, str]:
    env = dict(os.environ, **ray_env())
    # The workers import this checkout's lychee_rtc, whatever is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _free_subnet() -> str:
    """A 10.x.y.0/24 that no interface or route of this machine uses."""
    taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    taken += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for _ in range(200):
        subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if f"{subnet}." not in taken:
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet")


@dataclass
class Namespaces:
    """Two namespaces on a bridge in the root namespace (where the test's clients run)."""

    tag: str
    subnet: str
    names: list[str] = field(default_factory=list)
    bridge: str = ""

    @property
    def addresses(self) -> list[str]:
        return [f"{self.subnet}.{i + 2}" for i in range(len(self.names))]

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    @classmethod
    def create(cls, count: int = 2) -> "Namespaces":
        tag = f"{random.randint(0, 0xFFFF):04x}"
        net = cls(tag=tag, subnet=_free_subnet())
        net.bridge = f"lrb{tag}"
        try:
            _run("ip", "link", "add", net.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{net.gateway}/24", "dev", net.bridge)
            _run("ip", "link", "set", net.bridge, "up")
            for i in range(count):
                ns, host_if, ns_if = f"lrt{tag}n{i}", net.host_link(i), f"lrp{tag}{i}"
                _run("ip", "netns", "add", ns)
                net.names.append(ns)
                _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
                _run("ip", "link", "set", host_if, "master", net.bridge, "up")
                _run("ip", "link", "set", ns_if, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{net.subnet}.{i + 2}/24", "dev", ns_if)
                _run("ip", "-n", ns, "link", "set", ns_if, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            net.delete()
            raise
        return net

    def exec_prefix(self, index: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[index]]

    def host_link(self, index: int) -> str:
        return f"lrh{self.tag}{index}"

    def kill_processes(self, index: int | None = None) -> None:
        """Whatever still runs inside our namespaces (Ray's daemons, workers) is ours to end."""
        for ns in self.names if index is None else [self.names[index]]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def delete(self) -> None:
        self.kill_processes()
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for i in range(len(self.names)):
            subprocess.run(["ip", "link", "del", self.host_link(i)], capture_output=True)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def namespaces_possible() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    if os.geteuid() != 0:
        return "not root"
    try:
        net = Namespaces.create(count=1)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError) as exc:
        detail = exc.stderr.decode(errors="replace").strip() if getattr(exc, "stderr", None) else str(exc)
        return f"cannot create a network namespace: {detail}"
    net.delete()
    return None


def _wait_port(host: str, port: int, deadline: float, process: subprocess.Popen, log: Path) -> None:
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited: {log.read_text()[-3000:]}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {host}:{port}: {log.read_text()[-3000:]}") from None
            time.sleep(0.2)


@dataclass
class RayCluster:
    """Two Ray nodes, each offering one worker slot; ``address`` is the head's GCS."""

    workdir: Path
    namespaces: Namespaces | None
    address: str = ""
    node_ips: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def start(cls, workdir: Path, use_namespaces: bool) -> "RayCluster":
        cluster = cls(workdir=workdir, namespaces=Namespaces.create() if use_namespaces else None)
        try:
            if cluster.namespaces is not None:
                cluster._start_in_namespaces()
            else:
                cluster._start_shared()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _node_args(self) -> list[str]:
        return ["--num-cpus", "1", "--resources", json.dumps({WORKER_RESOURCE: 1}),
                "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats", "--block"]

    @property
    def temp_dir(self) -> str:
        """Ray's temp dir on the namespaced nodes; short, because Ray's unix socket paths live under it."""
        return f"/tmp/lrt-{self.namespaces.tag}"

    def _start_in_namespaces(self) -> None:
        net = self.namespaces
        self.address = f"{net.addresses[0]}:{RAY_PORT}"
        self.workdir.joinpath("ray-temp").write_text(self.temp_dir)
        for index, ip in enumerate(net.addresses):
            self.node_ips.append(ip)
            self._start_node(index)

    def _start_node(self, index: int) -> None:
        net = self.namespaces
        ray = str(Path(sys.executable).with_name("ray"))
        ip = net.addresses[index]
        role = ["--head", "--port", str(RAY_PORT), "--include-dashboard=false", "--temp-dir", self.temp_dir] \
            if index == 0 else ["--address", self.address]
        log = self.workdir / f"ray-node{index}.log"
        process = subprocess.Popen([*net.exec_prefix(index), ray, "start", *role, "--node-ip-address", ip,
                                    *self._node_args()], stdout=log.open("a"), stderr=subprocess.STDOUT,
                                   env=_env(), start_new_session=True)
        self.processes.append(process)
        if index == 0:
            _wait_port(ip, RAY_PORT, time.monotonic() + 120, process, log)

    def lose_node(self, index: int) -> None:
        """The node drops off the network and everything on it dies, as when its machine fails:
        nothing it had open is closed in an orderly way (no FIN, no RST reaches anyone)."""
        net = self.namespaces
        _run("ip", "link", "set", net.host_link(index), "down")
        net.kill_processes(index)

    def rejoin_node(self, index: int) -> None:
        """The node is back on the network and its Ray node starts again (a repaired machine)."""
        _run("ip", "link", "set", self.namespaces.host_link(index), "up")
        self._start_node(index)

    def _start_shared(self) -> None:
        # Ray's cluster utilities, in a process of their own: Ray reads its settings (the token
        # authentication above) when it is imported, so they must be in place before that.
        log = self.workdir / "ray-nodes.log"
        address_file = self.workdir / "ray-address"
        process = subprocess.Popen([sys.executable, __file__, str(address_file)], stdout=log.open("w"),
                                   stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        self.processes.append(process)
        deadline = time.monotonic() + 180
        while not address_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray nodes did not start: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.address = address_file.read_text().strip()
        ip = self.address.split(":")[0]
        self.node_ips = [ip, ip]

    def exec_prefix(self) -> list[str]:
        """How to run a process on the head node (the entry joins the cluster from there)."""
        return self.namespaces.exec_prefix(0) if self.namespaces is not None else []

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop_process_group(process)
        if self.namespaces is not None:
            self.namespaces.delete()
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def stop_process_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGINT to the group we started, then SIGKILL to what is left of it."""
    try:
        os.killpg(process.pid, signal.SIGINT)
    except ProcessLookupError:
        return
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(10)


def _serve_shared_nodes(address_file: Path) -> None:
    """Two Ray nodes on this machine's addresses until interrupted; writes the head's address."""
    from ray.cluster_utils import Cluster

    args = {"num_cpus": 1, "resources": {WORKER_RESOURCE: 1}, "object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={**args, "include_dashboard": False})
    cluster.add_node(**args)
    cluster.wait_for_nodes()
    address_file.with_suffix(".tmp").write_text(cluster.address)
    address_file.with_suffix(".tmp").rename(address_file)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    _serve_shared_nodes(Path(sys.argv[1]))
