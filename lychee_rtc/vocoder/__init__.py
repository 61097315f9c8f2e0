"""Vocoder stage: streaming rules and epoch fencing (``streaming``) and the Token2Wav model."""

from .streaming import EpochFence, StreamRules, VocoderStream, synthesize_hops, to_pcm16
from .token2wav import CheckpointError, PromptTooLong, Token2Wav, UnknownVoice, Voice, VoiceBank, write_tiny_token2wav

__all__ = ["CheckpointError", "EpochFence", "PromptTooLong", "StreamRules", "Token2Wav", "UnknownVoice", "Voice",
           "VocoderStream", "VoiceBank", "synthesize_hops", "to_pcm16", "write_tiny_token2wav"]
