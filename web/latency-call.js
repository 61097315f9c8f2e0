// The latency tester's call: the server's JSON offer/answer (rtc.js), or WHIP where that is all a
// server offers. Either way the page gets a peer connection sending `stream` and a close().

import { RtcCall, SignalingError, iceGatheringComplete } from "./rtc.js";

/** WHIP (RFC 9725) for servers that offer only that: one POST of the SDP, DELETE of the resource. */
async function connectWhip(baseUrl, token, stream, onTrack) {
  const pc = new RTCPeerConnection({ iceServers: [] });
  pc.addTransceiver(stream.getAudioTracks()[0], { direction: "sendrecv", streams: [stream] });
  pc.addEventListener("track", (e) => onTrack(e.streams[0] ?? new MediaStream([e.track])));
  await pc.setLocalDescription(await pc.createOffer());
  await iceGatheringComplete(pc);
  const endpoint = `${baseUrl || location.origin}/whip`;
  const auth = token ? { Authorization: `Bearer ${token}` } : {};
  const response = await fetch(endpoint, {
    method: "POST", headers: { "Content-Type": "application/sdp", ...auth }, body: pc.localDescription.sdp,
  });
  if (response.status !== 201) {
    pc.close();
    throw new SignalingError(`WHIP endpoint answered ${response.status} ${response.statusText}`, { status: response.status });
  }
  const resource = response.headers.get("Location"); // absent cross-origin unless the server exposes it
  await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
  return {
    pc,
    close() {
      if (resource) fetch(new URL(resource, endpoint), { method: "DELETE" }).catch(() => {});
      pc.close();
    },
  };
}

/** JSON offer/answer (the server's own endpoint), or WHIP when asked or when that is all there is. */
export async function connect(baseUrl, token, signaling, stream, onTrack) {
  if (signaling !== "whip") {
    const call = new RtcCall({ onTrack });
    try {
      await call.connect({ baseUrl, token, stream });
      return { pc: call.pc, close: () => call.close(), signaling: "offer" };
    } catch (err) {
      const missing = err instanceof SignalingError && [404, 405].includes(err.status);
      if (signaling === "offer" || !missing) throw err;
    }
  }
  return { ...(await connectWhip(baseUrl, token, stream, onTrack)), signaling: "whip" };
}
