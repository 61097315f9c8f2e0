"""The Token2Wav model (flow + HiFT + prompt front-end): speech codes to 24 kHz audio.

It imports nothing from the engine; the streaming rules that feed it codes per response (hops,
look-ahead, epoch fences) and the per-slot pool live with the engine that uses them, in
``lychee_rtc.engine.lychee.token2wav_stream`` and ``token2wav_slots``.
"""

from .token2wav import CheckpointError, PromptTooLong, Token2Wav, UnknownVoice, Voice, VoiceBank, write_tiny_token2wav

__all__ = ["CheckpointError", "PromptTooLong", "Token2Wav", "UnknownVoice", "Voice", "VoiceBank",
           "write_tiny_token2wav"]
