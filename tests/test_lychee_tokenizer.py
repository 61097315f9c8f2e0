"""The Lychee-FD tokenizer (Hugging Face ``tokenizers``) on the tiny checkpoint's vocabulary.

The expected ids below were recorded from the previous hand-written byte-level BPE (exact Qwen2
split pattern) before it was replaced, on two vocabularies: the tiny checkpoint's (byte tokens, no
merges) and the same with a few merges, so that merge ranks, space and newline merges, UTF-8
multi-byte merges and merges that must not cross pre-token boundaries are all exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lychee_rtc.engine.lychee.tiny import TinySpec, tiny_vocab, write_tiny_tokenizer
from lychee_rtc.engine.lychee.tokenizer import SYSTEM_PREFIX, IncrementalDetokenizer, Tokenizer, TokenizerError

TEXTS = [
    SYSTEM_PREFIX,
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "digits 12345 and 3.14159",
    "I'LL say don't, we're, you've",
    "héllo ✓ naïve café",
    "中文没有空格的句子",
    "emoji 😀👍🏽 mixed",
    "<|BOT|>user\nhi<|EOT|><|BOT|>assistant\n",
    "<|S-S|><|TextPad|><audio_3>tail",
    "the then there theory other",
    "wrong<|EOT|",
]

MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġ", "s"),
    ("o", "u"), ("l", "l"), ("Ġ", "w"), ("r", "e"), ("Ġthe", "r"), ("Ġthe", "n"), ("Ġthe", "re"),
    ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("ĠĠ", "Ġ"), ("Ã", "©"), ("h", "Ã©"), ("hÃ©", "ll"), ("hÃ©ll", "o"),
    ("1", "2"), ("'", "ll"), ("L", "L"), ("'", "LL"), ("ä", "¸"), ("t", "he"), ("the", "n"),
]

RECORDED_TINY = [
    [257, 82, 88, 82, 83, 68, 76, 198, 56, 78, 84, 220, 64, 81, 68, 220, 64, 220, 71, 68, 75, 79, 69, 84, 75, 220,
     64, 82, 82, 72, 82, 83, 64, 77, 83, 13, 258],
    [39, 68, 75, 75, 78, 220, 86, 78, 81, 75, 67],
    [220, 220, 75, 68, 64, 67, 72, 77, 70, 220, 64, 77, 67, 220, 83, 81, 64, 72, 75, 72, 77, 70, 220, 82, 79, 64,
     66, 68, 82, 220, 220],
    [83, 64, 65, 82, 197, 64, 77, 67, 198, 77, 68, 86, 198, 198, 75, 72, 77, 68, 82, 201, 198],
    [67, 72, 70, 72, 83, 82, 220, 16, 17, 18, 19, 20, 220, 64, 77, 67, 220, 18, 13, 16, 19, 16, 20, 24],
    [40, 6, 43, 43, 220, 82, 64, 88, 220, 67, 78, 77, 6, 83, 11, 220, 86, 68, 6, 81, 68, 11, 220, 88, 78, 84, 6, 85,
     68],
    [71, 127, 102, 75, 75, 78, 220, 158, 250, 241, 220, 77, 64, 127, 107, 85, 68, 220, 66, 64, 69, 127, 102],
    [160, 116, 255, 162, 244, 229, 162, 110, 94, 162, 250, 231, 163, 102, 118, 162, 254, 120, 163, 248, 226, 161,
     237, 98, 161, 255, 238],
    [68, 76, 78, 73, 72, 220, 172, 253, 246, 222, 172, 253, 239, 235, 172, 253, 237, 121, 220, 76, 72, 87, 68, 67],
    [257, 84, 82, 68, 81, 198, 71, 72, 258, 257, 64, 82, 82, 72, 82, 83, 64, 77, 83, 198],
    [327, 333, 266, 83, 64, 72, 75],
    [83, 71, 68, 220, 83, 71, 68, 77, 220, 83, 71, 68, 81, 68, 220, 83, 71, 68, 78, 81, 88, 220, 78, 83, 71, 68, 81],
    [86, 81, 78, 77, 70, 27, 91, 36, 46, 51, 91],
]

RECORDED_MERGED = [
    [285, 82, 88, 82, 83, 68, 76, 198, 56, 263, 260, 266, 260, 220, 257, 75, 79, 69, 84, 75, 260, 82, 82, 72, 82,
     83, 64, 77, 83, 13, 286],
    [39, 68, 264, 78, 265, 78, 81, 75, 67],
    [220, 220, 75, 68, 64, 67, 259, 70, 260, 77, 67, 256, 81, 64, 72, 75, 259, 70, 262, 79, 64, 66, 68, 82, 271],
    [83, 64, 65, 82, 197, 64, 77, 67, 198, 77, 68, 86, 270, 75, 259, 68, 82, 201, 198],
    [67, 72, 70, 72, 83, 82, 220, 16, 17, 18, 19, 20, 260, 77, 67, 220, 18, 13, 16, 19, 16, 20, 24],
    [40, 280, 262, 64, 88, 220, 67, 78, 77, 6, 83, 11, 265, 68, 6, 266, 11, 220, 88, 263, 6, 85, 68],
    [276, 220, 158, 250, 241, 220, 77, 64, 127, 107, 85, 68, 220, 66, 64, 69, 273],
    [281, 255, 162, 244, 229, 162, 110, 94, 162, 250, 231, 163, 102, 118, 162, 254, 120, 163, 248, 226, 161, 237,
     98, 161, 255, 238],
    [68, 76, 78, 73, 72, 220, 172, 253, 246, 222, 172, 253, 239, 235, 172, 253, 237, 121, 220, 76, 72, 87, 68, 67],
    [285, 84, 82, 261, 198, 71, 72, 286, 285, 64, 82, 82, 72, 82, 83, 64, 77, 83, 198],
    [355, 361, 294, 83, 64, 72, 75],
    [282, 268, 269, 258, 78, 81, 88, 220, 78, 282, 81],
    [86, 81, 78, 77, 70, 27, 91, 36, 46, 51, 91],
]


def merged_vocab() -> tuple[dict[str, int], dict[str, int]]:
    """The tiny vocabulary with one token per merge after the byte tokens; added tokens follow."""
    byte_tokens, added = tiny_vocab(TinySpec())
    vocab = dict(byte_tokens)
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    shift = len(vocab) - len(byte_tokens)
    return vocab, {t: i + shift for t, i in added.items()}


def write_slow_files(folder: Path, vocab: dict[str, int], merges, added: dict[str, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in added.items()},
    }, ensure_ascii=False), encoding="utf-8")
    return folder


def write_tokenizer_json(folder: Path, vocab: dict[str, int], merges, added: dict[str, int]) -> Path:
    """A ``tokenizer.json`` the way Qwen2 ships one (merges as pairs, the newer format), alone."""
    folder.mkdir(parents=True, exist_ok=True)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t, i in added.items()],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}, byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(m) for m in merges]},
    }
    (folder / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(folder, TinySpec())
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Tokenizer:
    vocab, added = merged_vocab()
    return Tokenizer.from_dir(write_slow_files(tmp_path_factory.mktemp("merged"), vocab, MERGES, added))


@pytest.mark.parametrize("which, recorded", [("tiny", RECORDED_TINY), ("merged", RECORDED_MERGED)])
def test_same_ids_as_the_previous_tokenizer(request, which, recorded):
    tok = request.getfixturevalue(which)
    assert [tok.encode(t) for t in TEXTS] == recorded


@pytest.mark.parametrize("which", ["tiny", "merged"])
def test_text_round_trips_whole_and_token_by_token(request, which):
    tok = request.getfixturevalue(which)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        inc = IncrementalDetokenizer(tok)
        pieces = [inc.push([i]) for i in ids] + [inc.flush()]
        assert "".join(pieces) == text
        assert "\ufffd" not in "".join(pieces)  # split characters were held, not replaced


def test_every_special_token_round_trips(tiny):
    _, added = tiny_vocab(TinySpec())
    assert len(added) > 60  # base specials, the codec block and the 11 duplex tokens
    for content, tid in added.items():
        assert tiny.token_to_id(content) == tid
        assert tiny.encode(content) == [tid]
        assert tiny.decode([tid]) == content
        assert tiny.token_bytes(tid) == content.encode()
        assert tiny.encode(f"a{content}b") == [tiny.token_to_id("a"), tid, tiny.token_to_id("b")]
    assert len(tiny) == max(added.values()) + 1
    assert set(tiny.id_to_added) == set(added.values())
    assert not set(tiny.id_to_added) & set(tiny.id_to_token)


def test_tokenizer_json_gives_the_same_as_vocab_and_merges(tmp_path, merged):
    vocab, added = merged_vocab()
    # tokenizer.json carries all but the duplex tokens; those only the config files name are added
    duplex = {t: i for t, i in added.items() if t in ("<|S-S|>", "<|TextPad|>", "<|BackChannel|>")}
    folder = write_tokenizer_json(tmp_path / "fast", vocab, MERGES, {t: i for t, i in added.items() if t not in duplex})
    (folder / "added_tokens.json").write_text(json.dumps(duplex), encoding="utf-8")
    fast = Tokenizer.from_dir(folder)
    assert not (folder / "vocab.json").exists()
    for text in TEXTS + ["<|BackChannel|>ok"]:
        assert fast.encode(text) == merged.encode(text)
        assert fast.decode(fast.encode(text)) == text
    for content, tid in added.items():
        assert fast.token_to_id(content) == tid


def test_from_parts_in_memory_gives_the_recorded_ids():
    vocab, added = merged_vocab()
    tok = Tokenizer.from_parts(vocab, MERGES, added)
    assert [tok.encode(t) for t in TEXTS] == RECORDED_MERGED
    byte_tokens, released_added = tiny_vocab(TinySpec(vocab_layout="released"))
    released = Tokenizer.from_parts(byte_tokens, [], released_added)  # as the GPU benchmark builds it
    assert released.token_to_id("<|BackChannel|>") == 158362 and len(released) == 158363


def test_the_released_ids_with_a_gap_after_the_byte_tokens(tmp_path):
    """The released layout puts the specials at 151643.. and the duplex tokens at 158352..: ids are
    kept as the files give them, not renumbered."""
    folder = tmp_path / "released"
    folder.mkdir()
    write_tiny_tokenizer(folder, TinySpec(vocab_layout="released"))
    tok = Tokenizer.from_dir(folder)
    ids = tok.encode(SYSTEM_PREFIX)
    assert ids[0] == tok.token_to_id("<|BOT|>") > 151000 and ids[-1] == tok.token_to_id("<|EOT|>")
    assert tok.token_to_id("<|S-S|>") == 158352 and tok.token_to_id("<|BackChannel|>") == 158362
    assert tok.encode("<audio_6560><|S-S|>") == [tok.token_to_id("<audio_6560>"), 158352]
    assert len(tok) == 158363
    assert tok.decode(ids) == SYSTEM_PREFIX


def test_text_is_nfc_normalised_like_qwen2(tiny):
    assert tiny.encode("cafe\u0301") == tiny.encode("caf\u00e9")


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json or vocab.json"):
        Tokenizer.from_dir(tmp_path)
    vocab, added = merged_vocab()
    del vocab["Ā"]  # byte 0x00
    write_slow_files(tmp_path / "nobyte", vocab, [], added)
    with pytest.raises(TokenizerError, match="lacks the byte-level token of byte 0x00"):
        Tokenizer.from_dir(tmp_path / "nobyte")
    vocab, added = merged_vocab()
    folder = write_slow_files(tmp_path / "badmerge", vocab, MERGES, added)
    (folder / "merges.txt").write_text("#version: 0.2\nĠ t\nĠthe\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"merges.txt:3: a merge is two tokens"):
        Tokenizer.from_dir(folder)
    (folder / "merges.txt").write_text("#version: 0.2\nĠ zz\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not a usable tokenizer"):
        Tokenizer.from_dir(folder)
    (folder / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not readable JSON"):
        Tokenizer.from_dir(folder)
