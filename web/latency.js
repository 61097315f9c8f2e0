// The latency tester page: measures mouth-to-ear (loopback profile) or response latency (any engine)
// through a real peer connection. Probe sounds are written into the outgoing track by an
// AudioWorklet, which also records the incoming audio around each sound it hears; the probes are
// found in those recordings here (latency-detect.js), so both ends of a measurement are frame
// numbers of one AudioContext clock. The run is exported as JSON (what
// `lychee-rtc bench browser` prints) and CSV.

import { connect } from "./latency-call.js";
import { readStats } from "./stats.js";
import { CSV_COLUMNS, inboundCounters, probeContext, selfCheck, summarize, toCsv, transportCounters, transportSummary } from "./latency-report.js";
import { drawHistogram, drawSeries } from "./latency-charts.js";
import { GATE_RMS, findProbes } from "./latency-detect.js";

const $ = (id) => document.getElementById(id);
const RATE = 48000; // WebRTC's Opus rate: no resampling between the graph and the codec
const PROBE_S = 0.02;
// Four probe shapes (chirps up and down, wide and narrow) take turns, so a late echo of probe k
// is never taken for one of the next three; inside the 16 kHz path's band.
const SIGNATURES = [[400, 3200], [3200, 400], [900, 2200], [2200, 900]];
// Connected → first probe, while the receiver's jitter buffer settles on the stream. The page's
// own start-up work (the first getStats, which builds every stats object, and the detector's first
// run) is done at the start of the warm-up: done at the first probe, it made the browser's packets
// late both ways just when NetEq, which weighs its first seconds heavily, was learning its target.
const WARMUP_S = 1.5;
const QUIET_MS = 1000; // response mode: the answer has ended after this long below the threshold
const ANSWER_TIMEOUT_S = 20;

const params = new URLSearchParams(location.search);
const form = {
  server: $("server"), signaling: $("signaling"), mode: $("mode"), probes: $("probes"),
  interval: $("interval"), warmup: $("warmup"), jbTarget: $("jb-target"), check: $("check"),
  threshold: $("threshold"), token: $("token"),
  utteranceFile: $("utterance-file"), utteranceUrl: $("utterance-url"),
};
const ui = {
  start: $("start"), stop: $("stop"), state: $("state"), progress: $("progress"),
  summary: $("summary"), histogram: $("histogram"), series: $("series"), rows: $("probe-rows"),
  exportJson: $("export-json"), exportCsv: $("export-csv"), error: $("error"), remote: $("remote-audio"),
};

// Query parameters fill the form, so a run can be linked (and scripted: the bench uses them).
for (const [key, input] of [["server", form.server], ["signaling", form.signaling], ["mode", form.mode],
  ["probes", form.probes], ["interval_ms", form.interval], ["jitter_buffer_target_ms", form.jbTarget], ["check_ms", form.check],
  ["threshold", form.threshold], ["utterance", form.utteranceUrl], ["warmup_s", form.warmup]]) {
  if (params.has(key)) input.value = params.get(key);
}

export function chirp(f0, f1, rate = RATE, seconds = PROBE_S, amplitude = 0.6) {
  const n = Math.round(rate * seconds);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const t = i / rate;
    const hann = 0.5 - 0.5 * Math.cos((2 * Math.PI * i) / (n - 1));
    out[i] = amplitude * hann * Math.sin(2 * Math.PI * (f0 * t + ((f1 - f0) * t * t) / (2 * seconds)));
  }
  return out;
}

/** The utterance without its trailing silence: the response is timed from the end of the speech. */
export function trimSilence(samples, rate, threshold) {
  const win = Math.round(rate * 0.01);
  let end = samples.length;
  while (end > win) {
    let sum = 0;
    for (let i = end - win; i < end; i++) sum += samples[i] * samples[i];
    if (Math.sqrt(sum / win) >= threshold) break;
    end -= win;
  }
  return samples.subarray(0, end);
}

function setState(state, text) {
  ui.state.dataset.state = state;
  ui.state.textContent = text;
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function waitFor(predicate, timeoutMs, what) {
  return new Promise((resolve, reject) => {
    const deadline = performance.now() + timeoutMs;
    const tick = () => {
      if (predicate()) resolve();
      else if (performance.now() > deadline) reject(new Error(`timed out waiting for ${what}`));
      else setTimeout(tick, 20);
    };
    tick();
  });
}

async function loadUtterance(ctx) {
  const file = form.utteranceFile.files?.[0];
  let bytes;
  let name;
  if (file) {
    bytes = await file.arrayBuffer();
    name = file.name;
  } else if (form.utteranceUrl.value) {
    const response = await fetch(form.utteranceUrl.value);
    if (!response.ok) throw new Error(`cannot fetch the utterance: ${response.status} ${response.statusText}`);
    bytes = await response.arrayBuffer();
    name = form.utteranceUrl.value;
  } else {
    throw new Error("response mode needs a recorded utterance: pick a WAV file or give its URL");
  }
  const buffer = await ctx.decodeAudioData(bytes); // resampled to the context's rate
  return { name, samples: buffer.getChannelData(0), duration: buffer.duration };
}

class Run {
  constructor(options) {
    this.options = options;
    this.stopped = false;
    this.probes = [];
    this.sent = new Map(); // id -> {frame, endFrame}
    this.waiters = [];
    this.prevCounters = null;
    this.incomingPeak = 0; // the loudest incoming sample of the run: tells "nothing came back" apart
  }

  /** Resolves with the worklet's next message that `match` accepts. */
  next(match, timeoutMs) {
    return new Promise((resolve, reject) => {
      const waiter = { match, resolve, reject };
      this.waiters.push(waiter);
      setTimeout(() => {
        const i = this.waiters.indexOf(waiter);
        if (i >= 0) {
          this.waiters.splice(i, 1);
          reject(new Error("timed out"));
        }
      }, timeoutMs);
    });
  }

  /** Stop: no more probes, and whatever waits for the worklet gives up now. */
  stop() {
    this.stopped = true;
    for (const w of this.waiters.splice(0)) w.reject(new Error("stopped"));
  }

  onMessage(msg) {
    if (msg.type === "segment") {
      for (const probe of findProbes(msg.samples, msg.frame, this.templates)) this.onMessage({ type: "heard", ...probe });
      return;
    }
    if (msg.type === "sent") this.sent.set(msg.id, msg);
    if (msg.type === "level") this.incomingPeak = Math.max(this.incomingPeak, msg.peak);
    for (const w of [...this.waiters]) {
      if (w.match(msg)) {
        this.waiters.splice(this.waiters.indexOf(w), 1);
        w.resolve(msg);
      }
    }
    if (msg.type === "heard") this.onHeard?.(msg);
  }

  async context(report = null) {
    report = report ?? (await this.pc.getStats());
    const ctx = probeContext(report, this.prevCounters, readStats(report).rttMs);
    this.prevCounters = inboundCounters(report);
    for (const s of report.values()) {
      if (s.type === "codec" && s.mimeType?.startsWith("audio/")) this.codec = s.mimeType;
    }
    return ctx;
  }
}

let current = null;

async function run() {
  showError("");
  const o = {
    server: form.server.value.trim().replace(/\/+$/, ""),
    signaling: form.signaling.value,
    mode: form.mode.value,
    probes: Math.max(1, Math.min(10000, Number.parseInt(form.probes.value, 10) || 50)),
    intervalMs: Math.max(100, Number(form.interval.value) || 500),
    warmupS: form.warmup.value === "" ? WARMUP_S : Math.max(0, Math.min(60, Number(form.warmup.value) || 0)),
    jbTargetMs: form.jbTarget.value === "" ? null : Number(form.jbTarget.value),
    checkMs: Math.max(0, Number(form.check.value) || 0),
    threshold: Number(form.threshold.value) || 0.01,
    token: form.token.value,
  };
  const r = new Run(o);
  current = r;
  ui.start.disabled = true;
  ui.stop.disabled = false;
  ui.exportJson.disabled = ui.exportCsv.disabled = true;
  ui.rows.replaceChildren();
  ui.summary.replaceChildren();
  window.latencyTester.result = null;
  window.latencyTester.error = null;
  window.latencyTester.progress = { heard: 0, lastHeard: -1 };
  const ctx = new AudioContext({ sampleRate: RATE, latencyHint: "interactive" });
  let conn = null;
  try {
    setState("connecting", "Connecting…");
    await ctx.audioWorklet.addModule(new URL("./latency-worklet.js", import.meta.url));
    const node = new AudioWorkletNode(ctx, "latency-probe", {
      numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1], channelCount: 1, channelCountMode: "explicit",
    });
    node.port.onmessage = (e) => r.onMessage(e.data);
    const templates = SIGNATURES.map(([f0, f1]) => chirp(f0, f1));
    r.templates = templates;
    node.port.postMessage({ type: "listen", window: Math.max(...templates.map((t) => t.length)), gateRms: GATE_RMS });
    node.port.postMessage({ type: "mode", mode: o.mode === "response" ? "response" : "probe", threshold: o.threshold });
    const out = ctx.createMediaStreamDestination();
    out.channelCount = 1;
    // The self-check's delay line: after the mouth point, so the page's bookkeeping does not see it.
    const line = ctx.createDelay(2.0);
    line.delayTime.value = 0;
    node.connect(line).connect(out);
    r.line = line;
    const silent = ctx.createGain(); // keeps the node pulled by the context's own output, inaudibly
    silent.gain.value = 0;
    node.connect(silent).connect(ctx.destination);
    const utterance = o.mode === "response" ? await loadUtterance(ctx) : null;

    let remote = null;
    const analyser = ctx.createAnalyser();
    analyser.fftSize = 2048;
    const onTrack = (stream) => {
      if (remote) return;
      remote = stream;
      // Chromium hands a remote WebRTC stream to WebAudio only while a media element plays it.
      ui.remote.srcObject = stream;
      ui.remote.play().catch(() => {});
      const source = ctx.createMediaStreamSource(stream);
      source.connect(node);
      source.connect(analyser);
    };
    conn = await connect(o.server, o.token, o.signaling, out.stream, onTrack);
    r.pc = conn.pc;
    r.close = conn.close;
    await waitFor(() => remote && conn.pc.connectionState === "connected", 30000, "the media path");
    if (o.jbTargetMs !== null) {
      for (const receiver of conn.pc.getReceivers()) {
        if (receiver.track?.kind === "audio" && "jitterBufferTarget" in receiver) receiver.jitterBufferTarget = o.jbTargetMs;
      }
    }
    if (ctx.state !== "running") await ctx.resume();
    setState("running", "Measuring…");
    const warmupEnd = performance.now() + o.warmupS * 1000;
    await r.context(); // the page's start-up work, not at a probe (WARMUP_S)
    findProbes(new Float32Array(4096), 0, templates);
    await sleep(Math.max(0, warmupEnd - performance.now()));
    const baseline = await conn.pc.getStats();
    await r.context(baseline); // the stats baseline the first probe's interval starts from
    const transportStart = transportCounters(baseline);

    const startedAt = new Date().toISOString();
    if (o.mode === "response") await measureResponses(r, ctx, node, analyser, utterance);
    else await measureLoopback(r, ctx, node, templates);
    const transport = transportSummary(transportStart, transportCounters(await conn.pc.getStats()));

    const result = {
      tool: "lychee-rtc latency tester",
      mode: o.mode,
      measures: o.mode === "response"
        ? "from the last frame of the utterance's speech entering the outgoing track to the first frame of answer audio in the incoming audio"
        : "from the frame a probe's first sample entered the outgoing track to the frame its start was found in the incoming audio",
      clock: "AudioContext sample frames (the audio devices' own capture and output latency is not included)",
      server: o.server || location.origin,
      signaling: conn.signaling,
      started_at: startedAt,
      user_agent: navigator.userAgent,
      sample_rate: ctx.sampleRate,
      codec: r.codec ?? null,
      probes_requested: o.probes,
      interval_ms: o.intervalMs,
      warmup_s: o.warmupS,
      jitter_buffer_target_ms: o.jbTargetMs,
      self_check: o.mode === "loopback" && o.checkMs > 0 ? selfCheck(r.probes, o.checkMs) : null,
      answer_threshold_rms: o.mode === "response" ? o.threshold : null,
      utterance: utterance ? { name: utterance.name, duration_s: round3(utterance.duration), speech_s: round3(r.speechS) } : null,
      stopped_early: r.stopped,
      incoming_peak: Math.round(r.incomingPeak * 1e4) / 1e4,
      transport,
      summary: summarize(r.probes.filter((p) => !p.added_delay_ms)),
      probes: r.probes,
    };
    window.latencyTester.result = result;
    render(result);
    setState("done", `Done: ${result.summary.heard}/${result.summary.sent} heard`);
  } catch (err) {
    showError(err.message ?? String(err));
    setState("error", "Failed");
    window.latencyTester.error = err.message ?? String(err);
  } finally {
    conn?.close();
    await ctx.close().catch(() => {});
    ui.remote.srcObject = null;
    ui.start.disabled = false;
    ui.stop.disabled = true;
    current = null;
  }
}

const round3 = (x) => (x === undefined || x === null ? null : Math.round(x * 1000) / 1000);

// Loopback: probe k plays at frame start + k·interval; an echo belongs to the latest probe of the
// same shape sent before it, within as many intervals as there are shapes (then the shape repeats).
async function measureLoopback(r, ctx, node, templates) {
  const { probes, intervalMs } = r.options;
  const interval = Math.round((intervalMs / 1000) * ctx.sampleRate);
  const start = Math.round(ctx.currentTime * ctx.sampleRate) + Math.round(0.2 * ctx.sampleRate);
  const limit = Math.min(templates.length * interval - 1, 2 * ctx.sampleRate);
  // Self-check: every second probe goes through a delay line of checkMs, switched in the silence
  // half an interval before it and out half an interval after. The delay shifts the audio, not
  // the packets: the packet clock and every jitter buffer on the path carry on as before, so the
  // probe must come back exactly checkMs later than its neighbours.
  const check = r.options.checkMs;
  if (check && (check / 1000) * ctx.sampleRate + templates[0].length >= interval / 2) {
    throw new Error("the self-check delay must be shorter than half the interval minus the 20 ms probe");
  }
  for (let k = 0; k < probes; k++) {
    r.probes.push({ index: k, sent_s: null, latency_ms: null, ...Object.fromEntries(CSV_COLUMNS.slice(3).map((c) => [c, null])),
      added_delay_ms: check && k % 2 ? check : 0 });
    if (check && k > 0) r.line.delayTime.setValueAtTime(k % 2 ? check / 1000 : 0, (start + k * interval - interval / 2) / ctx.sampleRate);
    node.port.postMessage({ type: "play", id: k, samples: templates[k % templates.length], at: start + k * interval });
  }
  const pending = [];
  r.onHeard = (msg) => {
    let match = null;
    for (let k = 0; k < probes; k++) {
      const sent = r.sent.get(k);
      if (!sent || k % templates.length !== msg.signature || r.probes[k].latency_ms !== null) continue;
      if (sent.frame <= msg.frame && msg.frame - sent.frame <= limit) match = k;
    }
    if (match === null) return;
    const probe = r.probes[match];
    probe.latency_ms = Math.round(((msg.frame - r.sent.get(match).frame) / ctx.sampleRate) * 1e5) / 100;
    pending.push(r.context().then((stats) => Object.assign(probe, stats)).then(() => progress(r)));
  };
  const end = start + (probes - 1) * interval + limit + Math.round(0.1 * ctx.sampleRate);
  await waitFor(() => r.stopped || ctx.currentTime * ctx.sampleRate > end
    || r.probes.every((p) => p.latency_ms !== null), 1000 * (end / ctx.sampleRate - ctx.currentTime) + 30000, "the last probe");
  await Promise.all(pending);
  for (const p of r.probes) {
    const sent = r.sent.get(p.index);
    p.sent_s = sent ? round3((sent.frame - start) / ctx.sampleRate) : null;
  }
  if (r.stopped) { // the probes heard, and those that had their whole time to come back and did not
    const now = ctx.currentTime * ctx.sampleRate;
    r.probes = r.probes.filter((p) => p.latency_ms !== null || (r.sent.get(p.index)?.frame ?? Infinity) + limit <= now);
  }
}

function rms(analyser, buf) {
  analyser.getFloatTimeDomainData(buf);
  let sum = 0;
  for (const x of buf) sum += x * x;
  return Math.sqrt(sum / buf.length);
}

// Response: the utterance plays; from the last frame of its speech the worklet reports the first
// frame of answer audio. The next trial waits until the answer has ended.
async function measureResponses(r, ctx, node, analyser, utterance) {
  const speech = trimSilence(utterance.samples, ctx.sampleRate, r.options.threshold);
  r.speechS = speech.length / ctx.sampleRate;
  const buf = new Float32Array(analyser.fftSize);
  const t0 = ctx.currentTime;
  for (let k = 0; k < r.options.probes && !r.stopped; k++) {
    const probe = { index: k, sent_s: null, latency_ms: null };
    r.probes.push(probe);
    const at = Math.round(ctx.currentTime * ctx.sampleRate) + Math.round(0.05 * ctx.sampleRate);
    node.port.postMessage({ type: "arm", afterFrame: at + speech.length });
    node.port.postMessage({ type: "play", id: k, samples: speech, at });
    probe.sent_s = round3(at / ctx.sampleRate - t0);
    try {
      const answer = await r.next((m) => m.type === "answer", (r.speechS + ANSWER_TIMEOUT_S) * 1000);
      probe.latency_ms = Math.round(((answer.frame - (at + speech.length)) / ctx.sampleRate) * 1e5) / 100;
    } catch { /* no answer within the timeout: counted as lost */ }
    Object.assign(probe, await r.context());
    progress(r);
    // Wait for the answer to end (quiet for QUIET_MS), bounded, then leave a pause between trials.
    let quietSince = performance.now();
    const deadline = performance.now() + 60000;
    while (!r.stopped && performance.now() < deadline && performance.now() - quietSince < QUIET_MS) {
      await sleep(20);
      if (rms(analyser, buf) >= r.options.threshold) quietSince = performance.now();
    }
    await sleep(r.options.intervalMs);
  }
}

function progress(r) {
  const heard = r.probes.filter((p) => p.latency_ms !== null);
  ui.progress.textContent = `${heard.length} heard of ${r.probes.length}`;
  // For scripts that change something mid-run (the bench's impaired path): how far the run is.
  window.latencyTester.progress = { heard: heard.length, lastHeard: heard.length ? Math.max(...heard.map((p) => p.index)) : -1 };
}

function fmt(v, unit = " ms") {
  return v === null || v === undefined ? "—" : `${v}${unit}`;
}

function render(result) {
  const s = result.summary;
  const items = [["p50", s.p50_ms], ["p90", s.p90_ms], ["p99", s.p99_ms], ["max", s.max_ms], ["min", s.min_ms],
    ["mean", s.mean_ms], ["heard", `${s.heard}/${s.sent}`], ["lost", s.lost]];
  const check = result.self_check;
  if (check) {
    items.push(["self-check", `+${check.median_difference_ms ?? "—"} ms for +${check.added_ms} ms (${check.triplets} triplets)`]);
  }
  ui.summary.replaceChildren(...items.flatMap(([name, value]) => {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.id = `summary-${name}`;
    dd.textContent = typeof value === "number" && !["lost"].includes(name) ? fmt(value) : String(value ?? "—");
    return [dt, dd];
  }));
  const heard = result.probes.filter((p) => p.latency_ms !== null).map((p) => p.latency_ms);
  drawHistogram(ui.histogram, heard);
  drawSeries(ui.series, result.probes);
  ui.rows.replaceChildren(...result.probes.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.index = String(p.index);
    for (const c of CSV_COLUMNS) {
      const td = document.createElement("td");
      td.textContent = p[c] === null || p[c] === undefined ? (c === "latency_ms" ? "lost" : "—") : String(p[c]);
      tr.append(td);
    }
    return tr;
  }));
  ui.exportJson.disabled = ui.exportCsv.disabled = false;
}

function download(name, type, text) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  a.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

const stamp = () => new Date().toISOString().replace(/[:.]/g, "-");
ui.exportJson.addEventListener("click", () => {
  const result = window.latencyTester.result;
  if (result) download(`latency-${result.mode}-${stamp()}.json`, "application/json", JSON.stringify(result, null, 2));
});
ui.exportCsv.addEventListener("click", () => {
  const result = window.latencyTester.result;
  if (result) download(`latency-${result.mode}-${stamp()}.csv`, "text/csv", toCsv(result));
});
ui.start.addEventListener("click", () => { run(); });
ui.stop.addEventListener("click", () => current?.stop());
form.mode.addEventListener("change", () => { document.body.dataset.mode = form.mode.value; });
document.body.dataset.mode = form.mode.value;

// For scripts (lychee-rtc bench browser) and the console: the last run's JSON and CSV.
window.latencyTester = { result: null, error: null, progress: null, csv: () => (window.latencyTester.result ? toCsv(window.latencyTester.result) : null) };
