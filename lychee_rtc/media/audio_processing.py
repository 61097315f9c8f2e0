"""The uplink's cleaning stage: WebRTC's audio processing module (AEC3 echo canceller, noise
suppression, high-pass filter, gain control) per session, in front of the engine.

The library is the ``livekit`` package's ``AudioProcessingModule`` (the optional ``aec`` extra);
without it, every stage stays off and asking for one is refused (``ProcessingUnavailable``).

Rate: the stage runs at the session's input rate (16 kHz for both engines), after the transport's
own resampling: one rate for 8 kHz phone legs and 48 kHz WebRTC alike, the rate the engine and its
VAD hear, and the cheapest one for AEC3 (a single band; 32 and 48 kHz are split into bands).

The far end: the echo canceller must know what the caller's loudspeaker played. The transports
hand the stage each frame as it leaves (``far_end``), silence between answers included where they
send it, and the stage gives the canceller one 10 ms frame of it before each 10 ms of uplink it
processes: render and capture advance in lockstep, sample for sample, as they do in a phone. So a
stall that holds up both directions at once (a busy event loop, a network hiccup) does not move
one against the other, which a canceller would take as a new echo path and relearn for seconds.
What the transport sent ahead of the caller's playout waits in a queue: a carrier's lead (it plays
what it was sent in real time), and 40 ms against jitter for WebRTC, whose track sends all the time.
More than that standing for half a second is dropped, so the reference never runs late; none there
(a carrier sends nothing between answers) is silence. At an interruption the carrier flushes what
it had not played, and the queue goes too.
AEC3 finds the remaining delay (network, jitter buffers, the room) itself: measured with a 400 ms
echo path (docs/benchmarks.md); its delay search reaches about half a second (docs/echo.md).

Only where there is echo: AEC3 starts a call assuming the echo may be as loud as what the agent
plays, and takes the caller's voice down by up to 40 dB whenever the agent speaks, until it has
found an echo path or, seconds later, concluded there is none. A barge-in is the caller speaking
over the agent, so on a line without echo (most phone calls: handsets and mobiles cancel their own)
it came seconds late or never. The canceller therefore always runs, fed as above, but the engine
hears its output only while ``media/echo_presence.py`` finds the agent's voice coming back; until
then it hears the same stages without the canceller, delayed to match the canceller's own 8 ms so
that switching over does not move the uplink. Where the caller is found talking over the echo,
the engine hears the line as it is, from where they began (``take_revision``: the session puts those
frames back into the window the engine has not heard yet, docs/echo.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lychee_rtc.config import AudioProcessing
from lychee_rtc.media.apm_frames import ApmFrames
from lychee_rtc.media.caller_onset import OnsetWitness, find_onset, rising_into
from lychee_rtc.media.echo_estimate import CERTAIN_WINDOW_FRAMES, FrameEstimate, LinearEchoEstimate
from lychee_rtc.media.echo_presence import EchoPresence
from lychee_rtc.pcm import PcmResampler
from lychee_rtc.session.processing import ProcessingUnavailable

FRAME_MS = 10  # the module processes exactly 10 ms at a time
SUPPORTED_RATES = (8000, 16000, 32000, 48000)
# Far end queued ahead of the uplink, at most (the oldest goes): a carrier's largest lead and more.
MAX_REFERENCE_S = 2.0
# Jitter between the two directions the reference queue absorbs: a sender that never pauses (the
# WebRTC track) starts its reference this much behind, so a frame that leaves a little late does
# not leave the canceller without one (which would shift the reference against the uplink). The
# canceller then sees the echo path this much shorter than it is; no real one is that short.
REFERENCE_JITTER_S = 0.04
# A reference queue standing above its allowance this long is trimmed back to it (the two
# directions started apart, the uplink caught up after a stall): the reference must not run late.
LEAD_WINDOW_FRAMES = 50
# What AEC3 holds back (its 4 ms blocks against 10 ms frames), measured: 128 samples at 16 kHz. The
# path without it is delayed as much, so the uplink keeps its timing when the engine is switched
# from one to the other.
CANCELLER_LAG_MS = 8
# The agent's first sound on a call: from it, the echo's longest delay (0.5 s) and the time its
# search takes (0.1-0.2 s) pass before the engine may hear the line without the canceller.
REFERENCE_AUDIBLE = 1e-3
SETTLE_FRAMES = 70
DOUBLE_TALK_GAIN = 10 ** (-10 / 10)  # within 10 dB of its input through AEC3 ...
DOUBLE_TALK_FRAMES = 3  # ... three frames running: the caller talks
DOUBLE_TALK_FLOOR = 1e-6  # an input below -60 dBFS is no one talking
DOUBLE_TALK_OVER_NOISE = 30.0  # ... nor one less than 15 dB over the line's noise
DOUBLE_TALK_UNDER_PEAK = 0.01  # ... nor one 20 dB under the loudest of the last second
NOISE_WINDOW_FRAMES = 200
DOUBLE_TALK_HOLD_FRAMES = 30  # the line stays as it is this long after the caller was last found
# Settling, the echo not found yet (or none on the line): the caller beyond doubt is at full voice this many
# frames running and correlates with the far end under this at every lag an echo could have. Measured on
# frames at full voice over 50 ms (the bench's room, ``bench/speakerphone.py``): an echo alone 0.47-0.97 (20 s
# of the agent, paths of 50-400 ms, as loud as the agent and 10 dB under), a caller alone 0.06-0.43 (median
# 0.13, 92 % of their frames under this).
UNKNOWN_ECHO_FRAMES = 5
UNLIKE_FAR_END = 0.25
# Double talk is confirmed frames after the caller began, while AEC3 was still taking them down: at
# confirmation the engine is handed the line as it was from where the caller began
# (``media/caller_onset.py``), as far back as this.
ONSET_LOOKBACK_FRAMES = 16
# Where only AEC3's output (or the estimate's residual at its lower bar) placed the onset, the caller had
# begun before it: their first 30-40 ms are 10 dB and more under an echo as loud, which neither shows
# (docs/benchmarks.md, ``bench bargein``). Handed on from this many frames sooner, the engine hears up to
# 30 ms of the line before them, and their first syllable whole.
ONSET_AHEAD_FRAMES = 3
# A trimmed reference queue moves the echo against the reference at once, and AEC3 leaks the echo for
# 0.4-2.3 s while it relearns the path; its double-talk rule fires on the echo alone then. For this
# long after a trim, double talk also needs the linear estimate (kept in place across the trim) to
# show the caller.
MOVED_HOLD_FRAMES = 300
SHOWN_OF_LINE = 10 ** (-6 / 10)  # ... the residual within 6 dB of the line
INSTALL_HINT = "install the 'aec' extra (pip install 'lychee-rtc[aec]')"


def _load_module() -> Any:
    try:
        from livekit.rtc import AudioFrame, AudioProcessingModule
    except ImportError as exc:
        raise ProcessingUnavailable(f"audio processing needs the livekit package: {INSTALL_HINT}") from exc
    return AudioFrame, AudioProcessingModule


def require_library() -> None:
    """Raises ProcessingUnavailable where the library is not installed."""
    _load_module()


@dataclass
class ProcessingCounters:
    frames: int = 0  # 10 ms uplink frames processed
    reference_frames: int = 0  # 10 ms far-end frames given to the canceller
    reference_underruns: int = 0  # ... of which silence, because nothing had left
    reference_trimmed_s: float = 0.0  # far end dropped: standing too far ahead of the uplink
    reference_cut_s: float = 0.0  # far end taken back at interruptions (never reached the caller)
    cancelled_frames: int = 0  # ... of the frames, those the engine heard through the echo canceller
    double_talk_frames: int = 0  # frames where the caller was found talking over the echo
    onset_frames: int = 0  # frames handed on again as the line was: the caller had begun in them


class AudioProcessingStage:
    """One session's processing (``session.processing.UplinkProcessing``) and its far-end reference."""

    def __init__(self, rate: int, settings: AudioProcessing) -> None:
        if rate not in SUPPORTED_RATES:
            raise ValueError(f"audio processing runs at {SUPPORTED_RATES} Hz, not {rate}")
        self.rate = rate
        self.frame = rate * FRAME_MS // 1000
        self.counters = ProcessingCounters()
        self.settings = AudioProcessing()
        self.unavailable: str | None = None  # why a stage that was asked for is not running
        # Set by the transport that feeds it (``EpochSink.attach_reference``): how far ahead of the
        # caller's playout it sends, and whether it sends all the time (silence included).
        self.reference_lead_s = 0.0
        self.reference_continuous = False
        self._referenced = False  # the first far end has come
        self._apm: ApmFrames | None = None
        # With the echo canceller: the other stages without it, and whether the line has echo.
        self._plain: ApmFrames | None = None
        self._plain_delay = np.zeros(0, np.float32)
        self._clear_delay = np.zeros(0, np.float32)  # ... and the line less the linear echo estimate
        self._presence: EchoPresence | None = None
        self._estimate: LinearEchoEstimate | None = None  # our own linear echo estimate (the caller under it)
        self._cancelling = False  # the engine hears the canceller's output
        self._first_sound: int | None = None  # the frame in which the agent was first heard
        self._leaking = 0  # frames running that came through the canceller nearly whole
        self._talk_left = 0  # frames the caller is still taken to talk over the echo
        self._levels: deque[float] = deque(maxlen=NOISE_WINDOW_FRAMES)  # input level of recent frames
        self._loud_run = 0  # frames running at full voice (``_caller_over_echo``)
        # The last frames: the line without the canceller (less the linear estimate where it is trusted), what
        # was handed on, and what tells where the caller began.
        self._recent: deque[tuple[np.ndarray, np.ndarray, OnsetWitness]] = deque(maxlen=ONSET_LOOKBACK_FRAMES)
        self._moved_at: int | None = None  # the frame in which the reference queue was last trimmed
        # The echo search's lag when the queue was trimmed, and the lag it stands at since (until found anew).
        self._lag_moved: tuple[float, float] | None = None
        self._shown: deque[bool] = deque(maxlen=DOUBLE_TALK_FRAMES)  # the linear estimate showed the caller
        self._strong_frames = 0  # ... beyond doubt: the run of frames that showed them so
        self._by_run = False  # ... confirmed by the young estimate's residual over a run at full voice
        self._revision = np.zeros(0, np.float32)  # replaces the end of what was handed on before
        self._pending_onset: np.ndarray | None = None  # ... as found in the frame just processed
        self._held = np.zeros(0, np.float32)  # uplink short of a 10 ms frame
        self._reference = np.zeros(0, np.float32)  # far end not yet given to the canceller
        self._depths: deque[int] = deque(maxlen=LEAD_WINDOW_FRAMES)  # queue depth at recent frames
        self._resampler: PcmResampler | None = None
        self.configure(settings)

    # --- the session's side (session.processing.UplinkProcessing) ----------------------------------

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.settings.model_dump(), "sample_rate": self.rate}
        if self._presence is not None:
            out["echo_detected"] = self._presence.echo
        if self.unavailable:
            out["unavailable"] = self.unavailable
        return out

    def snapshot(self) -> dict[str, Any]:
        return {**self.describe(), "counters": asdict(self.counters)}

    def configure(self, settings: AudioProcessing) -> np.ndarray:
        held = self._flush_held()
        if settings == self.settings and (self._apm is not None) == settings.active:
            return held
        self._plain, self._presence, self._estimate, self._cancelling = None, None, None, False
        self._first_sound, self._leaking, self._talk_left, self._loud_run = None, 0, 0, 0
        self._moved_at, self._lag_moved = None, None
        self._shown.clear()
        self._levels.clear()
        self._recent.clear()
        self._revision, self._pending_onset = np.zeros(0, np.float32), None
        if settings.active:
            frame_cls, module = _load_module()
            self._apm = ApmFrames(_module(module, settings), frame_cls, self.rate, self.frame)
            if settings.echo_cancellation:
                plain = settings.model_copy(update={"echo_cancellation": False})
                self._plain = ApmFrames(_module(module, plain), frame_cls, self.rate, self.frame) \
                    if plain.active else None
                self._plain_delay = np.zeros(self.rate * CANCELLER_LAG_MS // 1000, np.float32)
                self._clear_delay = self._plain_delay.copy()
                self._presence = EchoPresence(self.rate)
                self._estimate = LinearEchoEstimate(self.rate, self.frame)
        else:
            self._apm = None  # the native state goes with its handle
        self.settings = settings
        self.unavailable = None
        self._reference = np.zeros(0, np.float32)
        self._depths.clear()
        self._referenced = False
        return held

    def process(self, samples: np.ndarray) -> np.ndarray:
        if self._apm is None:
            return samples
        data = np.concatenate([self._held, np.asarray(samples, np.float32)])
        n = len(data) // self.frame * self.frame
        self._held = data[n:].copy()
        return self._process_frames(data[:n])

    def process_gap(self, fill: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._apm is None:
            return np.zeros(0, np.float32), fill
        held = self._flush_held()
        n = len(fill)
        return held, self._process_frames(np.pad(np.asarray(fill, np.float32), (0, -n % self.frame)))[:n]

    def close(self) -> None:
        self._apm = self._plain = self._presence = self._estimate = None
        self._reference = np.zeros(0, np.float32)
        if self._resampler is not None:
            self._resampler.close()
            self._resampler = None

    # --- the transport's side: what the caller's loudspeaker played ------------------------------

    @property
    def wants_reference(self) -> bool:
        return self._apm is not None and self.settings.echo_cancellation

    def far_end(self, pcm: np.ndarray, rate: int) -> None:
        """``pcm`` at ``rate`` has just left for the caller."""
        if not self.wants_reference:
            return
        if self._resampler is None or self._resampler.in_rate != rate:
            if self._resampler is not None:
                self._resampler.close()
            self._resampler = PcmResampler(rate, self.rate)
        if not self._referenced and self.reference_continuous:
            self._reference = np.zeros(int(REFERENCE_JITTER_S * self.rate), np.float32)
        self._referenced = True
        self._reference = np.concatenate([self._reference, self._resampler.process(pcm)])
        excess = len(self._reference) - int(MAX_REFERENCE_S * self.rate)
        if excess > 0:  # bounded: the oldest goes (no uplink has come to use it)
            self._reference = self._reference[excess:]
            self.counters.reference_trimmed_s += excess / self.rate

    def cut_far_end(self) -> None:
        """An interruption: the caller's side flushed what it had been sent and not yet played."""
        self.counters.reference_cut_s += len(self._reference) / self.rate
        self._reference = np.zeros(0, np.float32)

    # --- inside ------------------------------------------------------------------------------------

    def _flush_held(self) -> np.ndarray:
        """The uplink held short of a frame, processed as a frame padded with silence."""
        held, self._held = self._held, np.zeros(0, np.float32)
        if self._apm is None or len(held) == 0:
            return held
        padded = np.pad(held, (0, self.frame - len(held)))
        out = self._process_frame(padded)[:len(held)]
        if self._pending_onset is not None:  # it precedes this frame: all of it is a revision
            self._revision, self._pending_onset = self._pending_onset, None
        return out

    def _process_frames(self, data: np.ndarray) -> np.ndarray:
        """``data``: a whole number of 10 ms frames."""
        out = np.empty(len(data), np.float32)
        for i in range(0, len(data), self.frame):
            out[i:i + self.frame] = self._process_frame(data[i:i + self.frame])
            if self._pending_onset is not None:
                back, self._pending_onset = self._pending_onset, None
                inside = min(len(back), i)  # what of it this call's output still holds
                if inside:
                    out[i - inside:i] = back[len(back) - inside:]
                self._revision = back[:len(back) - inside]
        return out

    def take_revision(self) -> np.ndarray:
        """Audio that replaces the end of what ``process`` returned before the last call (empty if none):
        where double talk was confirmed, the line as it was from where the caller began."""
        revision, self._revision = self._revision, np.zeros(0, np.float32)
        return revision

    def _feed_reference(self) -> np.ndarray:
        """One 10 ms frame of the far end for each 10 ms of uplink (returned); silence if nothing left."""
        self._depths.append(len(self._reference))
        allowed = int((self.reference_lead_s + REFERENCE_JITTER_S) * self.rate) + self.frame
        if len(self._depths) == self._depths.maxlen and min(self._depths) > allowed:
            # Standing ahead for a whole window: the reference would reach the canceller late.
            drop = min(self._depths) - allowed + self.frame
            self._moved(self._reference[:drop])
            self._reference = self._reference[drop:]
            self.counters.reference_trimmed_s += drop / self.rate
            self._depths.clear()
        chunk = self._reference[:self.frame]
        self._reference = self._reference[len(chunk):]
        if len(chunk) < self.frame:
            self.counters.reference_underruns += 1
            chunk = np.pad(chunk, (0, self.frame - len(chunk)))
        assert self._apm is not None
        self._apm.process_reverse(chunk)
        self.counters.reference_frames += 1
        return chunk

    def _moved(self, dropped: np.ndarray) -> None:
        """``dropped`` reached the caller but will not reach the canceller: the echo now stands that much
        further behind the reference. The linear estimate is handed it (and stays in place), the echo
        search's lag is read that much further on until it finds the echo anew, and AEC3's double-talk
        rule is not taken alone while it relearns (``MOVED_HOLD_FRAMES``)."""
        if self._estimate is None or self._presence is None:
            return
        self._estimate.skip(dropped)
        self._moved_at = self.counters.frames
        lag = self._presence.counters.lag_ms
        if lag is not None:
            found, now = self._lag_moved if self._lag_moved is not None and self._lag_moved[0] == lag else (lag, lag)
            self._lag_moved = (found, now + 1000.0 * len(dropped) / self.rate)

    def _process_frame(self, samples: np.ndarray) -> np.ndarray:
        self.counters.frames += 1
        if not self.settings.echo_cancellation:
            return self._apm.process(samples)
        reference = self._feed_reference()
        # AEC3 estimates the echo path's delay itself; what the server knows of it (the transport's
        # lead) is already in where the reference stands.
        self._apm.set_stream_delay_zero()
        cancelled = self._apm.process(samples)
        plain = self._plain.process(samples) if self._plain is not None else np.asarray(samples, np.float32)
        assert self._presence is not None
        found = self._presence.update(reference, samples)
        # The estimate learns the echo as the plain path hands it on where that path is linear (a high-pass
        # filter); noise suppression and gain control are not, so there it learns from the microphone and
        # serves only to find where the caller began.
        linear = not (self.settings.noise_suppression or self.settings.auto_gain_control)
        estimate = self._linear_estimate(reference, plain if linear else samples)
        # Where the caller talks over the echo, the engine hears the line less the linear estimate where
        # that is trusted (the caller whole, the echo 10-20 dB down), else the line as it is.
        clear = estimate.residual if linear and estimate is not None and estimate.converged else plain
        plain, self._plain_delay = _through(self._plain_delay, plain)
        clear, self._clear_delay = _through(self._clear_delay, clear)
        if self._first_sound is None and float(np.max(np.abs(reference))) > REFERENCE_AUDIBLE:
            self._first_sound = self.counters.frames
        # Until the echo could have been found (its longest delay and the search's own time after the
        # agent's first sound), the line is not known: the canceller's output, so that an echo the
        # search has not found yet does not reach the engine whole. Then only where it was found.
        settling = self._first_sound is not None and self.counters.frames - self._first_sound < SETTLE_FRAMES
        # The caller as the linear estimate shows them: their voice is most of the line (the room's tail
        # beyond the filter's reach, where the agent's voice drops, shows as evidence too, under the line).
        self._shown.append(estimate is not None and estimate.caller
                           and estimate.residual_power > SHOWN_OF_LINE * estimate.line_power)
        certain = estimate is not None and estimate.certain and linear
        self._strong_frames = estimate.strong_frames if certain and estimate is not None else 0
        cancelled_power = float(np.mean(np.square(cancelled)))
        # The line's level every frame, so that its noise is known before the agent's first sound.
        self._levels.append(float(np.mean(np.square(plain))))
        # Settling, with the echo not found yet (or no echo at all: most phone lines): AEC3 takes a caller
        # down for as long, and nothing else knows the echo. A caller beyond doubt there is at full voice and
        # unlike the far end at every lag an echo could have (``_caller_over_echo``).
        unknown = settling and estimate is None
        # Found, the estimate placed and not trusted yet: a caller as loud as the echo is the line near its ceiling.
        young = estimate is not None and estimate.near_ceiling
        talking = (found or settling) and self._caller_over_echo(cancelled_power, certain, unknown, young)
        echo = (found or settling) and not talking
        was, self._cancelling = self._cancelling, echo
        if echo:
            self.counters.cancelled_frames += 1
        if was == echo:
            out = cancelled if echo else (clear if talking else plain)
        elif talking and self._recent:
            out = clear  # the switch goes back to where the caller began
            self._pending_onset = self._from_onset()
        elif self._settled_now() and not found and self._loud_run > 1 and self._recent:
            # Settled without an echo found, a voice at full level on the line: it has been heard through
            # AEC3, which takes a caller down as it does an echo in its first second. The engine hears the
            # line from where that run began (the caller 0.7 s into the agent's first words was 64 ms late).
            out = plain
            self._pending_onset = self._from_run_start()
        else:
            ramp = np.linspace(0.0, 1.0, self.frame, dtype=np.float32)  # one frame's crossfade
            line = clear if talking else plain
            out = (cancelled * ramp + line * (1 - ramp)) if echo else (line * ramp + cancelled * (1 - ramp))
        evidence = estimate.evidence if estimate is not None else \
            (self._loud_run > 0, self._levels[-1]) if unknown else None
        over = estimate.residual_power / max(estimate.expected_power, 1e-12) \
            if estimate is not None and self._estimate is not None and self._estimate.trusted else None
        self._recent.append((clear, out, OnsetWitness(evidence, cancelled_power, over)))
        return out

    def _linear_estimate(self, reference: np.ndarray, samples: np.ndarray) -> FrameEstimate | None:
        """Our own linear echo estimate, placed at the lag where the search found the echo."""
        assert self._presence is not None and self._estimate is not None
        lag_ms = self._presence.counters.lag_ms
        if self._lag_moved is not None:
            if lag_ms == self._lag_moved[0] and self._relearning():
                lag_ms = self._lag_moved[1]
            else:
                self._lag_moved = None
        if self._presence.echo and lag_ms is not None:
            self._estimate.place(lag_ms / 1000.0)
        return self._estimate.process(reference, samples)

    def _from_onset(self) -> np.ndarray:
        """Double talk just confirmed: the frames handed on since the caller began as the line was. Where
        the linear estimate placed the onset, from the first of them whole: that frame holds the line's
        8 ms before the caller's first frame (the canceller's lag) and their first 2 ms, and faded in
        from AEC3's near silence it kept the engine's VAD under its threshold for its first 32 ms over
        the caller (0.39-0.44, whole 0.55-0.67: docs/benchmarks.md, ``bench bargein``). Where only AEC3's
        output rose (``media/caller_onset.py``), from ``ONSET_AHEAD_FRAMES`` before it, crossfaded in over
        the first (whole, a WebRTC barge-in of the bench came 32 ms later). Where the young estimate's residual
        over a run at full voice confirmed them, from the first frame of what that test looked at, whole, or
        from up to ``ONSET_LEAD_FRAMES`` before it where the line rose as the caller began (the run may begin with the
        echo at full voice, so not from where the run began; the WebRTC barge-in 0.8 s into the agent's words
        on a 250 ms path, the echo as loud, began 30 ms before what the test looked at: 64 ms late from there)."""
        recent = list(self._recent)
        if self._by_run:  # from the first frame of the run the test looked at (this frame is its last)
            first, by_estimate = max(0, len(recent) - self._strong_frames + 1), True
            levels = [float(np.mean(np.square(line))) for line, _, _ in recent]
            # As far as the frame before the run at full voice (this frame is the run's last): a caller's first
            # frame rises into the run from under full voice.
            first = rising_into(levels, first, len(recent) - self._loud_run)
        else:
            first, by_estimate = find_onset([w for _, _, w in recent], self._strong_frames)
        if first == len(recent):
            return np.zeros(0, np.float32)
        if not by_estimate:  # found where AEC3 already let them through: they began before
            first = max(0, first - ONSET_AHEAD_FRAMES)
        return self._line_from(recent, first, fade=not by_estimate)

    def _settled_now(self) -> bool:
        """This is the first frame after settling (``SETTLE_FRAMES`` from the agent's first sound)."""
        return self._first_sound is not None and self.counters.frames - self._first_sound == SETTLE_FRAMES

    def _from_run_start(self) -> np.ndarray:
        """The line handed on again from the first frame of the run at full voice (this frame is its last)."""
        recent = list(self._recent)
        return self._line_from(recent, max(0, len(recent) - self._loud_run + 1))

    def _line_from(self, recent: list[tuple[np.ndarray, np.ndarray, OnsetWitness]], first: int,
                   fade: bool = False) -> np.ndarray:
        """The line as the frames ``recent[first:]`` held it, to be handed on again (counted); with ``fade``,
        crossfaded in over the first frame from what was handed on there."""
        line, handed, _ = recent[first]
        if fade:
            ramp = np.linspace(0.0, 1.0, self.frame, dtype=np.float32)
            line = line * ramp + handed * (1 - ramp)
        frames = [line] + [p for p, _, _ in recent[first + 1:]]
        self.counters.onset_frames += len(frames)
        return np.concatenate(frames)

    def _caller_over_echo(self, cancelled_power: float, certain: bool = False, unknown: bool = False,
                          young: bool = False) -> bool:
        """Double talk: the caller speaks over the echo. AEC3 takes an echo alone 30-40 dB down; what
        comes through it within 10 dB of its input, three frames running, is the caller.
        The engine then hears the line as it is (echo and all, as without processing) rather than
        AEC3's suppressor, which takes the caller down 10-25 dB for the first 60-200 ms of speech
        over an echo as loud (and the VAD hears the barge-in that much late), until
        ``DOUBLE_TALK_HOLD_FRAMES`` after it stops. Or the linear estimate shows them beyond doubt
        (``certain``); or, where the echo is not found yet (``unknown``: settling, the estimate not placed),
        the line at full voice ``UNKNOWN_ECHO_FRAMES`` running is unlike the far end at every lag an echo
        could have (what ``find_onset`` then takes as the run's strength); or, where the echo was found and the
        estimate placed but not trusted yet (``young``: the line near the echo's ceiling, ``echo_estimate``),
        the estimate's residual over such a run is unlike the far end (and its cube) around the echo's lag."""
        level_in = self._levels[-1]
        self._by_run = False
        # Only speech at full voice: well above the line's noise, which AEC3 leaves as it is (the
        # least level of the last two seconds), and near the loudest of the last second, not the
        # quiet ends of the echo's words, which AEC3 takes down less.
        recent = list(self._levels)[-NOISE_WINDOW_FRAMES // 2:]
        loud = level_in > max(DOUBLE_TALK_FLOOR, DOUBLE_TALK_OVER_NOISE * min(self._levels),
                              DOUBLE_TALK_UNDER_PEAK * max(recent))
        through = loud and cancelled_power > DOUBLE_TALK_GAIN * level_in
        self._loud_run = self._loud_run + 1 if loud else 0
        if unknown and self._loud_run >= UNKNOWN_ECHO_FRAMES and not certain:
            assert self._estimate is not None
            certain = self._estimate.line_likeness(self._loud_run) < UNLIKE_FAR_END
            if certain:
                self._strong_frames = self._loud_run
        if young and self._loud_run >= UNKNOWN_ECHO_FRAMES and not certain:
            assert self._estimate is not None
            certain = self._estimate.young_likeness(self._loud_run) < UNLIKE_FAR_END
            if certain:  # as far back as the test looked: a run may begin with the echo at full voice
                self._strong_frames = min(self._loud_run, CERTAIN_WINDOW_FRAMES)
                self._by_run = True
        self._leaking = self._leaking + 1 if through else 0
        # Right after a trim, AEC3 lets the echo through as it relearns: the linear estimate must agree.
        aec3 = self._leaking >= DOUBLE_TALK_FRAMES and (not self._relearning() or all(self._shown))
        # ... or the linear estimate shows them beyond doubt, while AEC3 still takes them down; at full voice
        # only, as AEC3's rule: in the agent's pauses on a line without noise the room's tail beyond the
        # filter's reach is all of the line (-50 to -75 dBFS), over what the filter expects and unlike the
        # far end at one lag. Taken for the caller there, it handed the engine the echo's tail nine times a
        # minute on each leg (``bench aec``: ERLE p10 39.5 -> 36 dB).
        if aec3 or (certain and loud and not self._relearning()):
            self._talk_left = DOUBLE_TALK_HOLD_FRAMES
            self.counters.double_talk_frames += 1
        elif self._talk_left:
            self._talk_left -= 1
        return self._talk_left > 0

    def _relearning(self) -> bool:
        """The reference queue was trimmed less than ``MOVED_HOLD_FRAMES`` ago."""
        return self._moved_at is not None and self.counters.frames - self._moved_at < MOVED_HOLD_FRAMES


def _through(line: np.ndarray, frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``frame`` into a delay ``line``: the frame that comes out, and the line after it."""
    delayed = np.concatenate([line, frame])
    return delayed[:len(frame)], delayed[len(frame):]


def _module(module: Any, settings: AudioProcessing) -> Any:
    return module(echo_cancellation=settings.echo_cancellation,
                  noise_suppression=settings.noise_suppression,
                  high_pass_filter=settings.high_pass_filter,
                  auto_gain_control=settings.auto_gain_control)
