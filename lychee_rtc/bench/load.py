"""``lychee-rtc bench load``: what a call costs the server, and how many calls a machine carries.

One run measures, for a profile (loopback by default):

* **Server CPU per call** at each step of N concurrent calls: CPU seconds of every server process
  (with ``--workers`` above 1: the cluster entry, its Ray daemons and the worker processes) over a
  steady span after warm-up, with audio flowing both ways, divided by N and by the span.
* **The load client's CPU** beside it. The calls come from separate client processes
  (``bench/load_client.py``: pre-encoded Opus up, nothing decoded while the calls run), at most
  ``--calls-per-client`` each, so the client is not what saturates.
* **Mouth-to-ear latency** p50/p90/p99 over every probe of the step (loopback), at the client's
  network edge; **gaps**: the server's window underruns, engine overload drops, playout underruns,
  skipped send slots and uplink gaps, and the packets the client never got, all counted over the span.
* **Largest N within budget** (p90 within ``--budget-ms``, every probe heard), for each number of
  server processes in ``--workers`` (1, 2, ... ``all``: one per core).
* **A plain aiortc relay** (``bench/aiortc_relay.py``: decode, re-encode, send) at ``--relay-sessions``,
  measured the same way in the same run, and the **codec floor**: Opus decode plus encode of one
  call's audio with nothing around it.
* With ``--stages N``: where the CPU goes at N calls, stage by stage (``bench/stages.py``, py-spy).

Latency percentiles and the largest N depend on the machine being otherwise quiet; CPU per call much
less so. The report records the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator

import aiohttp

from lychee_rtc.bench import stages as stage_profile
from lychee_rtc.bench.cpu import CpuSpan, codec_floor
from lychee_rtc.bench.load_report import LoadReport, LoadStep, Topology, format_report, format_step
from lychee_rtc.bench.probes import percentile
from lychee_rtc.bench.server_process import spawned_cluster, spawned_server

COUNTERS = ("window_underruns", "window_late_samples", "engine_windows_dropped", "playout_underrun_samples",
            "outbound_skipped_frames", "inbound_gaps")
READY_TIMEOUT_S = 180.0

# profile -> (configuration, environment, what the client says)
PROFILES: dict[str, tuple[str, dict[str, str], str]] = {
    "loopback": ("loopback", {}, "loopback"),
    "echo": ("echo", {}, "speech"),
    "echo-aec": ("echo", {"LYCHEE_RTC_AUDIO_PROCESSING__WEBRTC__ECHO_CANCELLATION": "true"}, "speech"),
    "echo-recording": ("echo", {"LYCHEE_RTC_RECORDING__ENABLED": "true"}, "speech"),
    "echo-aec-recording": ("echo", {"LYCHEE_RTC_AUDIO_PROCESSING__WEBRTC__ECHO_CANCELLATION": "true",
                                    "LYCHEE_RTC_RECORDING__ENABLED": "true"}, "speech"),
}


@dataclass
class Target:
    url: str
    pids: list[int]  # roots of the process trees whose CPU is the server's
    profiled_pid: int | None  # the one process a stage profile samples
    label: str


@dataclass
class StepPlan:
    mode: str
    lead_s: float
    span_s: float
    interval_s: float
    budget_ms: float
    calls_per_client: int
    wav: str | None
    token: str | None


async def _session_counters(url: str, token: str | None) -> dict[str, int]:
    totals = {k: 0 for k in COUNTERS}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/sessions", headers=headers) as resp:
            if resp.status != 200:
                return totals
            body = await resp.json()
    for s in body.get("sessions", []):
        for k in COUNTERS:
            totals[k] += int(s.get("counters", {}).get(k, 0))
    return totals


async def _line(proc: asyncio.subprocess.Process, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not raw:
        raise RuntimeError(f"load client {proc.pid} exited ({await proc.wait()})")
    return json.loads(raw)


async def _say(proc: asyncio.subprocess.Process, line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    await proc.stdin.drain()


async def run_step(target: Target, n: int, plan: StepPlan, profile_stages: bool = False
                   ) -> tuple[LoadStep, stage_profile.StageProfile | None]:
    count = math.ceil(n / max(1, plan.calls_per_client))
    sizes = [n // count + (1 if i < n % count else 0) for i in range(count)]  # calls per client process
    procs: list[asyncio.subprocess.Process] = []
    first = 0
    for i, size in enumerate(sizes):
        argv = [sys.executable, "-m", "lychee_rtc.bench.load_client", "--url", target.url, "--calls", str(size),
                "--mode", plan.mode, "--interval", str(plan.interval_s), "--lead", str(plan.lead_s),
                "--span", str(plan.span_s), "--first-index", str(first), "--total-calls", str(n), "--seed", str(i + 1)]
        if plan.wav:
            argv += ["--wav", plan.wav]
        if plan.token:
            argv += ["--token", plan.token]
        first += size
        procs.append(await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                          stdout=asyncio.subprocess.PIPE))
    profile = None
    try:
        ready = await asyncio.gather(*(_line(p, READY_TIMEOUT_S) for p in procs))
        failures = [f for r in ready for f in r["failed"]]
        await asyncio.gather(*(_say(p, "go") for p in procs))
        await asyncio.sleep(plan.lead_s)
        before = await _session_counters(target.url, plan.token)
        server, client = CpuSpan(target.pids), CpuSpan([p.pid for p in procs])
        server.start()
        client.start()
        sampling = None
        if profile_stages and target.profiled_pid is not None:
            sampling = asyncio.create_task(stage_profile.record(target.profiled_pid, plan.span_s - 0.5))
        await asyncio.sleep(plan.span_s)
        server.stop()
        client.stop()
        after = await _session_counters(target.url, plan.token)
        if sampling is not None:
            try:
                profile = await sampling
            except RuntimeError as exc:
                failures.append(f"stage profile: {exc}")
        await asyncio.gather(*(_line(p, plan.lead_s + plan.span_s + 60) for p in procs))  # played
        await asyncio.gather(*(_say(p, "bye") for p in procs))
        results = await asyncio.gather(*(_line(p, 120) for p in procs))
    finally:
        for p in procs:
            if p.returncode is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
            await p.wait()
    calls = [c for r in results for c in r["results"]]
    latencies = [x for c in calls for x in c["latencies_ms"]]
    found = [x for x in latencies if x is not None]
    p90 = percentile(found, 90)
    judged = bool(latencies)
    ok = (not failures and len(found) == len(latencies) and p90 is not None and p90 <= plan.budget_ms) if judged else None
    server_percent = server.percent if target.pids else None
    step = LoadStep(
        target=target.label, sessions=n, connected=len(calls), probes=len(latencies), found=len(found),
        p50_ms=percentile(found, 50), p90_ms=p90, p99_ms=percentile(found, 99),
        server_cpu_percent=server_percent, server_cpu_per_call=None if server_percent is None else server_percent / n,
        client_cpu_percent=client.percent, client_cpu_per_call=client.percent / n, client_processes=len(procs),
        counters={k: after[k] - before[k] for k in COUNTERS},
        lost_packets=sum(c["gaps"]["lost_packets"] for c in calls),
        skipped_ms=round(sum(c["gaps"]["skipped_ms"] for c in calls), 1),
        within_budget=ok, span_s=round(server.wall_s, 2), failures=failures)
    return step, profile


async def measure(target: Target, workers: int, steps: list[int], plan: StepPlan, stages_at: int | None = None,
                  stop_over_budget: bool = True) -> Topology:
    topology = Topology(workers, [], None)
    for n in steps:
        step, _ = await run_step(target, n, plan)
        topology.steps.append(step)
        print(format_step(step), flush=True)
        if step.within_budget is False and stop_over_budget:
            break
        await asyncio.sleep(1.0)  # let the server release the slots
    good = [s.sessions for s in topology.steps if s.within_budget]
    topology.largest_within_budget = max(good) if good else None
    if stages_at:
        # A step of its own: the sampler takes some CPU, which the steps above are measured without.
        step, profile = await run_step(target, stages_at, plan, profile_stages=True)
        print("stage profile " + format_step(step), flush=True)
        if profile is not None and step.server_cpu_per_call is not None:
            topology.stages = {k: round(v, 3) for k, v in profile.per_call(step.server_cpu_per_call).items()}
            topology.stages_at, topology.stage_samples = stages_at, profile.samples
    return topology


@asynccontextmanager
async def _server(config: str, env: dict[str, str], workers: int, capacity: int) -> AsyncIterator[Target]:
    if workers == 1:
        async with spawned_server(config, {**env, "LYCHEE_RTC_SESSION__MAX_SESSIONS": str(capacity)}) as (url, pid):
            yield Target(url, [pid], pid, "lychee-rtc, 1 process")
        return
    per_worker = math.ceil(capacity / workers)
    env = {**env, "LYCHEE_RTC_SESSION__MAX_SESSIONS": str(per_worker), "LYCHEE_RTC_CLUSTER__WORKERS": str(workers),
           "LYCHEE_RTC_CLUSTER__WORKER_CPUS": "0"}
    async with spawned_cluster(config, env, workers) as (url, pid):
        yield Target(url, [pid], None, f"lychee-rtc, {workers} worker processes (cluster entry)")


def _conditions() -> dict[str, Any]:
    import platform

    import aiortc

    return {"cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "python": platform.python_version(),
            "aiortc": aiortc.__version__, "machine": platform.machine()}


def _worker_counts(text: str) -> list[int]:
    cores = os.cpu_count() or 1
    out = []
    for part in text.split(","):
        n = cores if part.strip() == "all" else int(part)
        if n not in out:
            out.append(n)
    return out


async def run_bench(args: argparse.Namespace) -> LoadReport:
    config, env, mode = PROFILES[args.profile]
    config = args.config or config
    steps = [int(x) for x in args.sessions.split(",")]
    wav = args.wav
    with tempfile.TemporaryDirectory() as scratch:
        env = {**env, "LYCHEE_RTC_RECORDING__DIRECTORY": os.path.join(scratch, "recordings")}
        if mode == "speech" and wav is None:
            from lychee_rtc.bench.telephony import DEFAULT_TEXT, RATE, speech
            from lychee_rtc.pcm import write_wav

            wav = str(write_wav(os.path.join(scratch, "utterance.wav"), speech(DEFAULT_TEXT, RATE), RATE))
        plan = StepPlan(mode, args.warmup, args.span, args.interval, args.budget_ms, args.calls_per_client, wav,
                        args.server_key)
        conditions = _conditions()
        floor = None if args.no_floor else codec_floor()
        topologies: list[Topology] = []
        if args.url:
            target = Target(args.url, [args.server_pid] if args.server_pid else [], args.server_pid, "given server")
            topologies.append(await measure(target, 1, steps, plan, args.stages, stop_over_budget=not args.all_steps))
        else:
            for workers in _worker_counts(args.workers):
                async with _server(config, env, workers, max(steps + [args.stages or 0])) as target:
                    topologies.append(await measure(target, workers, steps, plan, args.stages if workers == 1 else None,
                                                    stop_over_budget=not args.all_steps))
        relay: list[LoadStep] = []
        if args.relay_sessions:
            from lychee_rtc.bench.aiortc_relay import spawned_relay

            relay_steps = [int(x) for x in args.relay_sessions.split(",")]
            async with spawned_relay(max(relay_steps)) as (url, pid):
                target = Target(url, [pid], pid, "aiortc relay")
                relay = (await measure(target, 1, relay_steps, plan, stop_over_budget=False)).steps
        conditions["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    command = "lychee-rtc " + shlex.join(sys.argv[1:]) if "bench" in sys.argv[1:] else ""
    return LoadReport(args.profile, command, conditions, floor, topologies, relay, args.budget_ms)


async def _main(args: argparse.Namespace) -> int:
    report = await run_bench(args)
    text = format_report(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("load", help="server CPU per call, client CPU, the aiortc relay, latency, the largest N within budget",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES), default="loopback",
                   help="what the server runs and the clients say (default: loopback)")
    p.add_argument("--config", help="profile file for the spawned server instead of the profile's own")
    p.add_argument("--url", help="a running server (default: start one per --workers)")
    p.add_argument("--server-pid", type=int, help="with --url: the server's process, for its CPU")
    p.add_argument("--server-key", help="the server key (server.auth_token), if the server wants one")
    p.add_argument("--sessions", default="1,2,4,8,12,16,24,32", help="comma-separated steps of N")
    p.add_argument("--workers", default="1", help="server processes to measure, comma-separated; 'all': one "
                                                  "per core (above 1: the cluster entry, needs [cluster])")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds from the calls' start to the measured span")
    p.add_argument("--span", type=float, default=10.0, help="seconds measured per step")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between probes per call")
    p.add_argument("--budget-ms", type=float, default=100.0,
                   help="p90 mouth-to-ear budget at the client's network edge (default 100)")
    p.add_argument("--calls-per-client", type=int, default=12, help="calls per load client process")
    p.add_argument("--relay-sessions", default="4,8", help="steps of N for the aiortc relay ('' to skip)")
    p.add_argument("--all-steps", action="store_true", help="run every step, also after one over budget")
    p.add_argument("--stages", type=int, help="after the steps, one more at this N with a profile of where the "
                                              "CPU goes (one server process; needs py-spy: the [bench] extra)")
    p.add_argument("--wav", help="speech profiles: what the callers say (default: espeak-ng speech)")
    p.add_argument("--no-floor", action="store_true", help="skip the codec floor measurement")
    p.add_argument("--json", help="also write the report as JSON here")
    p.add_argument("--markdown", help="also write the report's tables here")
    p.set_defaults(func=_main)
