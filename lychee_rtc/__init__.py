"""lychee-rtc: a WebRTC media server for full-duplex spoken language models."""

__version__ = "0.1.0"
