"""Hold and resume of a phone call: a re-INVITE through Janus (``hold`` / ``unhold``), the session paused.

Janus's ``hold`` sends the caller a re-INVITE with ``a=inactive`` (silence: neither side sends) or
``a=sendonly`` (we keep sending: the configured music on hold, ``gateway.janus.hold_audio``, looped
into the call's outbound track); ``unhold`` restores the previous direction.
While held the session's uplink clock is stopped, so the engine is given no windows (none count
as underruns) and what it was saying is cut; the media timeout does not run.
"""

from __future__ import annotations

import asyncio
import logging
import wave
from pathlib import Path
from typing import Any

import numpy as np

from lychee_rtc.gateway.janus_api import JanusError
from lychee_rtc.pcm import PcmResampler
from lychee_rtc.gateway.errors import CallActionRefused

log = logging.getLogger(__name__)

DIRECTIONS = ("inactive", "sendonly")
HOLD_RESPONSE_ID = "hold_audio"  # the sink's name for the music (no response of the session has it)
HOLD_CHUNK_S = 0.2
HOLD_DEPTH_MS = 600.0  # kept queued ahead: enough to ride out a busy loop, little to cut on resume
MAX_HOLD_AUDIO_S = 600


def load_hold_audio(path: Path, rate: int) -> np.ndarray:
    """A 16-bit PCM WAV as mono float32 at ``rate`` (the engine's output rate, what the sink takes)."""
    with wave.open(str(path)) as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: hold audio must be 16-bit PCM")
        frames = min(w.getnframes(), MAX_HOLD_AUDIO_S * w.getframerate())
        pcm = np.frombuffer(w.readframes(frames), "<i2").astype(np.float32) / 32768.0
        pcm = pcm.reshape(-1, w.getnchannels()).mean(axis=1)
        source = w.getframerate()
    if source == rate:
        return pcm
    resampler = PcmResampler(source, rate)
    try:
        return np.concatenate([resampler.process(pcm), resampler.flush()]).astype(np.float32)
    finally:
        resampler.close()


async def play_hold_audio(session: Any, audio: np.ndarray, rate: int) -> None:
    """Loop ``audio`` into the session's sink while the call is held (the epoch of the hold)."""
    epoch, chunk, position = session.epoch, max(1, int(rate * HOLD_CHUNK_S)), 0
    while session.on_hold and not session.closed and session.epoch == epoch and len(audio):
        if session.sink.depth_ms >= HOLD_DEPTH_MS:
            await asyncio.sleep(HOLD_CHUNK_S / 2)
            continue
        piece = np.take(audio, np.arange(position, position + chunk), mode="wrap")
        position = (position + chunk) % len(audio)
        if not session.sink.write(epoch, HOLD_RESPONSE_ID, piece):
            return
        await asyncio.sleep(0)


async def set_hold(gateway: Any, session_id: str, held: bool, direction: str | None = None) -> bool:
    """Hold or resume the gateway's call ``session_id``; False when it already was so. ``direction``:
    default sendonly with music on hold configured, else inactive."""
    music = gateway.settings.hold_audio
    direction = direction or ("sendonly" if music is not None else "inactive")
    line = gateway.transfers.line_of(session_id)
    call = gateway.registry.calls.get(session_id)
    if line is None or call is None or call.session.closed:
        raise CallActionRefused(409, "not_a_phone_call", "only an answered phone call through the SIP gateway "
                                                       "can be put on hold")
    if direction not in DIRECTIONS:
        raise CallActionRefused(400, "invalid_direction", f"direction must be one of {list(DIRECTIONS)}")
    session = call.session
    if session.on_hold == held:
        return False
    api = gateway._api
    if api is None:
        raise CallActionRefused(503, "gateway_unavailable", "the connection to Janus is down")
    body = {"request": "hold", "direction": direction} if held else {"request": "unhold"}
    try:
        await api.message(line.handle_id, body)
    except (JanusError, ConnectionError, asyncio.TimeoutError) as exc:
        raise CallActionRefused(502, "gateway_error", f"Janus refused the {body['request']}: {exc}") from None
    # The session follows at once: the re-INVITE's answer changes nothing we do with the audio.
    if held:
        session.hold()
        if music is not None and direction == "sendonly":
            rate = session.capabilities.output_rate
            if gateway.hold_audio is None:
                gateway.hold_audio = load_hold_audio(music, rate)
            call.tasks.append(asyncio.create_task(play_hold_audio(session, gateway.hold_audio, rate),
                                                  name=f"hold-audio-{session_id}"))
    else:
        session.unhold()
    log.info("SIP gateway: session %s %s", session_id, f"on hold ({direction})" if held else "taken off hold")
    return True
