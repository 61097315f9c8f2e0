// Level meters: an AnalyserNode on a MediaStream, read on demand.

export class LevelMeter {
  /**
   * @param {AudioContext} context
   * @param {MediaStream} stream
   */
  constructor(context, stream) {
    this.source = context.createMediaStreamSource(stream);
    this.analyser = context.createAnalyser();
    this.analyser.fftSize = 1024;
    this.analyser.smoothingTimeConstant = 0;
    this.buffer = new Float32Array(this.analyser.fftSize);
    // Analysis only: nothing is connected to the destination, playback is the <audio> element's job.
    this.source.connect(this.analyser);
  }

  /** RMS of the most recent ~21 ms (1024 samples at 48 kHz), 0..1. */
  rms() {
    this.analyser.getFloatTimeDomainData(this.buffer);
    let sum = 0;
    for (const x of this.buffer) sum += x * x;
    return Math.sqrt(sum / this.buffer.length);
  }

  disconnect() {
    this.source.disconnect();
  }
}

/** Maps an RMS value to 0..1 on a -60..0 dBFS scale, the range a speech meter is useful over. */
export function meterFraction(rms) {
  if (rms <= 0) return 0;
  const db = 20 * Math.log10(rms);
  return Math.min(1, Math.max(0, (db + 60) / 60));
}
