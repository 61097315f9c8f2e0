"""The Qwen2 / Step-Audio-2 byte-level BPE tokenizer of a Lychee-FD checkpoint folder.

The runner needs two things from the tokenizer: the ids of the fixed system prefix
``<|BOT|>system\\nYou are a helpful assistant.<|EOT|>`` and the text of the tokens the model emits
(as incremental UTF-8, since one character may span several byte tokens). Encoding and decoding run
in Hugging Face ``tokenizers`` (the ``model`` extra). The folder gives either ``tokenizer.json``
(loaded as it is) or the slow-tokenizer files ``vocab.json`` + ``merges.txt``, from which the
tokenizer is assembled the way Qwen2's own ``tokenizer.json`` is (NFC, the Qwen2 split pattern,
byte-level). Added tokens come from ``tokenizer_config.json`` (``added_tokens_decoder``) and/or
``added_tokens.json`` and keep their ids. No ``transformers`` dependency and no remote code.
"""

from __future__ import annotations

import codecs
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

SYSTEM_PREFIX = "<|BOT|>system\nYou are a helpful assistant.<|EOT|>"

# Qwen2's pre-tokenizer split pattern (letters, single digits, punctuation runs, newlines, spaces).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenizerError(ValueError):
    pass


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not readable JSON ({exc})") from exc


def _read_merges(path: Path) -> list[str]:
    merges = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line or line.startswith("#version"):
            continue
        if len(line.split(" ")) != 2:
            raise TokenizerError(f"{path}:{n}: a merge is two tokens separated by one space, got {line!r}")
        merges.append(line)
    return merges


def _declared_added_tokens(root: Path) -> dict[str, dict]:
    """Added tokens the slow-tokenizer files declare: content -> tokenizer.json-style entry."""
    added: dict[str, dict] = {}
    tc = root / "tokenizer_config.json"
    if tc.is_file():
        for tid, tok in (_read_json(tc).get("added_tokens_decoder") or {}).items():
            try:
                added[tok["content"]] = {"id": int(tid), "content": tok["content"],
                                         "special": bool(tok.get("special", True))}
            except (KeyError, TypeError, ValueError) as exc:
                raise TokenizerError(f"{tc}: bad added_tokens_decoder entry {tid!r}: {tok!r}") from exc
    at = root / "added_tokens.json"
    if at.is_file():
        for content, tid in _read_json(at).items():
            if not isinstance(tid, int):
                raise TokenizerError(f"{at}: id of {content!r} must be an integer, got {tid!r}")
            prev = added.get(content)
            added[content] = {"id": tid, "content": content, "special": prev["special"] if prev else True}
    return added


def _added_entry(tok: dict) -> dict:
    # As Qwen2 declares them: matched verbatim (before NFC), never stripped, never single-word.
    return {"id": tok["id"], "content": tok["content"], "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": tok["special"]}


def qwen2_tokenizer_json(vocab: dict[str, int], merges: list[str], added: list[dict]) -> dict:
    """The ``tokenizer.json`` document of a Qwen2 byte-level BPE with these parts."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_entry(t) for t in sorted(added, key=lambda t: t["id"])],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }


def pin_added_ids(document: dict, source: str) -> tuple[dict[str, int], list[dict]]:
    """Give every added token its declared id; returns the model vocabulary as it was and the
    added-token entries.

    ``tokenizers`` numbers an added token that is new to the model vocabulary consecutively after
    the highest id so far, which is right for a released Qwen2 vocabulary (added ids follow it
    without a gap) but not for a layout with gaps. An added token that is also in the model
    vocabulary keeps that id, so each one is put there under its id; BPE never produces such a
    token itself (no merge leads to it), and it is still matched as a whole before pre-tokenising.
    """
    model = document.get("model")
    added = document.get("added_tokens") or []
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise TokenizerError(f"{source}: expected a BPE model with a vocabulary")
    vocab: dict[str, int] = model["vocab"]
    original = dict(vocab)
    by_id = {i: t for t, i in vocab.items()}
    for tok in added:
        content, tid = tok.get("content"), tok.get("id")
        if not isinstance(content, str) or not content or isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise TokenizerError(f"{source}: bad added token {tok!r}")
        if vocab.get(content, tid) != tid:
            raise TokenizerError(f"{source}: added token {content!r} has id {tid}, "
                                 f"but the vocabulary has it at {vocab[content]}")
        if by_id.get(tid, content) != content:
            raise TokenizerError(f"{source}: added token {content!r} has id {tid}, "
                                 f"which the vocabulary gives to {by_id[tid]!r}")
        vocab[content] = tid
        by_id[tid] = content
    return original, added


class Tokenizer:
    """Encode text to ids and ids back to text or bytes; a thin layer over ``tokenizers``."""

    def __init__(self, document: dict, source: str):
        from tokenizers import Tokenizer as HFTokenizer

        self.source = source
        vocab, added = pin_added_ids(document, source)
        try:
            self._tk = HFTokenizer.from_str(json.dumps(document))
        except Exception as exc:  # the library's own error types vary between versions
            raise TokenizerError(f"{source}: not a usable tokenizer ({exc})") from exc
        for tok in added:
            if self._tk.token_to_id(tok["content"]) != tok["id"]:  # guards the id rule above
                raise TokenizerError(f"{source}: added token {tok['content']!r} did not keep id {tok['id']}")
        # A byte-level vocabulary must spell every byte, or some text could not be encoded at all
        # (the library would drop the byte silently: there is no unknown token).
        missing = [b for b, c in bytes_to_unicode().items() if c not in vocab]
        if missing:
            raise TokenizerError(f"{source}: the vocabulary lacks the byte-level token of byte "
                                 f"0x{missing[0]:02x}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
        self.id_to_added: dict[int, str] = {i: t.content for i, t in self._tk.get_added_tokens_decoder().items()}
        self.id_to_token: dict[int, str] = {i: t for t, i in vocab.items() if i not in self.id_to_added}

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, root: str | Path) -> "Tokenizer":
        root = Path(root)
        declared = _declared_added_tokens(root)
        tj = root / "tokenizer.json"
        if tj.is_file():
            document = _read_json(tj)
            if not isinstance(document, dict) or not isinstance(document.get("added_tokens", []), list):
                raise TokenizerError(f"{tj}: not a tokenizers document")
            # tokenizer.json is authoritative; tokens only the config files name are added to it.
            present = {t.get("content") for t in document.get("added_tokens", [])}
            document.setdefault("added_tokens", []).extend(
                _added_entry(t) for c, t in declared.items() if c not in present)
            return cls(document, str(tj))
        vp = root / "vocab.json"
        if not vp.is_file():
            raise TokenizerError(f"{root}: no tokenizer.json or vocab.json")
        vocab = _read_json(vp)
        if not isinstance(vocab, dict):
            raise TokenizerError(f"{vp}: expected an object of token -> id")
        mp = root / "merges.txt"
        merges = _read_merges(mp) if mp.is_file() else []
        return cls(qwen2_tokenizer_json(vocab, merges, list(declared.values())), str(vp))

    @classmethod
    def from_parts(cls, vocab: dict[str, int], merges: list[tuple[str, str]],
                   added: dict[str, int]) -> "Tokenizer":
        """From a vocabulary, merges in rank order and added (special) tokens held in memory."""
        entries = [{"id": i, "content": t, "special": True} for t, i in added.items()]
        return cls(qwen2_tokenizer_json(dict(vocab), [f"{a} {b}" for a, b in merges], entries), "<in memory>")

    # -- lookup ----------------------------------------------------------------------------

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def __len__(self) -> int:
        return max(list(self.id_to_token) + list(self.id_to_added)) + 1

    # -- encode / decode -------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (an added token: its text); unknown ids give nothing."""
        added = self.id_to_added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        tok = self.id_to_token.get(token_id)
        if tok is None:
            return b""
        table = _unicode_to_bytes()
        return bytes(table[c] for c in tok if c in table)


class IncrementalDetokenizer:
    """Token ids in, text deltas out; a character split across tokens is held until complete."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._decoder.decode(b"".join(self.tokenizer.token_bytes(t) for t in token_ids))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
