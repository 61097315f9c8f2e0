"""Sections of the settings (``config.py``) for two transports: carrier media streams and the
realtime WebSocket."""

from __future__ import annotations

from pydantic import Field, model_validator

from lychee_rtc.config_base import Section as _Section


class TwilioSettings(_Section):
    # The account's auth token: key of the X-Twilio-Signature HMAC over the stream URL.
    auth_token: str | None = None


class TelnyxSettings(_Section):
    # Compared with the streaming auth-token header Telnyx sends.
    token: str | None = None


class PlivoSettings(_Section):
    # Plivo can only pass extraHeaders (in its start frame): the token is the value of this key.
    token: str | None = None
    header: str = Field("token", pattern=r"^[A-Za-z0-9]+$")


class ExotelSettings(_Section):
    # Basic auth, as in wss://<username>:<password>@host/... in the Voicebot applet.
    username: str | None = None
    password: str | None = None


class VonageSettings(_Section):
    # Bearer token, sent by the NCCO websocket endpoint's authorization header.
    token: str | None = None


class TelephonySettings(_Section):
    """Carrier media streams on /v1/telephony/ws. A carrier with no credentials here is refused."""

    enabled: bool = True
    # The scheme and host carriers dial (e.g. wss://bot.example.com): Twilio signs the URL it was
    # given, which a proxy in front of the server may rewrite. Unset: rebuilt from the request.
    public_url: str | None = Field(None, pattern=r"^wss?://[^/?#]+$")
    # Audio sent ahead of real time when a response starts: the carrier's cushion against jitter.
    lead_ms: int = Field(100, ge=0, le=1000)
    # Audio sent but not yet confirmed played by the carrier's marks never exceeds this.
    max_ahead_ms: int = Field(1000, ge=100, le=10000)
    # A mark (playout receipt) after this much outbound audio; 20 = every frame.
    mark_interval_ms: int = Field(20, ge=20, le=2000)
    # A carrier that echoes no mark this long after its audio was due is taken not to echo marks.
    mark_timeout_s: float = Field(5.0, gt=0, le=60)
    # A connection must authenticate and start its stream within this long.
    start_timeout_s: float = Field(10.0, gt=0, le=120)
    # Malformed frames tolerated per call (each reported as an error event) before it is closed.
    max_bad_frames: int = Field(20, ge=1, le=10000)
    twilio: TwilioSettings = Field(default_factory=TwilioSettings)
    telnyx: TelnyxSettings = Field(default_factory=TelnyxSettings)
    plivo: PlivoSettings = Field(default_factory=PlivoSettings)
    exotel: ExotelSettings = Field(default_factory=ExotelSettings)
    vonage: VonageSettings = Field(default_factory=VonageSettings)

    @model_validator(mode="after")
    def _exotel_pair(self) -> "TelephonySettings":
        if (self.exotel.username is None) != (self.exotel.password is None):
            raise ValueError("telephony.exotel needs both username and password")
        return self


class WebSocketSettings(_Section):
    """The realtime WebSocket (``GET /v1/realtime``, ``/v1/duplex``): audio in JSON events.

    Every bound here is per socket (docs/websocket.md says what happens at each)."""

    # The largest frame a client may send: OpenAI's 15 MiB append and its envelope. Larger: closed 1009.
    max_frame_bytes: int = Field(16 << 20, ge=64 << 10, le=64 << 20)
    # Appended audio waiting for the engine; while this much waits, the socket is not read.
    max_pending_input_s: float = Field(256.0, ge=1.0, le=3600.0)
    # The send queue: a client that stops reading until this fills is closed (1008).
    queue_events: int = Field(4096, ge=64, le=1 << 20)
    queue_bytes: int = Field(8 << 20, ge=1 << 20, le=256 << 20)
    # Answer audio moved into the send queue ahead of the client; the rest waits in the playout buffer.
    audio_ahead_bytes: int = Field(512 << 10, ge=16 << 10, le=64 << 20)
    # No client message for this long after the upgrade (never configured), or since the last one: closed (1008).
    first_message_timeout_s: float = Field(20.0, gt=0, le=3600)
    idle_timeout_s: float = Field(300.0, gt=0, le=86400)
    # WebSocket pings: a peer that answers none within half of this is gone (a vanished client).
    heartbeat_s: float = Field(20.0, ge=0.2, le=600)
    # The kernel's send buffer of each socket (SO_SNDBUF), so what a client does not read stays in
    # the bounded queue above, where it is counted, instead of in the kernel.
    send_buffer_bytes: int = Field(256 << 10, ge=4096, le=16 << 20)
    # vLLM-Omni's dialect: events kept for a resume, as compact JSON bytes (beyond: journal_overflow).
    journal_bytes: int = Field(8 << 20, ge=64 << 10, le=256 << 20)
