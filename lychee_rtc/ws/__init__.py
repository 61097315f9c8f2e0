"""Audio over a WebSocket, in JSON events: the OpenAI Realtime transport and vLLM-Omni's duplex dialect.

``call.py`` is one such call (a ``calls.Call``); ``uplink.py`` takes the client's appended audio to the
session in order with its other events, at the engine's pace; ``sender.py`` turns the session's
answer into audio events as it is made; ``formats.py`` the encodings a client may use. The dialects
themselves (which events, in which shapes) are the server's: the transport moves bytes.
"""
