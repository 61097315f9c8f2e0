"""A drop-in target for clients written for OpenAI's Realtime API over WebRTC.

``routes`` holds the HTTP surface (calls, hangup, client secrets, the sideband WebSocket),
``dialect`` the GA event translator for the ``oai-events`` channel and the sideband,
``session_config`` the GA session objects, ``client_secrets`` the ephemeral keys.
"""
