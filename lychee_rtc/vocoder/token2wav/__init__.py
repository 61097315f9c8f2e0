"""Step-Audio-2 Token2Wav (flow matching + HiFT), weight-compatible with the released folder."""

from .config import CheckpointError, FlowConfig, HiftConfig
from .model import PromptTooLong, Token2Wav, Voice
from .tiny import write_test_prompt, write_tiny_token2wav
from .voices import UnknownVoice, VoiceBank

__all__ = ["CheckpointError", "FlowConfig", "HiftConfig", "PromptTooLong", "Token2Wav", "UnknownVoice",
           "Voice", "VoiceBank", "write_test_prompt", "write_tiny_token2wav"]
