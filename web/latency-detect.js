// The latency tester's matched filter: where in a stretch of incoming audio each probe sound starts.
//
// It runs on the page's main thread, not on the audio thread. A normalised correlation at every
// sample costs about a million multiplies per 128-frame render quantum, several times the quantum's
// 2.7 ms budget; run in the AudioWorklet, it stalled Chromium's audio thread at every echo, which
// made the outgoing packets bunch up and raised the receiver's jitter buffer by tens of
// milliseconds: the tester slowed down the path it was measuring. The worklet only cuts the
// segments (the frames around sound) and this finds the probes in them; the frame numbers are
// still the worklet's. It correlates through the spectrum (a few FFTs per segment, not a dot
// product per sample and template), so that on a small machine it takes little CPU from the
// browser's and the server's media threads either.

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
  const n = samples.length;
  // energy[e]: the newest `window` samples' energy, ending at sample e.
  const energy = new Float64Array(n);
  for (let e = 0, sum = 0; e < n; e++) {
    sum += samples[e] * samples[e] - (e >= window ? samples[e - window] * samples[e - window] : 0);
    energy[e] = Math.max(sum, 0);
  }
  let size = 1;
  while (size < n) size *= 2;
  const spectrum = fft(realToComplex(samples, size), false);
  const best = new Array(n).fill(null); // per end position: {score, signature, start}
  templates.forEach((tpl, t) => {
    const m = tpl.length;
    if (m > n) return;
    const norm = Math.sqrt(tpl.reduce((sum, x) => sum + x * x, 0));
    // Cross-correlation through the spectrum: dot[j] = sum_k tpl[k] * samples[j + k], for the
    // starts j that keep the template inside the segment (no wrap-around there).
    const product = fft(realToComplex(tpl, size), false);
    for (let i = 0; i < size; i++) { // spectrum times the template's conjugate spectrum
      const re = spectrum.re[i] * product.re[i] + spectrum.im[i] * product.im[i];
      const im = spectrum.im[i] * product.re[i] - spectrum.re[i] * product.im[i];
      product.re[i] = re;
      product.im[i] = im;
    }
    const dot = fft(product, true).re;
    for (let j = 0; j + m <= n; j++) {
      const e = j + m - 1;
      if (energy[e] < gate) continue;
      const score = dot[j] / (norm * Math.sqrt(energy[e]) + 1e-12);
      if (score >= SCORE && (!best[e] || score > best[e].score)) best[e] = { score, signature: t, start: j };
    }
  });
  const found = [];
  for (let e = 0; e < n; e++) {
    const here = best[e];
    if (!here) continue;
    let peak = true;
    for (let d = Math.max(0, e - window); d <= Math.min(n - 1, e + window) && peak; d++) {
      const other = best[d];
      // Ties go to the earliest position, so a flat top is reported once.
      if (other && (other.score > here.score || (other.score === here.score && d < e))) peak = false;
    }
    if (peak) found.push({ signature: here.signature, frame: frame + here.start, score: here.score });
  }
  return found;
}

function realToComplex(x, size) {
  const re = new Float64Array(size);
  re.set(x);
  return { re, im: new Float64Array(size) };
}

/** In-place iterative radix-2 FFT of {re, im} (length a power of two); `inverse` scales by 1/size. */
export function fft(z, inverse) {
  const { re, im } = z;
  const size = re.length;
  for (let i = 1, j = 0; i < size; i++) { // bit-reversal permutation
    let bit = size >> 1;
    for (; j & bit; bit >>= 1) j ^= bit;
    j ^= bit;
    if (i < j) {
      [re[i], re[j]] = [re[j], re[i]];
      [im[i], im[j]] = [im[j], im[i]];
    }
  }
  for (let len = 2; len <= size; len *= 2) {
    const angle = ((inverse ? 2 : -2) * Math.PI) / len;
    const wRe = Math.cos(angle);
    const wIm = Math.sin(angle);
    for (let i = 0; i < size; i += len) {
      let uRe = 1;
      let uIm = 0;
      for (let k = 0; k < len / 2; k++) {
        const a = i + k;
        const b = a + len / 2;
        const tRe = re[b] * uRe - im[b] * uIm;
        const tIm = re[b] * uIm + im[b] * uRe;
        re[b] = re[a] - tRe;
        im[b] = im[a] - tIm;
        re[a] += tRe;
        im[a] += tIm;
        const next = uRe * wRe - uIm * wIm;
        uIm = uRe * wIm + uIm * wRe;
        uRe = next;
      }
    }
  }
  if (inverse) {
    for (let i = 0; i < size; i++) {
      re[i] /= size;
      im[i] /= size;
    }
  }
  return z;
}
