// The latency tester's audio thread: it writes the probe sounds into the call's outgoing track and
// records the call's incoming audio, both on one clock (the AudioContext's sample frames), so a
// latency is a difference of two frame numbers: no timers, no main-thread scheduling in it.
//
// The work per sample here is a few operations: the matched filter that finds the probes in what
// was recorded runs on the main thread (latency-detect.js), because on this thread it stalled the
// audio clock that paces the outgoing track.
//
// Messages in:  {type: "listen", window, gateRms}                    probe mode: cut segments (below)
//               {type: "mode", mode: "probe" | "response", threshold}
//               {type: "play", id, samples: Float32Array, at?}     play from frame `at` (default: next block)
//               {type: "arm", afterFrame}                          response mode: report the first sound after it
// Messages out: {type: "sent", id, frame, endFrame}                the sound's first and one-past-last frame
//               {type: "segment", frame, samples}                  probe mode: incoming audio around a sound,
//                                                                  from one window before it to one window after
//               {type: "answer", frame, rms}                       response mode: first answer audio at `frame`
//               {type: "level", peak, frame}                       the incoming audio's peak, 4 times a second

const ANSWER_WINDOW = 240; // 5 ms at 48 kHz: the RMS window that decides "answer audio has started"
const MAX_SEGMENT_S = 0.5; // a longer sound is cut into segments that overlap by one window

class LatencyProbe extends AudioWorkletProcessor {
  constructor() {
    super();
    this.mode = "probe";
    this.answerRms = 0.01;
    this.queue = []; // sounds to play: {id, samples, at}
    this.history = null; // the last `length` input samples (ring): the gate's window
    this.length = 0;
    this.gate = 0; // the window's energy at the gate's RMS
    this.pos = 0; // frames written into history so far
    this.energy = 0; // sum of squares of the history window
    this.segment = null; // probe mode: {frame, samples, used, quiet} being recorded
    this.armedAfter = null; // response mode: listen from this frame on
    this.answerEnergy = 0;
    this.answerRing = new Float32Array(ANSWER_WINDOW);
    this.peak = 0; // of the incoming audio since the last level report
    this.nextLevelAt = 0;
    this.port.onmessage = (e) => this.#onMessage(e.data);
  }

  #onMessage(msg) {
    if (msg.type === "listen") {
      this.length = msg.window;
      this.gate = msg.gateRms * msg.gateRms * msg.window;
      this.history = new Float32Array(this.length);
      this.pos = 0;
      this.energy = 0;
      this.segment = null;
    } else if (msg.type === "mode") {
      this.mode = msg.mode;
      if (msg.threshold) this.answerRms = msg.threshold;
    } else if (msg.type === "play") {
      this.queue.push({ id: msg.id, samples: msg.samples, at: msg.at ?? null, reported: false });
    } else if (msg.type === "arm") {
      this.armedAfter = msg.afterFrame;
      this.answerEnergy = 0;
      this.answerRing.fill(0);
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    const start = currentFrame; // the frame of out[0] and of input[0]
    if (out) this.#play(out, start);
    const input = inputs[0]?.[0];
    if (input) {
      for (const x of input) this.peak = Math.max(this.peak, Math.abs(x));
      if (this.mode === "probe" && this.history) this.#listenForProbes(input, start);
      else if (this.mode === "response" && this.armedAfter !== null) this.#listenForAnswer(input, start);
    }
    if (start >= this.nextLevelAt) {
      this.port.postMessage({ type: "level", peak: this.peak, frame: start });
      this.peak = 0;
      this.nextLevelAt = start + sampleRate / 4;
    }
    return true;
  }

  #play(out, start) {
    const n = out.length;
    this.queue = this.queue.filter((sound) => {
      if (!sound.reported) {
        // A sound asked for a frame already past (or for none) starts now; the report says when.
        if (sound.at === null || sound.at < start) sound.at = start;
        this.port.postMessage({ type: "sent", id: sound.id, frame: sound.at, endFrame: sound.at + sound.samples.length });
        sound.reported = true;
      }
      const from = sound.at - start; // where the sound's sample 0 falls in this block (may be < 0)
      for (let i = Math.max(0, from); i < n && i - from < sound.samples.length; i++) out[i] += sound.samples[i - from];
      return sound.at + sound.samples.length > start + n;
    });
  }

  // The gate: a segment opens when the newest window's energy reaches it, with that window's
  // samples (the sound's onset and what came before), and closes one window after the energy has
  // fallen below it again, so a probe's whole echo and one window of quiet either side are in it.
  #listenForProbes(input, start) {
    const h = this.history;
    const len = this.length;
    for (let i = 0; i < input.length; i++) {
      const slot = this.pos % len;
      this.energy += input[i] * input[i] - h[slot] * h[slot];
      h[slot] = input[i];
      this.pos++;
      if (this.energy < 0) this.energy = 0;
      const loud = this.energy >= this.gate;
      const seg = this.segment;
      if (!seg) {
        if (loud) this.#openSegment(start + i);
        continue;
      }
      seg.samples[seg.used++] = input[i];
      seg.quiet = loud ? 0 : seg.quiet + 1;
      if (seg.quiet >= len) this.#closeSegment();
      else if (seg.used === seg.samples.length) {
        this.#closeSegment();
        this.#openSegment(start + i); // still loud: carry on, overlapping by one window
      }
    }
  }

  // The newest window from the history ring, oldest first; its last sample is frame `frame`.
  #openSegment(frame) {
    const len = this.length;
    const samples = new Float32Array(Math.max(Math.round(MAX_SEGMENT_S * sampleRate), 4 * len));
    for (let k = 0; k < len; k++) samples[k] = this.history[(this.pos + k) % len];
    this.segment = { frame: frame - len + 1, samples, used: len, quiet: 0 };
  }

  #closeSegment() {
    const seg = this.segment;
    this.segment = null;
    const samples = seg.samples.slice(0, seg.used);
    this.port.postMessage({ type: "segment", frame: seg.frame, samples }, [samples.buffer]);
  }

  // Response mode: the first 5 ms window after `armedAfter` whose RMS is above the threshold; the
  // answer starts at that window's first frame.
  #listenForAnswer(input, start) {
    const ring = this.answerRing;
    for (let i = 0; i < input.length; i++) {
      const frame = start + i;
      const slot = frame % ANSWER_WINDOW;
      this.answerEnergy += input[i] * input[i] - ring[slot] * ring[slot];
      ring[slot] = input[i];
      if (frame < this.armedAfter + ANSWER_WINDOW) continue; // the window must lie wholly after the mark
      const rms = Math.sqrt(Math.max(this.answerEnergy, 0) / ANSWER_WINDOW);
      if (rms >= this.answerRms) {
        this.port.postMessage({ type: "answer", frame: frame - ANSWER_WINDOW + 1, rms });
        this.armedAfter = null;
        return;
      }
    }
  }
}

registerProcessor("latency-probe", LatencyProbe);
