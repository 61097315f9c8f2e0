"""vLLM-Omni's duplex dialect of the realtime WebSocket (``/v1/realtime?duplex=1``, ``/v1/duplex``).

The OpenAI GA shapes plus what a full-duplex client needs: ``server_event_seq`` on every event and a
journal to resume from (``session.resume``, ``session.event_ack``), the model's turn decisions
(``response.speak`` / ``response.listen``), playback acknowledgements kept in the session's ledger,
heartbeats, epochs on every event, and the capability object. Only this dialect sends them.
"""
