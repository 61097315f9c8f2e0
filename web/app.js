// The lychee-rtc client page: wires the call (rtc.js), the meters (meter.js) and the latency
// figures (stats.js) to the DOM, and renders the server's events.

import { RtcCall, SignalingError } from "./rtc.js";
import { LevelMeter, meterFraction } from "./meter.js";
import { readStats, mouthToEar, answerQueuedMs } from "./stats.js";

const $ = (id) => document.getElementById(id);

const ui = {
  status: $("conn-status"),
  alert: $("alert"),
  alertText: $("alert-text"),
  alertClose: $("alert-close"),
  micSelect: $("mic-select"),
  micLevel: $("mic-level"),
  connect: $("connect"),
  disconnect: $("disconnect"),
  sessionId: $("session-id"),
  engineName: $("engine-name"),
  settingsForm: $("settings-form"),
  voice: $("voice"),
  voiceHint: $("voice-hint"),
  temperature: $("temperature"),
  seed: $("seed"),
  token: $("token"),
  apply: $("apply-settings"),
  agentState: $("agent-state"),
  epoch: $("epoch"),
  responseId: $("response-id"),
  agentLevel: $("agent-level"),
  interrupt: $("interrupt"),
  commit: $("commit"),
  hold: $("hold"),
  transcript: $("transcript"),
  transcriptPlaceholder: $("transcript-placeholder"),
  m2e: $("m2e"),
  m2eBar: $("m2e-bar"),
  m2eParts: $("m2e-parts"),
  answerQueued: $("answer-queued"),
  statRtt: $("stat-rtt"),
  statJb: $("stat-jb"),
  statConcealed: $("stat-concealed"),
  statLost: $("stat-lost"),
  statJitter: $("stat-jitter"),
  srvWindow: $("srv-window"),
  srvQueue: $("srv-queue"),
  srvStep: $("srv-step"),
  srvVocoder: $("srv-vocoder"),
  srvPing: $("srv-ping"),
  log: $("log"),
  logVerbose: $("log-verbose"),
  logClear: $("log-clear"),
  remoteAudio: $("remote-audio"),
};

// A page may talk to another server than the one that served it: ?server=http://host:port
// (the server's CORS settings must allow this origin).
const BASE_URL = (new URLSearchParams(location.search).get("server") ?? "").replace(/\/+$/, "");
// The latency tester measures the same server (its ?server= too).
$("tester-link").search = location.search;
const LOG_LIMIT = 400;
const METRICS_WINDOWS = 10; // server timings are averaged over this many recent windows
// Per-window chatter, hidden from the log unless asked for.
const VERBOSE_TYPES = new Set(["metrics", "ping", "pong", "playback.ack", "response.output_audio_codes.delta"]);
const STORAGE_KEY = "lychee-rtc.settings";
const PART_COLORS = ["#8e7cc3", "#e69138", "#f1c232", "#c2185b", "#45818e", "#6d9eeb", "#6aa84f"];

const state = {
  call: null,
  audioContext: null,
  micMeter: null,
  agentMeter: null,
  connectedAt: 0,
  session: null, // the server's session description (session.created / session.updated)
  epoch: null,
  activeResponse: null,
  holding: false,
  stats: null,
  serverWindows: [],
  pingRttMs: undefined,
  timers: [],
  retryTimer: null,
  transcriptTurns: new Map(), // response_id -> <p>
  speechStartMs: null,
};

// --- small helpers --------------------------------------------------------------------------------

function ms(value, digits = 0) {
  return value === undefined || value === null || Number.isNaN(value) ? "—" : `${value.toFixed(digits)} ms`;
}

function setStatus(status, text) {
  ui.status.dataset.status = status;
  ui.status.textContent = text;
}

function showAlert(message, kind = "error") {
  ui.alertText.textContent = message;
  ui.alert.dataset.kind = kind;
  ui.alert.hidden = false;
}

function hideAlert() {
  ui.alert.hidden = true;
  ui.alertText.textContent = "";
}

function loadSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORAGE_KEY) ?? "{}");
    if (saved.temperature !== undefined) ui.temperature.value = saved.temperature;
    if (saved.seed !== undefined) ui.seed.value = saved.seed;
    return saved;
  } catch {
    return {};
  }
}

function saveSettings(extra = {}) {
  try {
    const saved = JSON.parse(localStorage.getItem(STORAGE_KEY) ?? "{}");
    const next = { ...saved, temperature: ui.temperature.value, seed: ui.seed.value, ...extra };
    localStorage.setItem(STORAGE_KEY, JSON.stringify(next));
  } catch { /* storage disabled: settings just do not persist */ }
}

/** The sampling settings as the protocol wants them, or throws with a message for the user. */
function readSamplingSettings() {
  const out = {};
  const t = ui.temperature.value.trim();
  if (t !== "") {
    const temperature = Number(t);
    if (!(temperature > 0 && temperature <= 2)) throw new Error("Temperature must be greater than 0 and at most 2.");
    out.temperature = temperature;
  }
  const s = ui.seed.value.trim();
  if (s !== "") {
    const seed = Number(s);
    if (!Number.isSafeInteger(seed) || seed < 0) throw new Error("Seed must be a whole number, 0 or more.");
    out.seed = seed;
  }
  return out;
}

// --- microphones ----------------------------------------------------------------------------------

async function refreshMicrophones() {
  if (!navigator.mediaDevices?.enumerateDevices) return;
  const devices = await navigator.mediaDevices.enumerateDevices();
  const current = ui.micSelect.value || loadSettings().mic || "";
  ui.micSelect.replaceChildren(new Option("System default", ""));
  let n = 0;
  for (const d of devices) {
    if (d.kind !== "audioinput" || d.deviceId === "default" || d.deviceId === "") continue;
    n += 1;
    // Labels stay empty until the page has been granted the microphone once.
    ui.micSelect.add(new Option(d.label || `Microphone ${n}`, d.deviceId));
  }
  ui.micSelect.value = [...ui.micSelect.options].some((o) => o.value === current) ? current : "";
}

async function onMicrophoneChange() {
  saveSettings({ mic: ui.micSelect.value });
  if (!state.call || state.call.closed) return;
  try {
    const stream = await state.call.switchMicrophone(ui.micSelect.value);
    state.micMeter?.disconnect();
    state.micMeter = new LevelMeter(state.audioContext, stream);
    logLocal(`microphone: ${stream.getAudioTracks()[0]?.label || "switched"}`);
  } catch (err) {
    showAlert(err.message);
  }
}

// --- connecting -----------------------------------------------------------------------------------

function audioContext() {
  // Created inside the click that connects: browsers only start audio after a user gesture.
  state.audioContext ??= new AudioContext();
  state.audioContext.resume().catch(() => {});
  return state.audioContext;
}

async function connect() {
  hideAlert();
  let sampling;
  try {
    sampling = readSamplingSettings();
  } catch (err) {
    showAlert(err.message);
    return;
  }
  saveSettings();
  const context = audioContext();
  ui.connect.disabled = true;
  setStatus("connecting", "Connecting…");
  resetCallView();

  const call = new RtcCall({
    onEvent: handleServerEvent,
    onTrack: (stream) => onRemoteStream(stream),
    onOpen: () => logLocal("data channel open"),
    onState: (s) => onConnectionState(s),
    onClose: (reason) => onCallClosed(call, reason),
    onReconnecting: (attempt, why) => {
      setStatus("connecting", `Reconnecting… (${why}, attempt ${attempt})`);
      logLocal(`${why}: resuming the session, attempt ${attempt}`);
    },
    onResumed: () => logLocal("offer answered: session resumed"),
  });
  state.call = call;
  state.connectedAt = performance.now();
  ui.disconnect.disabled = false; // also cancels a call still being set up
  try {
    await call.connect({
      baseUrl: BASE_URL,
      token: ui.token.value.trim(),
      deviceId: ui.micSelect.value,
      // Metrics feed the latency panel; the voice follows once we know the engine's voices.
      session: { metrics: true, ...sampling },
    });
  } catch (err) {
    call.close("refused");
    onConnectFailed(err);
    return;
  }
  if (call.closed) return;
  state.micMeter = new LevelMeter(context, call.mic);
  ui.sessionId.textContent = call.sessionId ?? "—";
  logLocal(`offer answered: ${call.sessionId}`);
  refreshMicrophones(); // labels are readable now
  startTimers();
}

function onConnectFailed(err) {
  setStatus("error", err instanceof SignalingError && err.status === 503 ? "Server full" : "Not connected");
  ui.connect.disabled = false;
  if (!(err instanceof SignalingError)) {
    showAlert(err.message);
    logLocal(`connect failed: ${err.message}`);
    return;
  }
  logLocal(`offer refused: ${err.status} ${err.code} ${err.message}`);
  if (err.status === 503) {
    const wait = err.retryAfterS ?? 5;
    showAlert(`The server is full: all of its sessions are in use. Try again in ${wait} s.`);
    holdConnectButton(wait);
  } else if (err.status === 401) {
    showAlert("The server needs an access token, or the one given is wrong. Enter it under Voice and sampling.");
  } else if (err.status) {
    showAlert(`The server refused the call (${err.status}${err.code ? ` ${err.code}` : ""}): ${err.message}`);
  } else {
    showAlert(err.message);
  }
}

/** Honours Retry-After: Connect counts down instead of inviting another refused offer. */
function holdConnectButton(seconds) {
  clearInterval(state.retryTimer);
  let left = Math.max(1, Math.round(seconds));
  ui.connect.disabled = true;
  ui.connect.textContent = `Retry in ${left} s`;
  state.retryTimer = setInterval(() => {
    left -= 1;
    if (left > 0) {
      ui.connect.textContent = `Retry in ${left} s`;
      return;
    }
    clearInterval(state.retryTimer);
    state.retryTimer = null;
    ui.connect.textContent = "Connect";
    ui.connect.disabled = Boolean(state.call && !state.call.closed);
  }, 1000);
}

function onRemoteStream(stream) {
  ui.remoteAudio.srcObject = stream;
  ui.remoteAudio.play().catch((err) => showAlert(`The browser blocked playback: ${err.message}`));
  state.agentMeter?.disconnect();
  state.agentMeter = new LevelMeter(audioContext(), stream);
}

function onConnectionState(pcState) {
  const labels = {
    new: "Connecting…",
    connecting: "Connecting…",
    connected: "Connected",
    disconnected: "Connection interrupted…",
    failed: "Connection failed",
    closed: "Not connected",
  };
  if (state.call?.resumes) labels.connected = "Connected (resumed)";
  const status = pcState === "connected" ? "connected" : pcState === "failed" ? "error" : "connecting";
  if (state.call && !state.call.closed) setStatus(status, labels[pcState] ?? pcState);
  logLocal(`peer connection ${pcState}`);
}

function disconnect() {
  state.call?.close("disconnected by you");
}

function onCallClosed(call, reason) {
  if (call !== state.call) return;
  stopTimers();
  releaseHold(false);
  state.micMeter?.disconnect();
  state.agentMeter?.disconnect();
  state.micMeter = state.agentMeter = null;
  ui.remoteAudio.srcObject = null;
  ui.micLevel.value = ui.agentLevel.value = 0;
  state.activeResponse = null;
  setControls(false);
  ui.disconnect.disabled = true;
  ui.connect.disabled = state.retryTimer !== null;
  ui.apply.disabled = true;
  setAgentState("idle", "");
  // A status that says why the call ended (failed, closed by the server) stays up.
  if (["connected", "connecting"].includes(ui.status.dataset.status)) setStatus("idle", "Not connected");
  if (reason === "refused") return;
  logLocal(`call ended: ${reason}`);
  if (reason.startsWith("connection failed") || reason === "data channel closed") showAlert(`The call ended: ${reason}.`);
}

function resetCallView() {
  state.session = null;
  state.epoch = null;
  state.activeResponse = null;
  state.stats = null;
  state.serverWindows = [];
  state.pingRttMs = undefined;
  ui.sessionId.textContent = ui.engineName.textContent = "—";
  ui.epoch.textContent = ui.responseId.textContent = "—";
  setAgentState("connecting", "");
}

// --- sending --------------------------------------------------------------------------------------

function send(event) {
  const sent = state.call?.send(event);
  if (sent) logEvent(sent, "out");
  else showAlert("Not connected: the event was not sent.");
  return sent;
}

function interrupt() {
  const event = { type: "response.cancel" };
  if (state.activeResponse) event.response_id = state.activeResponse;
  send(event);
}

function applySettings(e) {
  e.preventDefault();
  hideAlert();
  let session;
  try {
    session = readSamplingSettings();
  } catch (err) {
    showAlert(err.message);
    return;
  }
  // Cleared fields go as null: back to the engine's defaults.
  session.temperature ??= null;
  session.seed ??= null;
  if (!ui.voice.disabled) session.voice = ui.voice.value || null;
  saveSettings({ voice: ui.voice.value });
  send({ type: "session.update", session });
}

// Hold to listen: turn.listen on press, turn.release on release, wherever the release happens.
function pressHold(e) {
  if (ui.hold.disabled || state.holding) return;
  if (e.type === "keydown" && e.key !== " " && e.key !== "Enter") return;
  e.preventDefault();
  state.holding = true;
  ui.hold.setAttribute("aria-pressed", "true");
  if (e.pointerId !== undefined) ui.hold.setPointerCapture?.(e.pointerId);
  send({ type: "turn.listen" });
}

function releaseHold(sendEvent = true) {
  if (!state.holding) return;
  state.holding = false;
  ui.hold.setAttribute("aria-pressed", "false");
  if (sendEvent) send({ type: "turn.release" });
}

function setControls(connected) {
  const caps = state.session?.capabilities ?? {};
  ui.commit.disabled = !connected || caps.commit_hint === false;
  ui.hold.disabled = !connected || caps.forced_listen === false;
  ui.interrupt.disabled = !connected || !state.activeResponse || caps.client_cancel === false;
}

// --- server events --------------------------------------------------------------------------------

/** Every event from the data channel comes through here (exposed on window.lychee for tests). */
function handleServerEvent(event) {
  logEvent(event, "in");
  if (typeof event.epoch === "number") setEpoch(event.epoch);
  const handler = EVENT_HANDLERS[event.type];
  if (handler) handler(event);
}

const EVENT_HANDLERS = {
  "session.created": (e) => onSession(e.session, true),
  "session.updated": (e) => onSession(e.session, false),
  "session.closed": (e) => {
    if (!state.call || state.call.closed) return; // the answer to our own session.close
    setStatus("idle", `Closed by the server (${e.reason})`);
    showAlert(`The server ended the session: ${e.reason}.`, "info");
    state.call.close(`closed by the server: ${e.reason}`);
  },
  "session.resumed": (e) => {
    onSession(e.session, false);
    setStatus("connected", "Connected (resumed)");
    if (e.lost) showAlert(`Reconnected; ${e.lost} event(s) from the break could not be replayed.`, "info");
    else hideAlert();
  },
  "turn.state": (e) => setAgentState(e.state, e.reason),
  "input_audio_buffer.speech_started": (e) => { state.speechStartMs = e.audio_start_ms; },
  "input_audio_buffer.speech_stopped": (e) => addUserTurn(e.audio_end_ms - (state.speechStartMs ?? e.audio_end_ms)),
  "response.created": (e) => {
    state.activeResponse = e.response_id;
    transcriptTurn(e.response_id, e.epoch);
    ui.responseId.textContent = e.response_id;
    setControls(true);
  },
  "response.output_audio_transcript.delta": (e) => appendTranscript(e),
  "output_audio_buffer.cleared": (e) => setEpoch(e.new_epoch),
  "response.done": (e) => {
    finishTranscript(e.response_id, e.response ?? {});
    if (state.activeResponse === e.response_id) state.activeResponse = null;
    setControls(true);
  },
  metrics: (e) => onMetrics(e),
  pong: (e) => {
    if (typeof e.client_time === "number") state.pingRttMs = performance.now() - e.client_time;
  },
  error: (e) => {
    const err = e.error ?? {};
    showAlert(`Server error${err.code ? ` (${err.code})` : ""}: ${err.message ?? "unknown"}`);
  },
};

function onSession(session, created) {
  if (!session) return;
  state.session = session;
  ui.sessionId.textContent = session.id;
  ui.engineName.textContent = session.engine;
  setEpoch(session.epoch);
  fillVoices(session.capabilities?.voices ?? [], session.voice);
  ui.apply.disabled = false;
  const caps = session.capabilities ?? {};
  ui.transcriptPlaceholder.textContent = caps.text_output
    ? "The agent's words appear here as it speaks."
    : `The ${session.engine} engine has no text channel: it answers with audio only.`;
  setControls(true);
  if (created) {
    if (!ui.agentState.dataset.state || ui.agentState.dataset.state === "connecting") setAgentState("listening", "");
    // A voice remembered from an earlier call, if this engine has it.
    const wanted = loadSettings().voice;
    if (wanted && wanted !== session.voice && (caps.voices ?? []).includes(wanted)) {
      ui.voice.value = wanted;
      send({ type: "session.update", session: { voice: wanted } });
    }
  }
}

function fillVoices(voices, current) {
  ui.voice.replaceChildren(new Option("Engine default", ""));
  for (const v of voices) ui.voice.add(new Option(v, v));
  // The echo engine has none; sending one would only earn an invalid_voice error.
  ui.voice.disabled = voices.length === 0;
  ui.voice.value = current && voices.includes(current) ? current : "";
  ui.voiceHint.textContent = voices.length ? `${voices.length} voice${voices.length > 1 ? "s" : ""}` : "This engine has no selectable voices.";
}

function setEpoch(epoch) {
  if (typeof epoch !== "number") return;
  state.epoch = Math.max(state.epoch ?? 0, epoch);
  ui.epoch.textContent = String(state.epoch);
}

function setAgentState(name, reason) {
  ui.agentState.dataset.state = name;
  ui.agentState.textContent = name;
  ui.agentState.title = reason ? `reason: ${reason}` : "";
}

// --- transcript -----------------------------------------------------------------------------------

function transcriptTurn(responseId, epoch) {
  let p = state.transcriptTurns.get(responseId);
  if (!p) {
    ui.transcriptPlaceholder.hidden = true;
    p = document.createElement("p");
    p.className = "turn agent";
    p.dataset.responseId = responseId;
    if (typeof epoch === "number") p.dataset.epoch = String(epoch);
    const text = document.createElement("span");
    text.className = "text";
    p.append(text);
    ui.transcript.append(p);
    state.transcriptTurns.set(responseId, p);
  }
  return p;
}

function appendTranscript(e) {
  // Text of an interrupted epoch must not reach the screen any more than its audio reaches the ear.
  if (typeof e.epoch === "number" && state.epoch !== null && e.epoch < state.epoch) return;
  const p = transcriptTurn(e.response_id ?? "unknown", e.epoch);
  p.querySelector(".text").append(e.delta ?? "");
  scrollToEnd(ui.transcript);
}

function finishTranscript(responseId, response) {
  const p = state.transcriptTurns.get(responseId);
  if (!p) return;
  p.dataset.status = response.status ?? "";
  const text = p.querySelector(".text");
  if (!text.textContent && typeof response.played_ms === "number") {
    // Audio-only engines: say what was heard instead of leaving an empty line.
    text.textContent = `(audio, ${(response.played_ms / 1000).toFixed(1)} s)`;
    p.classList.add("audio-only");
  }
  if (response.status && response.status !== "completed") {
    const mark = document.createElement("span");
    mark.className = "mark";
    mark.textContent = response.status === "cancelled" ? " — interrupted" : ` — ${response.status}`;
    p.append(mark);
  }
}

function addUserTurn(durationMs) {
  ui.transcriptPlaceholder.hidden = true;
  const p = document.createElement("p");
  p.className = "turn user";
  p.textContent = `You spoke (${(durationMs / 1000).toFixed(1)} s)`;
  ui.transcript.append(p);
  scrollToEnd(ui.transcript);
}

function scrollToEnd(el) {
  el.scrollTop = el.scrollHeight;
}

// --- event log ------------------------------------------------------------------------------------

const SUMMARY_SKIP = new Set(["type", "seq", "event_id", "session"]);

function summarize(event) {
  if (event.type?.startsWith("session.") && event.session) {
    const s = event.session;
    return `${s.id ?? ""} engine=${s.engine ?? "?"} epoch=${s.epoch ?? "?"}`;
  }
  if (event.type === "page") return event.note;
  if (event.type === "error" && event.error) return `${event.error.code}: ${event.error.message}`;
  if (event.type === "response.done" || event.type === "response.created") {
    const r = event.response ?? {};
    const reason = r.status_details?.reason ? ` (${r.status_details.reason})` : "";
    return `${event.response_id} ${r.status ?? ""}${reason} epoch=${event.epoch}`;
  }
  const parts = [];
  for (const [k, v] of Object.entries(event)) {
    if (SUMMARY_SKIP.has(k) || v === null || typeof v === "object") continue;
    parts.push(`${k}=${typeof v === "string" ? JSON.stringify(v).slice(0, 60) : v}`);
  }
  return parts.join(" ");
}

function logEvent(event, direction) {
  if (VERBOSE_TYPES.has(event.type) && !ui.logVerbose.checked) return;
  const li = document.createElement("li");
  li.className = `entry ${direction}`;
  li.dataset.type = event.type ?? "?";
  if (event.type === "response.done") li.dataset.status = event.response?.status ?? "";
  if (direction === "in" && typeof event.seq === "number") li.dataset.seq = String(event.seq);
  if (event.type === "error") li.classList.add("is-error");

  const details = document.createElement("details");
  const summary = document.createElement("summary");
  const time = document.createElement("time");
  time.textContent = `+${((performance.now() - state.connectedAt) / 1000).toFixed(2)}s`;
  const arrow = document.createElement("span");
  arrow.className = "dir";
  arrow.textContent = direction === "in" ? "↓" : direction === "out" ? "↑" : "•";
  arrow.title = direction === "in" ? "from the server" : direction === "out" ? "to the server" : "this page";
  const type = document.createElement("code");
  type.className = "type";
  type.textContent = event.type;
  const text = document.createElement("span");
  text.className = "summary";
  text.textContent = (event.seq ? `#${event.seq} ` : "") + summarize(event);
  summary.append(time, arrow, type, text);
  details.append(summary);
  // The full JSON is rendered when opened: most rows are never looked at.
  details.addEventListener("toggle", () => {
    if (details.open && !details.querySelector("pre")) {
      const pre = document.createElement("pre");
      pre.textContent = JSON.stringify(event, null, 2);
      details.append(pre);
    }
  });
  li.append(details);

  const atEnd = ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 40;
  ui.log.append(li);
  while (ui.log.childElementCount > LOG_LIMIT) ui.log.firstElementChild.remove();
  if (atEnd) scrollToEnd(ui.log);
}

function logLocal(text) {
  logEvent({ type: "page", note: text }, "local");
}

// --- latency --------------------------------------------------------------------------------------

function onMetrics(e) {
  state.serverWindows.push(e);
  if (state.serverWindows.length > METRICS_WINDOWS) state.serverWindows.shift();
}

function serverMeans() {
  const w = state.serverWindows;
  if (!w.length) return null;
  const mean = (k) => w.reduce((sum, e) => sum + (e[k] ?? 0), 0) / w.length;
  return {
    deadline_ms: mean("deadline_ms"),
    queue_wait_ms: mean("queue_wait_ms"),
    step_ms: mean("step_ms"),
    vocoder_ms: mean("vocoder_ms"),
    playout_depth_ms: mean("playout_depth_ms"),
  };
}

async function pollStats() {
  const report = await state.call?.getStats();
  if (!report) return;
  state.stats = readStats(report, state.stats);
  renderLatency();
}

function renderLatency() {
  const s = state.stats ?? {};
  const server = serverMeans();
  ui.statRtt.textContent = ms(s.rttMs, 1);
  ui.statJb.textContent = ms(s.jitterBufferMs, 1);
  ui.statConcealed.textContent = s.concealedSamples === undefined ? "—"
    : `${s.concealedSamples.toLocaleString()} (${s.concealedPct.toFixed(2)} %)`;
  ui.statLost.textContent = s.packetsLost === undefined ? "—" : `${s.packetsLost} of ${s.packetsLost + s.packetsReceived}`;
  ui.statJitter.textContent = ms(s.networkJitterMs, 1);
  ui.srvWindow.textContent = ms(server?.deadline_ms);
  ui.srvQueue.textContent = ms(server?.queue_wait_ms, 1);
  ui.srvStep.textContent = ms(server?.step_ms, 1);
  ui.srvVocoder.textContent = ms(server?.vocoder_ms, 1);
  ui.srvPing.textContent = ms(state.pingRttMs, 1);

  const estimate = mouthToEar({ rttMs: s.rttMs, jitterBufferMs: s.jitterBufferMs, server });
  ui.m2e.textContent = estimate ? `≈ ${Math.round(estimate.totalMs)} ms` : "—";
  ui.m2e.dataset.ms = estimate ? String(estimate.totalMs) : "";
  const queued = answerQueuedMs(server);
  ui.answerQueued.textContent = ms(queued);
  ui.answerQueued.dataset.ms = queued === undefined ? "" : String(queued);
  const parts = estimate?.parts ?? [];
  ui.m2eBar.replaceChildren(...parts.map(([name, value], i) => {
    const seg = document.createElement("span");
    seg.style.setProperty("--c", PART_COLORS[i % PART_COLORS.length]);
    seg.style.flexGrow = String(Math.max(value, 0));
    seg.title = name;
    return seg;
  }));
  ui.m2eParts.replaceChildren(...parts.map(([name, value], i) => {
    const li = document.createElement("li");
    li.style.setProperty("--c", PART_COLORS[i % PART_COLORS.length]);
    const label = document.createElement("span");
    label.textContent = name;
    const amount = document.createElement("span");
    amount.textContent = ms(value, value < 10 ? 1 : 0);
    li.append(label, amount);
    return li;
  }));
}

function renderMeters() {
  ui.micLevel.value = state.micMeter ? meterFraction(state.micMeter.rms()) : 0;
  ui.agentLevel.value = state.agentMeter ? meterFraction(state.agentMeter.rms()) : 0;
  if (state.call && !state.call.closed) requestAnimationFrame(renderMeters);
}

function startTimers() {
  stopTimers();
  state.timers.push(setInterval(pollStats, 1000));
  // Data-channel round trips, next to the media path's RTT.
  state.timers.push(setInterval(() => state.call?.send({ type: "ping", client_time: performance.now() }), 2000));
  requestAnimationFrame(renderMeters);
}

function stopTimers() {
  state.timers.forEach(clearInterval);
  state.timers = [];
}

// --- start-up -------------------------------------------------------------------------------------

function init() {
  loadSettings();
  ui.connect.addEventListener("click", connect);
  ui.disconnect.addEventListener("click", disconnect);
  ui.alertClose.addEventListener("click", hideAlert);
  ui.micSelect.addEventListener("change", onMicrophoneChange);
  ui.settingsForm.addEventListener("submit", applySettings);
  ui.interrupt.addEventListener("click", interrupt);
  ui.commit.addEventListener("click", () => send({ type: "input_audio_buffer.commit" }));
  ui.hold.addEventListener("pointerdown", pressHold);
  ui.hold.addEventListener("keydown", (e) => { if (!e.repeat) pressHold(e); });
  for (const type of ["pointerup", "pointercancel", "keyup", "blur"]) ui.hold.addEventListener(type, () => releaseHold());
  ui.logClear.addEventListener("click", () => ui.log.replaceChildren());
  navigator.mediaDevices?.addEventListener?.("devicechange", refreshMicrophones);
  window.addEventListener("pagehide", () => state.call?.close("page closed"));
  refreshMicrophones();
  setControls(false);
}

init();

// For debugging from the console and for the end-to-end test: the page's own event path and
// what it hears, without reaching into module state.
window.lychee = {
  handleServerEvent,
  agentLevel: () => state.agentMeter?.rms() ?? 0,
  micLevel: () => state.micMeter?.rms() ?? 0,
  stats: () => state.stats,
  sessionId: () => state.call?.sessionId ?? null,
  epoch: () => state.epoch,
  /** The inbound audio RTP stats as the browser reports them (decoded samples, energy). */
  inboundAudio: async () => {
    const report = await state.call?.getStats();
    for (const s of report?.values() ?? []) if (s.type === "inbound-rtp" && s.kind === "audio") return s;
    return null;
  },
};
