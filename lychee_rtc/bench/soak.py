"""``lychee-rtc bench soak``: calls that come and go for minutes, with the server's memory sampled.

N callers (aiortc peers in this process) each place one call after another against a server (by
default a spawned echo server). A call connects, says an utterance (espeak-ng speech, or a WAV
file) and waits for the echo; some callers cancel the answer with ``response.cancel`` or talk over
it; most hang up with ``session.close``, and some vanish mid-answer: their sockets go quiet with
nothing said, so the server has to notice the loss, hold the session for a resume that never comes,
and free it. The mix follows a fixed rotation (``PLANS``), so two runs place the same calls.

Every ``--sample-every`` seconds the server process is sampled (resident memory, threads and open
file descriptors from /proc; active sessions from /metrics, listed sessions from /v1/sessions, free
slots from /readyz). When the time is up, the callers finish their calls, the bench waits until the
server holds no session, and samples once more. The report gives the tallies, the samples, and
start / end / max / slope per series; the slope is a linear fit over the second half of the calling
phase, after the allocator and the codec caches have warmed up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

DEFAULT_TEXT = "Hello there. I am calling to check that the line stays clear for the whole afternoon."
INTERJECTION = "Wait, stop, I have a question."
SILENCE_S = 0.5
WAIT_S = 60.0  # the most any one step of a call may take before the call counts as an error
MAX_ERROR_KINDS = 20


@dataclass(frozen=True)
class CallPlan:
    interrupt: str  # "none" | "cancel" (response.cancel) | "barge" (talk over the answer)
    end: str  # "close" (session.close) | "vanish" (the sockets go quiet mid-answer)


# One caller walks this rotation from its own starting point; over eight calls: three plain calls,
# two cancelled, two barged into, one vanished. Callers start spread over it, so the first two
# calls of two callers already cover every kind.
PLANS: tuple[CallPlan, ...] = (
    CallPlan("none", "close"), CallPlan("cancel", "close"), CallPlan("barge", "close"), CallPlan("none", "close"),
    CallPlan("barge", "close"), CallPlan("none", "vanish"), CallPlan("cancel", "close"), CallPlan("none", "close"),
)


@dataclass
class CallTally:
    """How the calls went. Each placed call ends as exactly one of completed / vanished / refused / errors."""

    placed: int = 0
    completed: int = 0  # hung up with session.close and saw session.closed
    vanished: int = 0  # went quiet mid-answer on purpose
    refused: int = 0  # 503: the server was full (vanished calls hold their slot for the resume window)
    errors: int = 0
    cancelled: int = 0  # answers cut by response.cancel (status cancelled)
    barged: int = 0  # answers cut by talking over them (status cancelled)
    responses: int = 0  # response.done events seen
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        kind = f"{type(exc).__name__}: {str(exc)[:160]}"
        if kind in self.error_kinds or len(self.error_kinds) < MAX_ERROR_KINDS:
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


@dataclass
class Sample:
    t_s: float
    phase: str  # "calls" while callers are calling, "drained" once the server holds no session
    rss_mb: float | None
    threads: int | None
    fds: int | None
    active: int | None  # lychee_rtc_active_sessions (sessions holding an engine slot)
    listed: int | None  # sessions in /v1/sessions (suspended ones included)
    free: int | None  # free slots, /readyz
    load1: float | None = None  # the machine's 1-minute load average: what else was running


@dataclass
class Trend:
    start: float | None
    end: float | None
    max: float | None
    slope_per_hour: float | None  # fit over the second half of the calling phase


@dataclass
class SoakReport:
    command: str
    url: str
    server_pid: int | None
    calls: int
    minutes: float
    calling_s: float
    drain_s: float | None  # from the last call's end to no session held; None: not within the deadline
    tally: CallTally
    rss_mb: Trend
    threads: Trend
    fds: Trend
    sessions_created: float | None
    closed_by_reason: dict[str, float]
    samples: list[Sample]

    @property
    def drained(self) -> bool:
        return self.drain_s is not None


# --- one call ---------------------------------------------------------------------------------------


def _vanish(client) -> None:
    """Close the peer's UDP sockets: no DTLS close, no session.close, the server hears nothing more."""
    from lychee_rtc.rtc.consent import ice_connections

    for connection in ice_connections(client.pc):
        for protocol in connection._protocols:
            if protocol.transport is not None:
                protocol.transport.close()


async def place_call(url: str, plan: CallPlan, utterance: np.ndarray, interjection: np.ndarray,
                     tally: CallTally, server_key: str | None) -> float | None:
    """One call from connect to hang-up; returns the Retry-After to honour when the server was full."""
    from lychee_rtc.bench.client import RATE, RtcClient

    client = RtcClient(url, auth_token=server_key)
    tally.placed += 1
    try:
        try:
            await asyncio.wait_for(client.connect(), WAIT_S)
        except RuntimeError as exc:
            if "503" in str(exc):
                tally.refused += 1
                return 1.0
            raise
        client.mic.feed(np.zeros(int(SILENCE_S * RATE), np.float32))
        client.mic.feed(utterance)
        started = await client.wait_event("output_audio_buffer.started", WAIT_S)
        answer = started["response_id"]
        if plan.interrupt != "none" or plan.end == "vanish":
            await client.wait_audio(started["sample_offset"] + RATE // 2, WAIT_S)  # half a second played
        if plan.end == "vanish":
            _vanish(client)
            tally.vanished += 1
            return None
        if plan.interrupt == "cancel":
            client.send({"type": "response.cancel"})
        elif plan.interrupt == "barge":
            client.mic.feed(interjection)
        done = await client.wait_event("response.done", WAIT_S, response_id=answer)
        tally.responses += 1
        cut = done["response"]["status"] == "cancelled"
        tally.cancelled += int(cut and plan.interrupt == "cancel")
        tally.barged += int(cut and plan.interrupt == "barge")
        if plan.interrupt == "barge":
            # The interjection is an utterance too: its echo comes next.
            after = client.events.index(done) + 1
            await client.wait_event("response.done", WAIT_S, after=after)
            tally.responses += 1
        client.send({"type": "session.close"})
        await client.wait_event("session.closed", WAIT_S)
        tally.completed += 1
        return None
    except Exception as exc:  # noqa: BLE001 - a soak counts what went wrong and carries on
        tally.error(exc)
        return 1.0
    finally:
        await asyncio.gather(client.close(), return_exceptions=True)


async def caller(index: int, callers: int, url: str, stop_at: float, rounds: int | None,
                 utterance: np.ndarray, interjection: np.ndarray, tally: CallTally,
                 server_key: str | None, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    first = index * len(PLANS) // callers
    made = 0
    while loop.time() < stop_at and not stop.is_set() and (rounds is None or made < rounds):
        plan = PLANS[(first + made) % len(PLANS)]
        made += 1
        pause = await place_call(url, plan, utterance, interjection, tally, server_key)
        if pause:
            await asyncio.sleep(pause)


# --- sampling ---------------------------------------------------------------------------------------


def process_stats(pid: int) -> tuple[float, int, int] | None:
    """(RSS MB, threads, open fds) of a process from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    rss_kb = int(status["VmRSS"].split()[0])
    return round(rss_kb / 1024.0, 1), int(status["Threads"]), fds


def load_average() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


class ServerProbe:
    """Reads the server's process and HTTP views."""

    def __init__(self, http, url: str, pid: int | None, server_key: str | None) -> None:
        self.http, self.url, self.pid = http, url, pid
        self.headers = {"Authorization": f"Bearer {server_key}"} if server_key else {}

    async def _json(self, path: str) -> dict[str, Any] | None:
        try:
            async with self.http.get(self.url + path, headers=self.headers) as resp:
                return await resp.json() if resp.content_type == "application/json" else None
        except Exception:  # noqa: BLE001 - a sample with a hole beats a soak that stops
            return None

    async def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        try:
            async with self.http.get(self.url + "/metrics") as resp:
                return parse_metrics(await resp.text()) if resp.status == 200 else {}
        except Exception:  # noqa: BLE001
            return {}

    async def sample(self, t_s: float, phase: str) -> Sample:
        stats = process_stats(self.pid) if self.pid is not None else None
        rss, threads, fds = stats if stats is not None else (None, None, None)
        metrics = await self.metrics()
        active = metrics.get("lychee_rtc_active_sessions")
        listed = await self._json("/v1/sessions")
        ready = await self._json("/readyz")
        return Sample(round(t_s, 1), phase, rss, threads, fds,
                      int(active[0][1]) if active else None,
                      len(listed["sessions"]) if listed and "sessions" in listed else None,
                      ready.get("free") if ready else None, load_average())

    def alive(self) -> bool:
        return self.pid is None or os.path.exists(f"/proc/{self.pid}")


def trend(samples: list[Sample], key: str, calling_s: float) -> Trend:
    values = [(s.t_s, getattr(s, key)) for s in samples if getattr(s, key) is not None]
    if not values:
        return Trend(None, None, None, None)
    late = [(t, v) for t, v in values if t >= calling_s / 2 and t <= calling_s + 1e-6]
    slope = None
    if len(late) >= 3 and late[-1][0] > late[0][0]:
        t, v = np.array(late, dtype=np.float64).T
        slope = round(float(np.polyfit(t, v, 1)[0]) * 3600.0, 2)
    return Trend(values[0][1], values[-1][1], max(v for _, v in values), slope)


# --- the run ----------------------------------------------------------------------------------------


async def soak(url: str, pid: int | None, *, calls: int, minutes: float, sample_every_s: float,
               drain_timeout_s: float, utterance: np.ndarray, interjection: np.ndarray,
               server_key: str | None = None, rounds: int | None = None, command: str = "",
               progress: bool = True) -> SoakReport:
    import aiohttp

    loop = asyncio.get_running_loop()
    tally = CallTally()
    samples: list[Sample] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        probe = ServerProbe(http, url.rstrip("/"), pid, server_key)
        t0 = loop.time()
        stop_at = t0 + minutes * 60.0

        def record(sample: Sample) -> None:
            samples.append(sample)
            if progress:
                print(format_sample(sample, tally), flush=True)

        record(await probe.sample(0.0, "calls"))
        callers = [asyncio.create_task(caller(i, calls, url, stop_at, rounds, utterance, interjection, tally,
                                              server_key, stop)) for i in range(calls)]
        everyone = asyncio.gather(*callers)
        while not everyone.done():
            next_at = t0 + sample_every_s * len(samples)
            await asyncio.wait([everyone], timeout=max(0.0, next_at - loop.time()))
            if everyone.done():
                break
            record(await probe.sample(loop.time() - t0, "calls"))
            if not probe.alive():
                stop.set()
        await everyone
        calling_s = loop.time() - t0
        record(await probe.sample(calling_s, "calls"))  # the calling phase's last point

        drain_s = None
        drain_deadline = loop.time() + drain_timeout_s
        while loop.time() < drain_deadline and probe.alive():
            s = await probe.sample(loop.time() - t0, "draining")
            known = [n for n in (s.active, s.listed) if n is not None]
            if known and not any(known):
                drain_s = round(loop.time() - t0 - calling_s, 1)
                break
            await asyncio.sleep(1.0)
        record(await probe.sample(loop.time() - t0, "drained" if drain_s is not None else "undrained"))
        metrics = await probe.metrics()

    created = metrics.get("lychee_rtc_sessions_total")
    closed = {labels.get("reason", "?"): value for labels, value in metrics.get("lychee_rtc_sessions_closed_total", [])}
    return SoakReport(command, url, pid, calls, minutes, round(calling_s, 1), drain_s, tally,
                      trend(samples, "rss_mb", calling_s), trend(samples, "threads", calling_s),
                      trend(samples, "fds", calling_s), created[0][1] if created else None, closed, samples)


# --- output -----------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    return "-" if v is None else str(v)


def format_sample(s: Sample, tally: CallTally) -> str:
    return (f"t={s.t_s:7.1f}s {s.phase:<9} rss {_fmt(s.rss_mb):>7} MB threads {_fmt(s.threads):>3} "
            f"fds {_fmt(s.fds):>4} active {_fmt(s.active)} listed {_fmt(s.listed)} free {_fmt(s.free)} "
            f"load {_fmt(s.load1)} | "
            f"placed {tally.placed} completed {tally.completed} vanished {tally.vanished} "
            f"refused {tally.refused} errors {tally.errors}")


def format_markdown(r: SoakReport) -> str:
    t = r.tally
    lines = [
        f"# Soak: {r.calls} concurrent callers for {r.minutes:g} min",
        "",
        *([f"`{r.command}`", ""] if r.command else []),
        f"Server {r.url} (pid {_fmt(r.server_pid)}); calling phase {r.calling_s:.0f} s; "
        + (f"no session left {r.drain_s:.0f} s after the last call ended." if r.drained
           else "**the server still held sessions at the drain deadline.**"),
        "",
        "| placed | completed | vanished | refused (full) | errors | cancelled | barged | responses |",
        "|---|---|---|---|---|---|---|---|",
        f"| {t.placed} | {t.completed} | {t.vanished} | {t.refused} | {t.errors} | {t.cancelled} | {t.barged} "
        f"| {t.responses} |",
        "",
    ]
    if t.error_kinds:
        lines += ["Errors:", ""] + [f"* {n} × {k}" for k, n in t.error_kinds.items()] + [""]
    lines += [
        f"Server: {'-' if r.sessions_created is None else f'{r.sessions_created:g}'} sessions created; closed by reason: "
        + (", ".join(f"{k} {v:g}" for k, v in sorted(r.closed_by_reason.items())) or "-"),
        "",
        "| series | start | end (drained) | max | slope per hour (2nd half of the calls) |",
        "|---|---|---|---|---|",
    ]
    for name, tr in (("RSS MB", r.rss_mb), ("threads", r.threads), ("open fds", r.fds)):
        lines.append(f"| {name} | {_fmt(tr.start)} | {_fmt(tr.end)} | {_fmt(tr.max)} | {_fmt(tr.slope_per_hour)} |")
    lines += ["", "| t (s) | phase | RSS MB | threads | fds | active | listed | free | load (1 min) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in r.samples:
        lines.append(f"| {s.t_s:.0f} | {s.phase} | {_fmt(s.rss_mb)} | {_fmt(s.threads)} | {_fmt(s.fds)} "
                     f"| {_fmt(s.active)} | {_fmt(s.listed)} | {_fmt(s.free)} | {_fmt(s.load1)} |")
    return "\n".join(lines) + "\n"


def report_json(r: SoakReport) -> dict[str, Any]:
    return {**asdict(r), "drained": r.drained}


def write_report(r: SoakReport, out: str) -> tuple[str, str]:
    stem = out[:-5] if out.endswith(".json") else out[:-3] if out.endswith(".md") else out
    if os.path.dirname(stem):
        os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(report_json(r), f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(format_markdown(r))
    return stem + ".json", stem + ".md"


async def _main(args: argparse.Namespace) -> int:
    from lychee_rtc.bench.client import RATE
    from lychee_rtc.bench.server_process import spawned_server
    from lychee_rtc.bench.telephony import read_wav, speech

    utterance = read_wav(args.wav, RATE) if args.wav else speech(args.text, RATE)
    interjection = read_wav(args.interjection_wav, RATE) if args.interjection_wav else speech(INTERJECTION, RATE)
    command = "lychee-rtc " + shlex.join(sys.argv[1:]) if "bench" in sys.argv[1:] else ""
    options = dict(calls=args.calls, minutes=args.minutes, sample_every_s=args.sample_every,
                   drain_timeout_s=args.drain_timeout, utterance=utterance, interjection=interjection,
                   server_key=args.server_key, rounds=args.rounds, command=command)
    if args.url:
        report = await soak(args.url, args.pid, **options)
    else:
        # Vanished calls keep their slot for media_timeout_s + resume_window_s; leave room for them.
        env = {"LYCHEE_RTC_SESSION__MAX_SESSIONS": str(args.max_sessions or 3 * args.calls)}
        async with spawned_server(args.config, env) as (url, pid):
            report = await soak(url, pid, **options)
    text = format_markdown(report)
    print(text)
    if args.out:
        for path in write_report(report, args.out):
            print(f"wrote {path}")
    clean = report.drained and report.tally.errors == 0
    return 0 if clean else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="calls that come and go for minutes; server memory, threads, fds over time",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one with --config)")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, to sample its memory")
    p.add_argument("--server-key", help="the server key (server.auth_token), if the server wants one")
    p.add_argument("--config", default="echo", help="profile for the spawned server (default: echo)")
    p.add_argument("--max-sessions", type=int, help="session.max_sessions of the spawned server (default: 3 × calls)")
    p.add_argument("--calls", type=int, default=4, help="concurrent callers (default: 4)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the callers keep calling (default: 10)")
    p.add_argument("--rounds", type=int, help="also stop each caller after this many calls")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples (default: 10)")
    p.add_argument("--drain-timeout", type=float, default=180.0,
                   help="seconds to wait, after the calls, for the server to hold no session (default: 180)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="what the callers say (espeak-ng)")
    p.add_argument("--wav", help="a recorded utterance (16-bit PCM WAV, any rate) instead of synthesised speech")
    p.add_argument("--interjection-wav", help="a recorded barge-in (16-bit PCM WAV) instead of synthesised speech")
    p.add_argument("--out", help="write the report here as STEM.json and STEM.md")
    p.set_defaults(func=_main)
