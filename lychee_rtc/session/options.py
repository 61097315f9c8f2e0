"""A session's options as its clients change them: ``session.update``, whatever the dialect.

A part of ``DuplexSession`` (``session.py``), kept apart. Instructions before the model first spoke
restart the conversation under the new system prompt (docs/architecture.md, "Instructions before
the model first speaks restart the conversation"); the answer is always ``session.updated``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from lychee_rtc.config import AudioProcessing
from lychee_rtc.engine.base import Control, ControlKind
from lychee_rtc.session.processing import ProcessingUnavailable
from lychee_rtc.session.protocol import ProtocolError

# What a change of instructions did: nothing new; prefilled as the system prompt before the model
# first spoke; kept for the model's next context reset (mid-conversation); or not used by this engine.
InstructionsEffect = Literal["unchanged", "applied", "next_context_reset", "unused"]


class OptionChanges:
    def update(self, fields: dict[str, Any], event_id: str | None = None) -> InstructionsEffect:
        """Apply validated option changes (keys of the ``session_config`` schema) and answer with
        ``session.updated``."""
        voice = fields.get("voice", self.options.voice)
        voices = self.capabilities.voices
        if voice is not None and voices and voice not in voices:
            raise ProtocolError("invalid_voice", f"voice {voice!r} is not one of {list(voices)}", event_id)
        if voice is not None and not voices:
            raise ProtocolError("invalid_voice", f"engine {self.engine_name!r} has no selectable voices", event_id)
        if "audio_processing" in fields:  # first: refused, it changes nothing else either
            self._configure_processing(fields["audio_processing"], event_id)
        if "recording" in fields:
            if self.recording is None:
                raise ProtocolError("recording_unavailable", "this server does not record calls", event_id)
            self.recording.set_recording(bool(fields["recording"]), event_id)
        effect: InstructionsEffect = "unchanged"
        changes = {k: fields[k] for k in ("voice", "temperature", "seed", "instructions") if k in fields}
        if "instructions" in changes and changes["instructions"] != self.options.instructions:
            if not self.capabilities.instructions:
                effect = "unused"
            elif self.responses.ledger.total == 0:
                effect = "applied"
            else:
                effect = "next_context_reset"
        self.options = replace(self.options, **changes)
        if "metrics" in fields:
            self.metrics_enabled = bool(fields["metrics"])
        if effect == "applied":
            # Before the model first spoke: a fresh conversation under the new system prompt. The
            # epoch fences any response the engine may have begun before it sees the restart.
            self.epoch += 1
            self.sink.cut(self.epoch)
            self.slot.control(Control(ControlKind.CANCEL, self.epoch))
            self.slot.control(Control(ControlKind.RESTART, self.epoch, self.options))
        self.slot.control(Control(ControlKind.UPDATE, self.epoch, self.options))
        self.emit("session.updated", session=self.describe(), instructions_effect=effect)
        return effect

    def _configure_processing(self, changes: dict[str, bool], event_id: str | None) -> None:
        if self.processing is None:
            raise ProtocolError("audio_processing_unavailable",
                                f"engine {self.engine_name!r} has no uplink processing at its rate", event_id)
        wanted = AudioProcessing(**{**self.processing.settings.model_dump(), **changes})
        try:
            held = self.processing.configure(wanted)
        except ProcessingUnavailable as exc:
            raise ProtocolError("audio_processing_unavailable", str(exc), event_id) from None
        if len(held):
            self.uplink.audio(held)
