// The latency tester's numbers: percentiles, the summary, the per-probe getStats context and the
// exports. Pure functions of plain objects (no DOM), so the page and the bench read the same JSON.

/** Linear-interpolated percentile (the same method as numpy's default), or null for no values. */
export function percentile(values, q) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  const pos = ((sorted.length - 1) * q) / 100;
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

const round = (x, digits = 2) => (x === null || x === undefined || !Number.isFinite(x) ? null : Number(x.toFixed(digits)));

/** p50/p90/p99/max/min/mean over the probes that were heard; lost = sent but never heard. */
export function summarize(probes) {
  const heard = probes.filter((p) => p.latency_ms !== null).map((p) => p.latency_ms);
  const mean = heard.length ? heard.reduce((a, b) => a + b, 0) / heard.length : null;
  return {
    sent: probes.length,
    heard: heard.length,
    lost: probes.length - heard.length,
    p50_ms: round(percentile(heard, 50)),
    p90_ms: round(percentile(heard, 90)),
    p99_ms: round(percentile(heard, 99)),
    max_ms: round(heard.length ? Math.max(...heard) : null),
    min_ms: round(heard.length ? Math.min(...heard) : null),
    mean_ms: round(mean),
  };
}

function audioStats(report, type) {
  for (const s of report.values()) if (s.type === type && (s.kind ?? s.mediaType) === "audio") return s;
  return null;
}

/**
 * The receive side's state when a probe was heard, from one getStats() report and the previous
 * one: jitter-buffer delay and target over the interval between the two (cumulative averages would
 * hide a change), the loss and concealment counters as totals. `pairRttMs` is the ICE round trip.
 */
export function probeContext(report, previous, pairRttMs) {
  const inbound = audioStats(report, "inbound-rtp");
  const remoteInbound = audioStats(report, "remote-inbound-rtp");
  const ctx = {
    rtt_ms: round(pairRttMs ?? (remoteInbound?.roundTripTime !== undefined ? remoteInbound.roundTripTime * 1000 : null), 1),
    jitter_buffer_ms: null,
    jitter_buffer_target_ms: null,
    jitter_buffer_minimum_ms: null,
    packets_received: inbound?.packetsReceived ?? null,
    packets_lost: inbound?.packetsLost ?? null,
    concealed_samples: inbound?.concealedSamples ?? null,
    // Audio the jitter buffer stretched in or cut out to move its depth (time-stretching).
    inserted_samples: inbound?.insertedSamplesForDeceleration ?? null,
    removed_samples: inbound?.removedSamplesForAcceleration ?? null,
    network_jitter_ms: inbound?.jitter !== undefined ? round(inbound.jitter * 1000, 1) : null,
  };
  if (inbound) {
    const prev = previous ?? {};
    const dCount = (inbound.jitterBufferEmittedCount ?? 0) - (prev.jitterBufferEmittedCount ?? 0);
    const per = (key) => {
      if (inbound[key] === undefined) return null;
      if (dCount > 0) return round((1000 * (inbound[key] - (prev[key] ?? 0))) / dCount, 1);
      return inbound.jitterBufferEmittedCount ? round((1000 * inbound[key]) / inbound.jitterBufferEmittedCount, 1) : null;
    };
    ctx.jitter_buffer_ms = per("jitterBufferDelay");
    ctx.jitter_buffer_target_ms = per("jitterBufferTargetDelay");
    ctx.jitter_buffer_minimum_ms = per("jitterBufferMinimumDelay");
  }
  return ctx;
}

/** What probeContext needs of a report to difference the next one against. */
export function inboundCounters(report) {
  const inbound = audioStats(report, "inbound-rtp");
  if (!inbound) return null;
  const keys = ["jitterBufferEmittedCount", "jitterBufferDelay", "jitterBufferTargetDelay", "jitterBufferMinimumDelay"];
  return Object.fromEntries(keys.filter((k) => inbound[k] !== undefined).map((k) => [k, inbound[k]]));
}

/** The RTP counters a run's transport summary is taken from, both directions. */
export function transportCounters(report) {
  const pick = (s, keys) => (s ? Object.fromEntries(keys.map((k) => [k, s[k] ?? 0])) : null);
  const out = audioStats(report, "outbound-rtp");
  const inbound = audioStats(report, "inbound-rtp");
  return {
    // When the browser read the counters, not when the page got them (a busy main thread is late).
    t: (out ?? inbound)?.timestamp ?? null,
    out: pick(out, ["packetsSent", "bytesSent", "headerBytesSent"]),
    in: pick(inbound, ["packetsReceived", "bytesReceived", "headerBytesReceived"]),
  };
}

/**
 * Packet duration and bit rate each way between two transportCounters snapshots: what a packet
 * time costs on the wire (RTP payload and header; UDP/IP and SRTP overhead come on top).
 */
export function transportSummary(first, last) {
  if (!first || !last || first.t === null || last.t === null || last.t <= first.t) return null;
  const seconds = (last.t - first.t) / 1000;
  const direction = (a, b, packets, payload, header) => {
    if (!a || !b) return null;
    const n = b[packets] - a[packets];
    const bytes = b[payload] - a[payload] + b[header] - a[header];
    return { packets: n, packet_ms: n > 0 ? round((1000 * seconds) / n, 1) : null, rtp_kbps: round((8 * bytes) / seconds / 1000, 1) };
  };
  return {
    seconds: round(seconds, 1),
    sent: direction(first.out, last.out, "packetsSent", "bytesSent", "headerBytesSent"),
    received: direction(first.in, last.in, "packetsReceived", "bytesReceived", "headerBytesReceived"),
  };
}

export const CSV_COLUMNS = [
  "index", "sent_s", "latency_ms", "rtt_ms", "jitter_buffer_ms", "jitter_buffer_target_ms",
  "jitter_buffer_minimum_ms", "packets_received", "packets_lost", "concealed_samples", "inserted_samples",
  "removed_samples", "network_jitter_ms", "added_delay_ms",
];

/** The probes as CSV (one row each; an unheard probe has an empty latency). */
export function toCsv(result) {
  const cell = (v) => (v === null || v === undefined ? "" : String(v));
  const rows = result.probes.map((p) => CSV_COLUMNS.map((c) => cell(p[c])).join(","));
  return [CSV_COLUMNS.join(","), ...rows].join("\n") + "\n";
}

/** Counts of latencies in `binMs`-wide bins from the smallest to the largest heard value. */
export function histogram(latencies, binMs) {
  if (!latencies.length) return { start: 0, binMs, counts: [] };
  const start = Math.floor(Math.min(...latencies) / binMs) * binMs;
  const bins = Math.floor((Math.max(...latencies) - start) / binMs) + 1;
  const counts = new Array(bins).fill(0);
  for (const x of latencies) counts[Math.floor((x - start) / binMs)] += 1;
  return { start, binMs, counts };
}

/**
 * The self-check: each delayed probe against the mean of its two undelayed neighbours. A triplet
 * counts only if nothing moved the path's delay across it: the two neighbours agree to within
 * NEIGHBOURS_AGREE_MS (a sender that stalled or cut a backlog shifts every later probe, so they
 * would differ), and the receiver neither concealed audio, time-stretched, nor moved its target
 * between them. Triplets that fail this are counted apart (`disturbed`).
 */
export const NEIGHBOURS_AGREE_MS = 1.0;

export function selfCheck(probes, addedMs) {
  const differences = [];
  let disturbed = 0;
  const counters = ["concealed_samples", "inserted_samples", "removed_samples", "jitter_buffer_target_ms"];
  for (let k = 1; k + 1 < probes.length; k++) {
    const [before, probe, after] = [probes[k - 1], probes[k], probes[k + 1]];
    if (!probe.added_delay_ms || before.added_delay_ms || after.added_delay_ms) continue;
    if ([before, probe, after].some((p) => p.latency_ms === null)) continue;
    const steady = Math.abs(after.latency_ms - before.latency_ms) <= NEIGHBOURS_AGREE_MS
      && counters.every((key) => before[key] === probe[key] && probe[key] === after[key]);
    if (!steady) {
      disturbed += 1;
      continue;
    }
    differences.push(Math.round((probe.latency_ms - (before.latency_ms + after.latency_ms) / 2) * 100) / 100);
  }
  return { added_ms: addedMs, triplets: differences.length, disturbed_triplets: disturbed,
    median_difference_ms: round(percentile(differences, 50)), differences_ms: differences };
}
