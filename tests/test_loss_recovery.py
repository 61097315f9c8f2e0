"""Loss on the uplink must not leave delay behind (the aiortc jitter buffer keeps ~200 ms for good).

Measured in samples of the audio clocks, not wall time: for each chirp, the distance between where
it sits in the uplink stream and where it comes back in the downlink stream. The outbound track is
paced by the server's clock, so any delay the path keeps shows up as a larger distance.

Each phase is summed up by its second-least distance: a delay the path keeps raises every chirp
after it, while a passing stall of a busy test machine raises only some of them; and on a busy
machine one detection has come earlier than any chirp can come back (a chirp-like sound where none
was sent), so the least alone is not trusted.
"""

from __future__ import annotations

import time

import numpy as np

from conftest import running_server
from lychee_rtc.bench.client import RATE, LinkImpairment, RtcClient
from lychee_rtc.bench.probes import chirp, find_onsets, matched_filter
from lychee_rtc.server.app import REGISTRY_KEY

INTERVAL = RATE // 2


def test_probe_detection_is_exact():
    probe = chirp()
    signal = np.zeros(RATE * 2, np.float32)
    for at in (1000, 30000, 70001):
        signal[at:at + len(probe)] += probe
    signal += np.random.default_rng(0).normal(0, 0.01, len(signal)).astype(np.float32)
    assert find_onsets(signal, probe) == [1000, 30000, 70001]
    assert matched_filter(signal, probe).max() <= 1.0 + 1e-6


async def _distances(jitter_buffer: str, loss: float = 0.15,
                     stall_s: float = 0.0) -> tuple[list[int], list[int], int, dict]:
    """The distances before and after a middle phase with ``loss`` on the uplink, which starts
    with a stall of the whole process (client and server) of ``stall_s``."""
    async with running_server("configs/loopback.yaml", rtc={"jitter_buffer": jitter_buffer}) as (url, app):
        client = RtcClient(url)
        await client.connect()
        try:
            probe = chirp()
            phases = (8, 8, 8)  # clean, impaired, after
            total = sum(phases)
            schedule = np.zeros(RATE + total * INTERVAL, np.float32)
            for k in range(total):
                schedule[RATE + k * INTERVAL:RATE + k * INTERVAL + len(probe)] = probe
            start = client.mic.feed(schedule) * RATE
            impairment = LinkImpairment(loss=0.0, seed=3)
            client.impair_uplink(impairment)
            # Phases follow the uplink's own clock (samples sent), not the wall clock.
            await client.wait_sent(int(start + RATE + phases[0] * INTERVAL))
            impairment.loss = loss
            if stall_s:
                time.sleep(stall_s)  # blocks the event loop: a long collection, a starved CPU
            await client.wait_sent(int(start + RATE + (phases[0] + phases[1]) * INTERVAL))
            impairment.loss = 0.0
            await client.wait_sent(int(start + len(schedule) + RATE))
            # Everything sent has come back (the loopback engine answers each 20 ms at once).
            await client.wait_audio(client.received.end + RATE)
            onsets = find_onsets(client.received.signal(), probe)
            call = next(iter(app[REGISTRY_KEY].calls.values()))
            lost = call.inbound.gaps
            counters = call.snapshot()["counters"] | {"trimmed_samples": call.track.counters.trimmed_samples}
        finally:
            await client.close()
    # Chirps come back in order; pair each with its uplink position by order, skipping any the loss
    # ate (their distance would jump by a whole interval).
    up = [RATE + k * INTERVAL for k in range(total)]
    base = onsets[0] - up[0]
    distances = []
    for onset in onsets:
        k = round((onset - base - RATE) / INTERVAL)
        if 0 <= k < total:
            distances.append((k, onset - up[k]))
    before = [d for k, d in distances if k < phases[0]]
    after = [d for k, d in distances if k >= phases[0] + phases[1] + 2]
    return before, after, lost, counters


def _kept_ms(before: list[int], after: list[int]) -> float:
    assert len(before) >= 6 and len(after) >= 4, f"too few chirps came back: {before} / {after}"
    return (sorted(after)[1] - sorted(before)[1]) / RATE * 1000


async def test_uplink_loss_leaves_no_lasting_delay():
    before, after, lost, counters = await _distances("lowlatency")
    assert lost > 0, "the emulated loss never reached the server"
    kept = _kept_ms(before, after)
    # aiortc's buffer keeps ~200 ms after a loss (below); ours must be back within a packet or two.
    assert kept < 45, f"{kept:.0f} ms of delay kept after the loss; distances {before} / {after}; {counters}"


async def test_a_stalled_server_keeps_no_delay():
    """A stall too long to catch up on is skipped: the slots it took go unsent, and the downlink's
    timestamps jump over them. Sent late with unbroken timestamps instead, every later packet reads
    as that much late to the caller's jitter buffer, which keeps it (the delay shows here too)."""
    before, after, _, counters = await _distances("lowlatency", loss=0.0, stall_s=0.4)
    assert counters["outbound_skipped_frames"] > 0, counters
    kept = _kept_ms(before, after)
    assert abs(kept) < 45, f"{kept:.0f} ms of delay kept after the stall; distances {before} / {after}; {counters}"


async def test_the_measure_sees_the_delay_aiortc_keeps():
    """The same call through aiortc's own jitter buffer, which keeps the depth a loss gave it: the
    measure above must see that, or its passing says nothing."""
    before, after, lost, counters = await _distances("aiortc")
    assert lost > 0, "the emulated loss never reached the server"
    kept = _kept_ms(before, after)
    assert kept > 100, f"{kept:.0f} ms kept; distances {before} / {after}; {counters}"


def test_a_faint_chirp_shape_is_not_a_probe():
    # Shapes 80 dB below the probe (what a decoder may leave in digital silence) score like a chirp
    # in the normalised filter, but are not one.
    probe = chirp()
    signal = np.zeros(RATE, np.float32)
    signal[1000:1000 + len(probe)] += probe
    signal[20000:20000 + len(probe)] += 1e-4 * probe
    assert find_onsets(signal, probe) == [1000]
