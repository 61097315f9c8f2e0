"""Phone calls from cloud carriers (Twilio, Telnyx, Plivo, Exotel, Vonage) over their media-stream WebSockets.

A carrier terminates the phone network and forks the call's audio to our WebSocket. This package is
the edge for that ingress, beside ``media`` (WebRTC): each carrier's dialect is a translator between
its frames and typed carrier events (``carriers``), ``uplink`` turns the caller's audio into the
session's 16 kHz stream, ``playout`` paces the answer back in the carrier's format and learns from
the carrier's marks what the caller actually heard, and ``call`` ties one connection to one session.
The session knows none of the carriers' names.
"""
