"""A small byte-level BPE tokenizer for the Lychee-FD checkpoint folder.

The runner needs two things from the tokenizer: the ids of the fixed system prefix
``<|BOT|>system\\nYou are a helpful assistant.<|EOT|>`` and the text of the tokens the model emits
(as incremental UTF-8, since one character may span several byte tokens). Both are read from the
standard Qwen2 files: ``tokenizer.json`` if present, otherwise ``vocab.json`` + ``merges.txt``,
with added tokens from ``tokenizer_config.json`` (``added_tokens_decoder``) and/or
``added_tokens.json``. No ``transformers`` dependency and no remote code.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import lru_cache
from pathlib import Path

SYSTEM_PREFIX = "<|BOT|>system\nYou are a helpful assistant.<|EOT|>"

try:  # the exact Qwen2 pre-tokenizer needs Unicode classes; ``regex`` has them
    import regex as _regex  # type: ignore[import-not-found]

    _PRETOKENIZE = _regex.compile(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
except ImportError:  # close approximation with ``re``; identical on ASCII text such as the prefix
    _PRETOKENIZE = re.compile(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


# BPE over one pre-token is quadratic in its length; a pre-token longer than this (a run of CJK text
# without spaces, a pasted blob) is merged in pieces of this many byte symbols, which bounds the
# cost. Ordinary words are far shorter and tokenize exactly as with the reference tokenizer.
MAX_BPE_WORD = 128


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], added: dict[str, int]):
        self.vocab = dict(vocab)
        self.added = dict(added)
        self.id_to_token: dict[int, str] = {i: t for t, i in self.vocab.items()}
        self.id_to_added: dict[int, str] = {i: t for t, i in self.added.items()}
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        # Longest first, so "<|EOT|>" is never split by a shorter added token.
        specials = sorted(self.added, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(s) for s in specials)) if specials else None

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, root: str | Path) -> "Tokenizer":
        root = Path(root)
        vocab: dict[str, int]
        merges: list[tuple[str, str]] = []
        added: dict[str, int] = {}
        tj = root / "tokenizer.json"
        if tj.is_file():
            data = json.loads(tj.read_text(encoding="utf-8"))
            model = data.get("model", {})
            vocab = dict(model.get("vocab", {}))
            for m in model.get("merges", []):
                pair = tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
                merges.append(pair)  # type: ignore[arg-type]
            for tok in data.get("added_tokens", []):
                added[tok["content"]] = int(tok["id"])
        elif (root / "vocab.json").is_file():
            vocab = json.loads((root / "vocab.json").read_text(encoding="utf-8"))
            mp = root / "merges.txt"
            if mp.is_file():
                for line in mp.read_text(encoding="utf-8").splitlines():
                    if not line or line.startswith("#version"):
                        continue
                    a, _, b = line.partition(" ")
                    merges.append((a, b))
        else:
            raise TokenizerError(f"{root}: no tokenizer.json or vocab.json")
        tc = root / "tokenizer_config.json"
        if tc.is_file():
            for tid, tok in json.loads(tc.read_text(encoding="utf-8")).get("added_tokens_decoder", {}).items():
                added[tok["content"]] = int(tid)
        at = root / "added_tokens.json"
        if at.is_file():
            added.update({k: int(v) for k, v in json.loads(at.read_text(encoding="utf-8")).items()})
        return cls(vocab, merges, added)

    # -- lookup ----------------------------------------------------------------------------

    def token_to_id(self, token: str) -> int | None:
        if token in self.added:
            return self.added[token]
        return self.vocab.get(token)

    def __len__(self) -> int:
        return max(list(self.id_to_token) + list(self.id_to_added)) + 1

    # -- encode ----------------------------------------------------------------------------

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: self.ranks.get((parts[i], parts[i + 1]), 1 << 62))
            if (parts[best], parts[best + 1]) not in self.ranks:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        return parts

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        pieces: list[tuple[str, bool]] = []
        if self._special_re is not None:
            for m in self._special_re.finditer(text):
                pieces.append((text[pos:m.start()], False))
                pieces.append((m.group(0), True))
                pos = m.end()
        pieces.append((text[pos:], False))
        for piece, special in pieces:
            if special:
                ids.append(self.added[piece])
                continue
            for word in _PRETOKENIZE.findall(piece):
                mapped = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
                for start in range(0, len(mapped), MAX_BPE_WORD):
                    for tok in self._bpe(mapped[start:start + MAX_BPE_WORD]):
                        if tok not in self.vocab:
                            raise TokenizerError(f"token {tok!r} not in vocabulary")
                        ids.append(self.vocab[tok])
        return ids

    # -- decode ----------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self.id_to_added:
            return self.id_to_added[token_id].encode("utf-8")
        tok = self.id_to_token.get(token_id)
        if tok is None:
            return b""
        return bytes(self.byte_decoder.get(c, 0) for c in tok)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Token ids in, text deltas out; a character split across tokens is held until complete."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._decoder.decode(b"".join(self.tokenizer.token_bytes(t) for t in token_ids))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
