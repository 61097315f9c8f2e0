"""What ``lychee-rtc bench load`` reports: its values, one line per step as it finishes, markdown at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lychee_rtc.bench.cpu import CodecFloor


@dataclass
class LoadStep:
    target: str  # "lychee-rtc" with its process count, or "aiortc relay"
    sessions: int
    connected: int
    probes: int
    found: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    server_cpu_percent: float | None
    server_cpu_per_call: float | None
    client_cpu_percent: float
    client_cpu_per_call: float | None
    client_processes: int
    counters: dict[str, int]
    lost_packets: int
    skipped_ms: float
    within_budget: bool | None  # None: nothing to judge it by (no probes)
    span_s: float
    failures: list[str] = field(default_factory=list)


@dataclass
class Topology:
    workers: int
    steps: list[LoadStep]
    largest_within_budget: int | None
    stages: dict[str, float] | None = None  # stage -> % of a core per call
    stages_at: int | None = None
    stage_samples: int | None = None


@dataclass
class LoadReport:
    profile: str
    command: str
    conditions: dict[str, Any]
    floor: CodecFloor | None
    topologies: list[Topology]
    relay: list[LoadStep]
    budget_ms: float




def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_step(s: LoadStep) -> str:
    verdict = {True: "ok", False: "OVER BUDGET", None: ""}[s.within_budget]
    c = s.counters
    return (f"{s.target}: N={s.sessions:<3} server {_f(s.server_cpu_percent)}% ({_f(s.server_cpu_per_call, 2)}%/call) "
            f"client {_f(s.client_cpu_percent)}% ({_f(s.client_cpu_per_call, 2)}%/call, {s.client_processes} proc) "
            f"probes {s.found}/{s.probes} p50 {_f(s.p50_ms)} p90 {_f(s.p90_ms)} p99 {_f(s.p99_ms)} ms "
            f"underruns {c['window_underruns']} overload {c['engine_windows_dropped']} "
            f"playout-underrun {c['playout_underrun_samples']} skipped {c['outbound_skipped_frames']} "
            f"uplink-gaps {c['inbound_gaps']} lost {s.lost_packets} {verdict}"
            + (f" failures: {s.failures[:2]}" if s.failures else ""))


def _steps_table(steps: list[LoadStep]) -> list[str]:
    lines = ["| N | server CPU (total / per call) | client CPU (total / per call) | probes heard | "
             "p50 / p90 / p99 (ms) | window underruns | overload drops | playout underrun samples | "
             "skipped send slots | uplink gaps | packets lost | within budget |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        c = s.counters
        lines.append(
            f"| {s.sessions} | {_f(s.server_cpu_percent)} % / **{_f(s.server_cpu_per_call, 2)} %** | "
            f"{_f(s.client_cpu_percent)} % / {_f(s.client_cpu_per_call, 2)} % | {s.found}/{s.probes} | "
            f"{_f(s.p50_ms)} / {_f(s.p90_ms)} / {_f(s.p99_ms)} | {c['window_underruns']} | "
            f"{c['engine_windows_dropped']} | {c['playout_underrun_samples']} | {c['outbound_skipped_frames']} | "
            f"{c['inbound_gaps']} | {s.lost_packets} | {'-' if s.within_budget is None else 'yes' if s.within_budget else 'no'} |")
    return lines


def format_report(r: LoadReport) -> str:
    c = r.conditions
    out = [f"## bench load: profile {r.profile}", "",
           f"Machine: {c['cores']} cores ({c['machine']}), Python {c['python']}, aiortc {c['aiortc']}; "
           f"{c['time_utc']} UTC; load average before {c['load_average']}, after {c.get('load_average_after')}.",
           f"Budget: p90 mouth-to-ear <= {r.budget_ms:.0f} ms at the client's network edge, every probe heard."]
    if r.command:
        out += ["", f"`{r.command}`"]
    if r.floor is not None:
        out += ["", f"Codec floor per call (Opus decode + encode, 48 kHz mono, 20 ms): libopus "
                    f"{r.floor.libopus_percent:.2f} % of a core; aiortc's codecs through PyAV "
                    f"{r.floor.aiortc_percent:.2f} %."]
    for t in r.topologies:
        label = t.steps[0].target if t.steps else f"{t.workers} process(es)"
        out += ["", f"### {label}", ""] + _steps_table(t.steps)
        out += ["", f"Largest N within budget: **{t.largest_within_budget if t.largest_within_budget else 'none'}**"
                    + ("" if any(s.within_budget is not None for s in t.steps) else " (no probes in this profile)")]
        if t.stages:
            out += ["", f"Where the CPU goes at N = {t.stages_at} ({t.stage_samples} samples), % of a core per call:",
                    "", "| stage | per call |", "|---|---|"]
            out += [f"| {stage} | {value:.2f} % |" for stage, value in t.stages.items()]
            out.append(f"| **all** | **{sum(t.stages.values()):.2f} %** |")
    if r.relay:
        out += ["", "### plain aiortc relay (same client, same run)", ""] + _steps_table(r.relay)
        ours = {s.sessions: s.server_cpu_per_call for t in r.topologies[:1] for s in t.steps}
        ratios = [f"N = {s.sessions}: {ours[s.sessions] / s.server_cpu_per_call:.2f}"
                  for s in r.relay if ours.get(s.sessions) and s.server_cpu_per_call]
        if ratios:
            out += ["", "lychee-rtc's server CPU per call over the relay's: " + ", ".join(ratios)]
    return "\n".join(out)
