// The latency tester's audio thread: it writes the probe sounds into the call's outgoing track and
// listens to the call's incoming audio, both on one clock (the AudioContext's sample frames), so a
// latency is a difference of two frame numbers: no timers, no main-thread scheduling in it.
//
// Messages in:  {type: "templates", templates: Float32Array[]}   what "probe" mode listens for
//               {type: "mode", mode: "probe" | "response", threshold}
//               {type: "play", id, samples: Float32Array, at?}     play from frame `at` (default: next block)
//               {type: "arm", afterFrame}                          response mode: report the first sound after it
// Messages out: {type: "sent", id, frame, endFrame}                the sound's first and one-past-last frame
//               {type: "heard", signature, frame, score}           probe mode: a template starts at `frame`
//               {type: "answer", frame, rms}                       response mode: first answer audio at `frame`
//               {type: "level", peak, frame}                       the incoming audio's peak, 4 times a second

const GATE_RMS = 0.003; // below this the input is silence: no correlation is computed
const SCORE = 0.5; // normalised correlation that counts as the probe (time-stretching lowers it)
const ANSWER_WINDOW = 240; // 5 ms at 48 kHz: the RMS window that decides "answer audio has started"

class LatencyProbe extends AudioWorkletProcessor {
  constructor() {
    super();
    this.templates = []; // {samples, norm}
    this.mode = "probe";
    this.answerRms = 0.01;
    this.queue = []; // sounds to play: {id, samples, at}
    this.history = null; // the last `length` input samples (ring) for the matched filter
    this.length = 0;
    this.pos = 0; // frames written into history so far
    this.energy = 0; // sum of squares of the history window
    this.candidate = null; // probe mode: the best score since the threshold was crossed
    this.armedAfter = null; // response mode: listen from this frame on
    this.answerEnergy = 0;
    this.answerRing = new Float32Array(ANSWER_WINDOW);
    this.peak = 0; // of the incoming audio since the last level report
    this.nextLevelAt = 0;
    this.port.onmessage = (e) => this.#onMessage(e.data);
  }

  #onMessage(msg) {
    if (msg.type === "templates") {
      this.templates = msg.templates.map((samples) => {
        let sum = 0;
        for (const x of samples) sum += x * x;
        return { samples, norm: Math.sqrt(sum) };
      });
      this.length = Math.max(...this.templates.map((t) => t.samples.length));
      this.history = new Float32Array(this.length);
      this.pos = 0;
      this.energy = 0;
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

  // Matched filter: after each input sample, the normalised correlation of the newest `length`
  // samples with each template. Only while something is heard (the gate), so silence costs nothing.
  #listenForProbes(input, start) {
    const h = this.history;
    const len = this.length;
    for (let i = 0; i < input.length; i++) {
      const slot = this.pos % len;
      this.energy += input[i] * input[i] - h[slot] * h[slot];
      h[slot] = input[i];
      this.pos++;
      if (this.energy < 0) this.energy = 0;
      const frame = start + i; // the frame of the newest sample
      if (this.energy < GATE_RMS * GATE_RMS * len) {
        this.#flushCandidate(frame);
        continue;
      }
      let best = null;
      for (let t = 0; t < this.templates.length; t++) {
        const tpl = this.templates[t];
        const m = tpl.samples.length;
        // history holds samples pos-len .. pos-1; template sample 0 aligns with pos-m.
        let dot = 0;
        let base = (this.pos - m) % len;
        for (let k = 0; k < m; k++) {
          dot += tpl.samples[k] * h[(base + k) % len];
        }
        const score = dot / (tpl.norm * Math.sqrt(this.energy) + 1e-12);
        if (score >= SCORE && (!best || score > best.score)) best = { signature: t, score, frame: frame - m + 1 };
      }
      if (best && (!this.candidate || best.score > this.candidate.score)) this.candidate = best;
      // The peak is final once a whole template length has passed without a better score.
      else if (this.candidate && frame - this.candidate.frame > 2 * len) this.#flushCandidate(frame);
    }
  }

  #flushCandidate() {
    if (!this.candidate) return;
    this.port.postMessage({ type: "heard", ...this.candidate });
    this.candidate = null;
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
