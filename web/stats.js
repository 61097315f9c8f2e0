// Latency figures from RTCPeerConnection.getStats() and the server's `metrics` events.

function selectedPair(report) {
  for (const s of report.values()) {
    if (s.type === "transport" && s.selectedCandidatePairId) return report.get(s.selectedCandidatePairId);
  }
  // Browsers without transport stats: the nominated pair that works.
  for (const s of report.values()) {
    if (s.type === "candidate-pair" && (s.selected || (s.nominated && s.state === "succeeded"))) return s;
  }
  return null;
}

function firstOfType(report, type) {
  for (const s of report.values()) {
    if (s.type === type && (s.kind ?? s.mediaType) === "audio") return s;
  }
  return null;
}

/**
 * Condenses one getStats() report. `previous` is the last result (or null): jitter-buffer delay and
 * received power are given over the interval between the two, so they follow changes; cumulative
 * averages would hide them after the first minute.
 */
export function readStats(report, previous = null) {
  const pair = selectedPair(report);
  const inbound = firstOfType(report, "inbound-rtp");
  const remoteInbound = firstOfType(report, "remote-inbound-rtp");
  const out = { at: performance.now() };

  // ICE consent checks measure the path itself; RTCP receiver reports are the fallback.
  if (pair?.currentRoundTripTime !== undefined) out.rttMs = pair.currentRoundTripTime * 1000;
  else if (remoteInbound?.roundTripTime !== undefined) out.rttMs = remoteInbound.roundTripTime * 1000;

  if (inbound) {
    out.jitterBufferDelay = inbound.jitterBufferDelay ?? 0;
    out.jitterBufferEmittedCount = inbound.jitterBufferEmittedCount ?? 0;
    out.concealedSamples = inbound.concealedSamples ?? 0;
    out.totalSamplesReceived = inbound.totalSamplesReceived ?? 0;
    out.totalAudioEnergy = inbound.totalAudioEnergy ?? 0;
    out.totalSamplesDuration = inbound.totalSamplesDuration ?? 0;
    out.audioLevel = inbound.audioLevel ?? 0;
    out.packetsLost = inbound.packetsLost ?? 0;
    out.packetsReceived = inbound.packetsReceived ?? 0;
    out.networkJitterMs = (inbound.jitter ?? 0) * 1000;

    const dCount = out.jitterBufferEmittedCount - (previous?.jitterBufferEmittedCount ?? 0);
    const dDelay = out.jitterBufferDelay - (previous?.jitterBufferDelay ?? 0);
    if (dCount > 0) out.jitterBufferMs = (dDelay / dCount) * 1000;
    else if (out.jitterBufferEmittedCount > 0) out.jitterBufferMs = (out.jitterBufferDelay / out.jitterBufferEmittedCount) * 1000;

    out.concealedPct = out.totalSamplesReceived > 0 ? (100 * out.concealedSamples) / out.totalSamplesReceived : 0;

    // Mean power of what was received since the last sample: totalAudioEnergy integrates
    // audioLevel² over time, so its slope is the power over that interval.
    const dEnergy = out.totalAudioEnergy - (previous?.totalAudioEnergy ?? 0);
    const dDuration = out.totalSamplesDuration - (previous?.totalSamplesDuration ?? 0);
    if (dDuration > 0) out.receivedRms = Math.sqrt(Math.max(0, dEnergy) / dDuration);
  }
  return out;
}

/**
 * Estimated mouth-to-ear delay: the delays a sound the user makes goes through until the engine's
 * audio that answers it reaches the user's ear, excluding the engine's own decision of when to
 * answer and the audio devices' capture/output latency (browsers do not report them for WebRTC
 * audio).
 *
 * Network: uplink ≈ RTT/2 and downlink ≈ RTT/2. Server: the window the sample waits in (the window
 * length, the worst case), queue wait and step time (the vocoder runs inside the step). Client: the
 * jitter buffer.
 *
 * Not in it: the server's playout buffer. Its depth is answer audio the engine has already made
 * ahead of real time and that is waiting for its turn to play (an interruption drops it); it says
 * how much of the answer is still to come, not how long the path takes, so it is shown apart as
 * "answer queued" (`answerQueuedMs`).
 */
export function mouthToEar({ rttMs, jitterBufferMs, server }) {
  if (rttMs === undefined || jitterBufferMs === undefined || !server) return null;
  const parts = [
    ["uplink (RTT/2)", rttMs / 2],
    ["server window", server.deadline_ms ?? 0],
    ["queue wait", server.queue_wait_ms ?? 0],
    ["engine step", server.step_ms ?? 0],
    ["downlink (RTT/2)", rttMs / 2],
    ["jitter buffer", jitterBufferMs],
  ];
  return { totalMs: parts.reduce((sum, [, ms]) => sum + ms, 0), parts };
}

/** Answer audio waiting in the server's playout buffer (mean of recent windows), or undefined. */
export function answerQueuedMs(server) {
  return server?.playout_depth_ms;
}
