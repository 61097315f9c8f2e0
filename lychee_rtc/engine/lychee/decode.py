"""The decode functions of a window step, as plain functions of the model and device tensors.

gpt-fast style: each function takes the model, the fixed token ids and rules of this runner
(:class:`DecodeRules`), the per-row rule state (:class:`RuleRows`) and the batch's tensors; it
writes only the KV caches and rule-state rows of the rows it is given and never copies to the
host, so the listening forward and the ten speaking steps can be captured as CUDA graphs
(``graphs.py``).

* :func:`prefill` feeds a slot's system prefix (once per conversation).
* :func:`listen_window` feeds a listening window's positions in one forward and scores the two
  decisions at its end.
* :func:`speak_step` feeds one position per speaking row and decides the next (text, then merge
  with E[that text], then speech); :func:`speak_window` runs the ten steps of a window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import LycheeConfig, SpecialTokens
from .model import LycheeFD
from .sampling import (
    SpeechRuleState,
    TextRuleState,
    control_decision,
    sample_speech,
    sample_text,
    speech_rule_init,
    text_rule_init,
)

CHUNK = 10  # positions per 400 ms window (validated in config)


@dataclass(frozen=True)
class DecodeRules:
    """Token ids, vocabulary slices and sampling knobs that every decode call of a runner shares."""

    tok: SpecialTokens
    listen_rows: Tensor  # lm_head rows of the listening decision: (S-S, K-L)
    speak_rows: Tensor  # lm_head rows of the speaking decision: (S-L, K-S)
    speech_prefix: Tensor  # forced <|StokenDelay|> x delay + <tts_start>
    speech_slice: slice  # lm_head rows the speech channel samples from
    code_lo: int  # lowest id the speech channel may sample
    code_hi: int  # one past the highest (the codec's range with strict_codec_range)
    start_speak_factor: float
    start_listen_factor: float
    end_speak_factor: float
    max_text_tokens: int
    max_speech_tokens: int
    no_repeat_ngram: int

    @classmethod
    def build(cls, cfg: LycheeConfig, tok: SpecialTokens, device: torch.device, *, stoken_delay_num: int | None,
              strict_codec_range: bool, start_speak_factor: float, start_listen_factor: float,
              end_speak_factor: float, max_text_tokens: int, max_speech_tokens: int,
              no_repeat_ngram: int) -> "DecodeRules":
        delay = cfg.stoken_delay_num if stoken_delay_num is None else stoken_delay_num
        return cls(
            tok=tok,
            listen_rows=torch.tensor([tok.start_speaking, tok.keep_listening], device=device),
            speak_rows=torch.tensor([tok.start_listening, tok.keep_speaking], device=device),
            speech_prefix=torch.tensor([tok.stoken_delay] * delay + [tok.tts_start], device=device),
            speech_slice=slice(cfg.stoken_token_ids_min, cfg.stoken_token_ids_max),
            code_lo=tok.audio_code_min,
            code_hi=(tok.audio_code_min + cfg.stoken_codec_vocab_size if strict_codec_range
                     else cfg.stoken_token_ids_max),
            start_speak_factor=start_speak_factor, start_listen_factor=start_listen_factor,
            end_speak_factor=end_speak_factor, max_text_tokens=max_text_tokens,
            max_speech_tokens=max_speech_tokens, no_repeat_ngram=no_repeat_ngram)


@dataclass
class RuleRows:
    """Per-row device state of the speaking rules, indexed by cache row (every slot, the scratch row).

    The tensors are updated in place (captured graphs hold their addresses), so a reset writes
    zeros into rows and never replaces a tensor.
    """

    history: Tensor  # (rows, max_seq) the speech channel, for the no-repeat n-gram rule
    text: TextRuleState
    speech: SpeechRuleState

    @classmethod
    def create(cls, rows: int, max_seq: int, stoken_pad: int, device: torch.device) -> "RuleRows":
        history = torch.full((rows, max_seq), stoken_pad, dtype=torch.long, device=device)
        return cls(history, text_rule_init(rows, device), speech_rule_init(rows, device))

    def reset_rules(self, rows: int | slice) -> None:
        """A new response: the counters and "end seen" flags of ``rows`` start again."""
        for t in (self.text.count, self.text.has_eos, self.speech.prefix_count, self.speech.count,
                  self.speech.has_eos):
            t[rows] = 0

    def reset(self, rows: int | slice, stoken_pad: int) -> None:
        """A new conversation: the rules, and the speech history the n-gram rule looks back on."""
        self.history[rows] = stoken_pad
        self.reset_rules(rows)

    def gather(self, rows: Tensor) -> tuple[TextRuleState, SpeechRuleState]:
        return (TextRuleState(self.text.count[rows], self.text.has_eos[rows]),
                SpeechRuleState(self.speech.prefix_count[rows], self.speech.count[rows], self.speech.has_eos[rows]))

    def scatter(self, rows: Tensor, text: TextRuleState, speech: SpeechRuleState) -> None:
        self.text.count[rows], self.text.has_eos[rows] = text.count, text.has_eos
        self.speech.prefix_count[rows] = speech.prefix_count
        self.speech.count[rows], self.speech.has_eos[rows] = speech.count, speech.has_eos


def prefill(model: LycheeFD, ids: list[int], row: int, text_pad: int) -> None:
    """Feed a system prefix into cache row ``row`` at positions 0..P-1."""
    device = model.lm_head.weight.device
    prefix = torch.tensor([ids], device=device)
    rows = torch.tensor([row], device=device)
    pos = torch.arange(len(ids), device=device)[None]
    # Merge at the last prefix position sees the first post-prefix text token, <|TextPad|>.
    nxt = torch.tensor([ids[1:] + [text_pad]], device=device)
    e = model.embed_tokens
    model.forward_positions(e(prefix), e(nxt), model.context(pos, rows, key_len=len(ids)))


def listen_window(model: LycheeFD, rules: DecodeRules, text: Tensor, stoken: Tensor, control: Tensor,
                  audio: Tensor, input_pos: Tensor, rows: Tensor | slice | None) -> tuple[Tensor, Tensor]:
    """Feed a window's positions to every stack; decide between S-S and K-L at the end.

    Text is forced to <|TextPad|> while listening, so the merge branch's "next text" is known for
    every position and the whole window is a single forward. Only two lm_head rows are evaluated.
    Returns (choice (B,), probabilities (B, 2)) as :func:`~.sampling.control_decision`.
    """
    x = model.embed_channels(text, stoken, control, audio)
    nxt = model.embed_tokens.weight[rules.tok.text_pad].expand_as(x)
    out = model.forward_positions(x, nxt, model.context(input_pos, rows))
    scores = torch.nn.functional.linear(out.control_hidden[:, -1], model.lm_head.weight[rules.listen_rows])
    return control_decision(scores, rules.start_speak_factor)


def speak_step(model: LycheeFD, rules: DecodeRules, state: RuleRows, j: int, cur: Tensor, audio: Tensor,
               pos: Tensor, hist_len: Tensor, rows_t: Tensor, rows: Tensor | slice | None, text_rule: TextRuleState,
               speech_rule: SpeechRuleState, ended: Tensor, temperature: Tensor, noise: Tensor):
    """Feed one position per row (tokens ``cur`` (B, 3)) at window slot ``j``, decide the next.

    Text first, then the merge with E[that text], then speech; control forced (Sleep, Detect at
    slot 8) except at slot 9, where S-L or K-S is decided. Returns the decided tokens (B, 3), the
    new rule states, the "ended" flags and, at slot 9, the decision's probabilities.
    """
    t = rules.tok
    ctx = model.context(pos, rows)
    x = model.embed_channels(cur[:, 0:1], cur[:, 1:2], cur[:, 2:3], audio)
    out = model.forward_branches(x, ctx)
    text, text_rule = sample_text(model.head(out.text_hidden[:, -1]), cur[:, 0], text_rule, eos=t.text_eos,
                                  pad=t.tts_pad, max_tokens=rules.max_text_tokens,
                                  end_speak_factor=rules.end_speak_factor)
    # After <tts_end> the position's text is the pad (below): merge sees what the history will
    # hold, so the caches are those of a forward over the recorded tokens (what a slide's
    # re-prefill, and the reference's re-prefill after <tts_end>, compute).
    text = torch.where(ended, t.text_pad, text)
    speech_h = model.merge(out.stoken_hidden, model.embed_tokens(text)[:, None], ctx)
    logits = model.head(speech_h[:, -1], rules.speech_slice)
    speech, speech_rule = sample_speech(
        logits, rules.speech_slice.start, cur[:, 1], state.history[rows_t], hist_len, speech_rule,
        prefix=rules.speech_prefix, eos=t.tts_end, code_lo=rules.code_lo, code_hi=rules.code_hi,
        max_tokens=rules.max_speech_tokens, ngram=rules.no_repeat_ngram, temperature=temperature, noise=noise)
    probs = None
    if j == CHUNK - 1:
        scores = torch.nn.functional.linear(out.control_hidden[:, -1], model.lm_head.weight[rules.speak_rows])
        choice, probs = control_decision(scores, rules.start_listen_factor)
        control = torch.where(choice == 0, t.start_listening, t.keep_speaking)
        forced_after_end = t.start_listening
    else:
        forced = t.detect if j == CHUNK - 2 else t.sleep
        control = torch.full_like(text, forced)
        forced_after_end = forced
    # After <tts_end> the rest of the window is padding that closes with S-L (the reference
    # appends exactly these tokens); the model still sees every position. (Text was padded above.)
    speech = torch.where(ended, t.stoken_pad, speech)
    control = torch.where(ended, forced_after_end, control)
    ended = ended | (speech == t.tts_end)
    state.history[rows_t, hist_len] = speech
    return torch.stack([text, speech, control], dim=1), text_rule, speech_rule, ended, probs


def speak_window(model: LycheeFD, rules: DecodeRules, state: RuleRows, pending: Tensor, audio: Tensor,
                 base_pos: Tensor, hist_len: Tensor, rows_t: Tensor, rows: Tensor | slice | None, temperature: Tensor,
                 noise: Tensor) -> tuple[Tensor, Tensor]:
    """Ten decode steps for B speaking rows. Returns tokens (B, 10, 3) and slot-9 probabilities."""
    text_rule, speech_rule = state.gather(rows_t)
    cur = pending
    ended = torch.zeros(pending.shape[0], dtype=torch.bool, device=pending.device)
    outs = []
    probs = torch.zeros((pending.shape[0], 2), device=pending.device)
    for j in range(CHUNK):
        cur, text_rule, speech_rule, ended, p = speak_step(
            model, rules, state, j, cur, audio[:, j:j + 1], base_pos + j, hist_len + j, rows_t, rows, text_rule,
            speech_rule, ended, temperature, noise[:, j])
        outs.append(cur)
        if p is not None:
            probs = p
    state.scatter(rows_t, text_rule, speech_rule)
    return torch.stack(outs, dim=1), probs
