// One call to a lychee-rtc server: microphone capture, the peer connection, JSON offer/answer
// signaling and the `events` data channel. No UI here; app.js listens to the callbacks.

/** A refused or failed signaling request, with what the server said about it. */
export class SignalingError extends Error {
  constructor(message, { status = 0, code = "", retryAfterS = null } = {}) {
    super(message);
    this.name = "SignalingError";
    this.status = status;
    this.code = code;
    this.retryAfterS = retryAfterS;
  }
}

// Voice processing the browser does before encoding: the agent's own voice must not come back
// through the microphone (it would barge in on itself), and a steady level helps the server's VAD.
export function microphoneConstraints(deviceId) {
  const audio = {
    echoCancellation: true,
    noiseSuppression: true,
    autoGainControl: true,
    channelCount: 1,
  };
  if (deviceId) audio.deviceId = { exact: deviceId };
  return { audio, video: false };
}

export async function openMicrophone(deviceId) {
  if (!navigator.mediaDevices?.getUserMedia) {
    throw new Error("This browser cannot capture audio here (a secure origin — https or localhost — is required).");
  }
  try {
    return await navigator.mediaDevices.getUserMedia(microphoneConstraints(deviceId));
  } catch (err) {
    const reasons = {
      NotAllowedError: "Microphone access was denied. Allow it in the browser's site settings and try again.",
      NotFoundError: "No microphone was found.",
      NotReadableError: "The microphone is in use by another application or cannot be opened.",
      OverconstrainedError: "The selected microphone is no longer available.",
    };
    throw new Error(reasons[err.name] ?? `Cannot open the microphone: ${err.message}`);
  }
}

// The server answers only after gathering all of its own candidates and takes no trickled ones
// from us, so the offer we post must already hold ours. Host candidates take milliseconds; the
// bound only matters for a misconfigured STUN/TURN server.
function iceGatheringComplete(pc, timeoutMs = 5000) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", check);
      resolve();
    };
    const check = () => { if (pc.iceGatheringState === "complete") done(); };
    const timer = setTimeout(done, timeoutMs);
    pc.addEventListener("icegatheringstatechange", check);
  });
}

async function readError(response) {
  let code = "";
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error) {
      code = body.error.code ?? "";
      message = body.error.message ?? message;
    }
  } catch { /* not JSON: keep the status line */ }
  const retry = Number.parseInt(response.headers.get("Retry-After") ?? "", 10);
  return new SignalingError(message, {
    status: response.status,
    code,
    retryAfterS: Number.isFinite(retry) ? retry : null,
  });
}

export class RtcCall {
  /**
   * @param {object} handlers onEvent(event), onTrack(stream), onOpen(), onClose(reason), onState(pcState)
   */
  constructor(handlers) {
    this.handlers = handlers;
    this.pc = null;
    this.channel = null;
    this.mic = null;
    this.sessionId = null;
    this.sessionToken = null;
    this.closed = false;
    this.sentCount = 0;
    this.baseUrl = "";
    this.auth = {};
  }

  /** Opens the microphone, negotiates with the server and resolves once the answer is applied. */
  async connect({ baseUrl = "", token = "", deviceId = "", session = {} } = {}) {
    this.baseUrl = baseUrl;
    this.auth = token ? { Authorization: `Bearer ${token}` } : {};
    this.mic = await openMicrophone(deviceId);
    if (this.closed) { // disconnected while the permission prompt was up
      this.mic.getTracks().forEach((t) => t.stop());
      return;
    }
    const pc = new RTCPeerConnection({ iceServers: [] });
    this.pc = pc;
    for (const track of this.mic.getAudioTracks()) pc.addTrack(track, this.mic);
    // The data channel must exist before the offer so that it is negotiated with it.
    this.channel = pc.createDataChannel("events");
    this.channel.addEventListener("open", () => this.handlers.onOpen?.());
    this.channel.addEventListener("message", (e) => this.#onMessage(e));
    this.channel.addEventListener("close", () => this.#finish("data channel closed"));
    pc.addEventListener("track", (e) => this.handlers.onTrack?.(e.streams[0] ?? new MediaStream([e.track])));
    pc.addEventListener("connectionstatechange", () => {
      this.handlers.onState?.(pc.connectionState);
      if (pc.connectionState === "failed") this.#finish("connection failed (no route to the server's media port?)");
    });

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc);

    if (this.closed) return;
    let response;
    try {
      response = await fetch(`${baseUrl}/v1/rtc/offer`, {
        method: "POST",
        headers: { "Content-Type": "application/json", ...this.auth },
        body: JSON.stringify({ type: "offer", sdp: pc.localDescription.sdp, session }),
      });
    } catch (err) {
      throw new SignalingError(`Cannot reach the server: ${err.message}`);
    }
    if (!response.ok) throw await readError(response);
    const answer = await response.json();
    this.sessionId = answer.session_id;
    this.sessionToken = answer.session_token; // this session's own secret, for its HTTP resource
    if (this.closed) { // disconnected while the offer was in flight: free the slot it took
      this.#deleteSession();
      return;
    }
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
  }

  /** Sends one client event; returns it (with its event_id) or null when the channel is not open. */
  send(event) {
    if (this.channel?.readyState !== "open") return null;
    const full = { event_id: `evt_${Date.now().toString(36)}_${++this.sentCount}`, ...event };
    this.channel.send(JSON.stringify(full));
    return full;
  }

  /** Swaps the microphone without renegotiating. */
  async switchMicrophone(deviceId) {
    const stream = await openMicrophone(deviceId);
    const track = stream.getAudioTracks()[0];
    const sender = this.pc?.getSenders().find((s) => s.track?.kind === "audio");
    if (sender) await sender.replaceTrack(track);
    this.mic?.getTracks().forEach((t) => t.stop());
    this.mic = stream;
    return stream;
  }

  async getStats() {
    return this.pc ? this.pc.getStats() : null;
  }

  /** Ends the call politely (the server frees the slot at once), then locally. */
  close(reason = "disconnected") {
    if (this.closed) return;
    // Without an open channel (a call that failed half-way) the HTTP resource is the way to end it.
    if (!this.send({ type: "session.close" })) this.#deleteSession();
    this.#finish(reason);
  }

  #deleteSession() {
    if (!this.sessionId) return;
    const headers = this.sessionToken ? { Authorization: `Bearer ${this.sessionToken}` } : this.auth;
    fetch(`${this.baseUrl}/v1/sessions/${encodeURIComponent(this.sessionId)}`, { method: "DELETE", headers })
      .catch(() => { /* the server's connect timeout frees it anyway */ });
  }

  #onMessage(e) {
    let event;
    try {
      event = JSON.parse(e.data);
    } catch {
      event = { type: "error", error: { code: "bad_message", message: "unparseable message from the server" } };
    }
    this.handlers.onEvent?.(event);
  }

  #finish(reason) {
    if (this.closed) return;
    this.closed = true;
    // Let a queued session.close leave before the transport goes away.
    const pc = this.pc;
    setTimeout(() => pc?.close(), 100);
    this.mic?.getTracks().forEach((t) => t.stop());
    this.handlers.onClose?.(reason);
  }
}
