"""Check a Lychee-FD folder against the released inventory, from headers only.

What a download is checked against, and what ``lychee-rtc check`` reports, before anything is
loaded: the files the loader needs (``config.json``, the safetensors index and every shard it
names, the tokenizer), then every tensor's name, shape and dtype as the shards' headers state
them against what ``config.json`` implies, and, for the release, that ``config.json`` is the
released layout (982 tensors: 28/4/4/4 Qwen2 layers, hidden 3584, vocab 158363, a 32-layer
1280-wide encoder). No weight is read: a 26 GB folder is checked in about a second.

Every problem is an :class:`InventoryError` whose message names the file or tensor.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import INDEX_FILE, CheckpointError, check_inventory, expected_inventory
from .config import ConfigError, LycheeConfig, load_config
from .model import LycheeFD

FLOAT_DTYPES = ("BF16", "F16", "F32")  # safetensors' names


class InventoryError(ValueError):
    """The folder is not the expected checkpoint; the message names the file or tensor."""


@dataclass(frozen=True)
class ModelFolderReport:
    path: str
    files: int
    bytes: int
    tensors: int  # in the shards, side tables included
    params: int  # parameters the model loads (side tables excluded)
    dtype: str  # the tensors' safetensors dtype ("BF16"), or the mix ("980 BF16 + 2 F32")
    layout: str  # "released" or a description of the dimensions


def describe_layout(cfg: LycheeConfig) -> str:
    return (f"{cfg.text.num_hidden_layers}/{cfg.stoken.num_hidden_layers}/{cfg.control.num_hidden_layers}/"
            f"{cfg.merge.num_hidden_layers} layers, hidden {cfg.text.hidden_size}, vocab {cfg.text.vocab_size}, "
            f"encoder {cfg.audio.n_audio_layer} x {cfg.audio.n_audio_state}")


def is_released_layout(cfg: LycheeConfig) -> bool:
    """The released dimensions (duplex_protocol / token2wav specs, E.2 item 5)."""
    return (cfg.text.num_hidden_layers, cfg.stoken.num_hidden_layers, cfg.control.num_hidden_layers,
            cfg.merge.num_hidden_layers, cfg.control_branch_index, cfg.text.hidden_size, cfg.text.vocab_size,
            cfg.text.intermediate_size, cfg.text.num_attention_heads, cfg.text.num_key_value_heads,
            cfg.audio.n_audio_layer, cfg.audio.n_audio_state, cfg.audio.n_audio_head) == \
        (28, 4, 4, 4, 20, 3584, 158363, 18944, 28, 4, 32, 1280, 20)


RELEASED_LAYOUT = "28/4/4/4 layers, hidden 3584, vocab 158363, encoder 32 x 1280"
RELEASED_TENSORS = 982


def _tokenizer_files(root: Path) -> list[str]:
    if (root / "tokenizer.json").is_file():
        return ["tokenizer.json"]
    missing = [n for n in ("vocab.json", "merges.txt") if not (root / n).is_file()]
    if missing:
        raise InventoryError(f"{root}: no tokenizer: neither tokenizer.json nor {' and '.join(missing)}")
    return ["vocab.json", "merges.txt"]


def verify_model_folder(root: str | Path, *, released: bool = True, tokenizer: bool = True) -> ModelFolderReport:
    """Check a Lychee-FD folder from its headers; ``released``: also require the released layout."""
    root = Path(root)
    if not root.is_dir():
        raise InventoryError(f"{root}: no such folder")
    try:
        cfg = load_config(root)
    except ConfigError as exc:
        raise InventoryError(str(exc)) from None
    if released and not is_released_layout(cfg):
        raise InventoryError(f"{root / 'config.json'}: {describe_layout(cfg)} is not the released layout "
                             f"({RELEASED_LAYOUT}: {RELEASED_TENSORS} tensors); --layout any accepts another "
                             f"consistent one")
    files = ["config.json"] + _tokenizer_files(root)
    with torch.device("meta"):
        model = LycheeFD(cfg)
    expected = expected_inventory(model)
    try:
        inventory = check_inventory(root, expected)
    except CheckpointError as exc:
        raise InventoryError(f"{root}: {exc}") from None
    shards = sorted({shard for shard, _ in inventory.tensors.values()})
    files += shards + ([INDEX_FILE] if (root / INDEX_FILE).is_file() else [])
    if released and len(inventory) != RELEASED_TENSORS:  # cannot differ once the layout matched
        raise InventoryError(f"{root}: {len(inventory)} tensors, the release has {RELEASED_TENSORS}")
    # Any float dtype the loader converts from; the release's own is not documented, so a mix (say,
    # an fp32 encoder beside bf16 decoder stacks) is reported, not refused.
    odd = sorted(n for n, d in inventory.dtypes.items() if d not in FLOAT_DTYPES)
    if odd:
        raise InventoryError(f"{root}: tensors the loader cannot read as weights: "
                             + ", ".join(f"{n} ({inventory.dtypes[n]})" for n in odd[:4])
                             + (f" and {len(odd) - 4} more" if len(odd) > 4 else ""))
    counts = Counter(inventory.dtypes.values())
    dtype = " + ".join(f"{d}" if len(counts) == 1 else f"{n} {d}" for d, n in counts.most_common())
    if tokenizer:
        _check_tokenizer(root, cfg)
    params = sum(_numel(s) for n, s in expected.items() if "embed_tokens" not in n or n.startswith("model."))
    size = sum((root / f).stat().st_size for f in files)
    return ModelFolderReport(str(root), len(files), size, len(inventory), params, dtype,
                             "released" if is_released_layout(cfg) else describe_layout(cfg))


def _check_tokenizer(root: Path, cfg: LycheeConfig) -> None:
    """The tokenizer loads and holds every special token config.json does not give by id."""
    from .tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.from_dir(root)
        cfg.resolve_tokens(tok)
    except (TokenizerError, ConfigError) as exc:
        raise InventoryError(f"{root}: {exc}") from None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

