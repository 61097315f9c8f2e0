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
export function iceGatheringComplete(pc, timeoutMs = 5000) {
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

// After the media path is lost (network change, ICE failure), the page offers again with the
// session's resume token; the server keeps the session this long (session.resume_window_s).
const RESUME_WINDOW_MS = 30000;
// "disconnected" often heals by itself within a few seconds; past this the path counts as lost.
const DISCONNECTED_GRACE_MS = 3000;

export class RtcCall {
  /**
   * @param {object} handlers onEvent(event), onTrack(stream), onOpen(), onClose(reason), onState(pcState),
   *   onReconnecting(attempt), onResumed()
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
    this.lastSeq = 0; // the newest server event received: a resume replays what came after it
    this.serverClosed = false;
    this.reconnecting = false;
    this.resumes = 0; // how many times this call came back on a new connection
    this.disconnectedTimer = null;
  }

  /**
   * Opens the microphone (or sends `stream` instead, e.g. generated audio), negotiates with the
   * server and resolves once the answer is applied.
   */
  async connect({ baseUrl = "", token = "", deviceId = "", session = {}, stream = null } = {}) {
    this.baseUrl = baseUrl;
    this.auth = token ? { Authorization: `Bearer ${token}` } : {};
    this.mic = stream ?? await openMicrophone(deviceId);
    if (this.closed) { // disconnected while the permission prompt was up
      this.mic.getTracks().forEach((t) => t.stop());
      return;
    }
    const answer = await this.#negotiate({ session }, this.auth);
    if (!answer) return;
    this.sessionId = answer.session_id;
    this.sessionToken = answer.session_token; // this session's own secret, for its HTTP resource and resumes
    if (this.closed) { // disconnected while the offer was in flight: free the slot it took
      this.#deleteSession();
      return;
    }
    await this.pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
  }

  /** A new peer connection with the microphone and an events channel; posts its offer, returns the answer. */
  async #negotiate(extra, headers) {
    const pc = new RTCPeerConnection({ iceServers: [] });
    this.pc = pc;
    for (const track of this.mic.getAudioTracks()) pc.addTrack(track, this.mic);
    // The data channel must exist before the offer so that it is negotiated with it.
    const channel = pc.createDataChannel("events");
    this.channel = channel;
    channel.addEventListener("open", () => this.handlers.onOpen?.());
    channel.addEventListener("message", (e) => this.#onMessage(e));
    channel.addEventListener("close", () => {
      if (this.pc !== pc || this.closed) return;
      if (this.serverClosed) this.#finish("data channel closed");
      else this.#pathLost("data channel closed");
    });
    pc.addEventListener("track", (e) => this.handlers.onTrack?.(e.streams[0] ?? new MediaStream([e.track])));
    pc.addEventListener("connectionstatechange", () => {
      if (this.pc !== pc) return;
      this.handlers.onState?.(pc.connectionState);
      clearTimeout(this.disconnectedTimer);
      if (pc.connectionState === "failed") this.#pathLost("connection failed");
      else if (pc.connectionState === "disconnected") {
        this.disconnectedTimer = setTimeout(() => {
          if (this.pc === pc && pc.connectionState === "disconnected") this.#pathLost("connection interrupted");
        }, DISCONNECTED_GRACE_MS);
      }
    });

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc);
    if (this.closed) return null;
    let response;
    try {
      response = await fetch(`${this.baseUrl}/v1/rtc/offer`, {
        method: "POST",
        headers: { "Content-Type": "application/json", ...headers },
        body: JSON.stringify({ type: "offer", sdp: pc.localDescription.sdp, ...extra }),
      });
    } catch (err) {
      throw new SignalingError(`Cannot reach the server: ${err.message}`);
    }
    if (!response.ok) throw await readError(response);
    return response.json();
  }

  /** The media path is gone but the session may live on at the server: offer again, resuming it. */
  async #pathLost(why) {
    if (this.closed || this.reconnecting) return;
    if (!this.sessionId || !this.sessionToken) {
      this.#finish(why === "connection failed" ? "connection failed (no route to the server's media port?)" : why);
      return;
    }
    this.reconnecting = true;
    const deadline = Date.now() + RESUME_WINDOW_MS;
    let delayMs = 500;
    for (let attempt = 1; !this.closed && Date.now() < deadline; attempt += 1) {
      this.handlers.onReconnecting?.(attempt, why);
      const old = this.pc;
      setTimeout(() => old?.close(), 0);
      try {
        // The session's own token is the credential, sent before anything else is read.
        const resume = { session_id: this.sessionId, last_seq: this.lastSeq };
        const answer = await this.#negotiate({ resume }, { Authorization: `Bearer ${this.sessionToken}` });
        if (!answer || this.closed) return;
        await this.pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
        this.reconnecting = false;
        this.resumes += 1;
        this.handlers.onResumed?.();
        return;
      } catch (err) {
        if (err instanceof SignalingError && [401, 404].includes(err.status)) {
          this.reconnecting = false;
          this.#finish(`the session could not be resumed (${err.message})`);
          return;
        }
      }
      await new Promise((resolve) => setTimeout(resolve, delayMs));
      delayMs = Math.min(delayMs * 2, 5000);
    }
    this.reconnecting = false;
    this.#finish(`${why}; reconnecting gave up`);
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
    if (typeof event.seq === "number") {
      if (event.seq <= this.lastSeq) return; // already seen: a resume replays from the journal
      this.lastSeq = event.seq;
    }
    if (event.type === "session.closed") this.serverClosed = true;
    this.handlers.onEvent?.(event);
  }

  #finish(reason) {
    if (this.closed) return;
    this.closed = true;
    clearTimeout(this.disconnectedTimer);
    // Let a queued session.close leave before the transport goes away.
    const pc = this.pc;
    setTimeout(() => pc?.close(), 100);
    this.mic?.getTracks().forEach((t) => t.stop());
    this.handlers.onClose?.(reason);
  }
}
