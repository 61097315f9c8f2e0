// The latency tester's matched filter: where in a stretch of incoming audio each probe sound starts.
//
// It runs on the page's main thread, not on the audio thread. A normalised correlation at every
// sample costs about a million multiplies per 128-frame render quantum, several times the quantum's
// 2.7 ms budget; run in the AudioWorklet, it stalled Chromium's audio thread at every echo, which
// made the outgoing packets bunch up and raised the receiver's jitter buffer by tens of
// milliseconds: the tester slowed down the path it was measuring. The worklet only cuts the
// segments (the frames around sound) and this finds the probes in them; the frame numbers are
// still the worklet's.

export const SCORE = 0.5; // normalised correlation that counts as the probe (time-stretching lowers it)
export const GATE_RMS = 0.003; // below this (over one window) the input is silence: no correlation

/**
 * Probes found in `samples` (incoming audio whose sample 0 is AudioContext frame `frame`), as
 * {signature, frame, score}: every position where a template's normalised correlation with the
 * newest `window` samples reaches SCORE and is the best within one window either side.
 * `templates` are Float32Arrays; `window` (default: the longest template) is the energy window the
 * score is normalised by and the gate (GATE_RMS) is applied to, as in the worklet.
 */
export function findProbes(samples, frame, templates, window = Math.max(...templates.map((t) => t.length))) {
  const gate = GATE_RMS * GATE_RMS * window;
  const norms = templates.map((t) => Math.sqrt(t.reduce((s, x) => s + x * x, 0)));
  const best = []; // per end position: {score, signature} or null
  let energy = 0;
  for (let e = 0; e < samples.length; e++) {
    energy += samples[e] * samples[e] - (e >= window ? samples[e - window] * samples[e - window] : 0);
    if (energy < 0) energy = 0;
    let top = null;
    if (energy >= gate) {
      for (let t = 0; t < templates.length; t++) {
        const tpl = templates[t];
        const m = tpl.length;
        if (e + 1 < m) continue;
        let dot = 0;
        for (let k = 0, j = e - m + 1; k < m; k++, j++) dot += tpl[k] * samples[j];
        const score = dot / (norms[t] * Math.sqrt(energy) + 1e-12);
        if (score >= SCORE && (!top || score > top.score)) top = { score, signature: t, start: e - m + 1 };
      }
    }
    best.push(top);
  }
  const found = [];
  for (let e = 0; e < best.length; e++) {
    const here = best[e];
    if (!here) continue;
    let peak = true;
    for (let d = Math.max(0, e - window); d <= Math.min(best.length - 1, e + window) && peak; d++) {
      const other = best[d];
      // Ties go to the earliest position, so a flat top is reported once.
      if (other && (other.score > here.score || (other.score === here.score && d < e))) peak = false;
    }
    if (peak) found.push({ signature: here.signature, frame: frame + here.start, score: here.score });
  }
  return found;
}
