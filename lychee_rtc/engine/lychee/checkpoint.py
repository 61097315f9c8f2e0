"""Load a Lychee-FD checkpoint folder: config.json + sharded safetensors through the index file.

The inventory is checked before a single weight is read: the set of tensor names in the shards
must be exactly the set the config implies (982 for the released layout), each with the expected
shape, each stored once. A missing, unexpected, duplicated or mis-shaped tensor is an error that
names it. The three side embedding tables (``{stoken,control,merge}_model.embed_tokens``) are
checked for shape and then skipped: every channel uses ``model.embed_tokens``, so reading them
would only cost ~3.4 GB of memory in bf16.

The model is built on the ``meta`` device and materialised once on the target device, then each
tensor is streamed from its shard straight into its (possibly fused) destination, so peak memory is
the model plus one tensor.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from .config import LycheeConfig, load_config
from .model import LycheeFD, checkpoint_targets, ignored_tensors

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


class CheckpointError(ValueError):
    """The weights do not match the config; the message names the offending tensors."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of bf16, fp16, fp32; got {name!r}") from None


def _shard_map(root: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index (or the single-file checkpoint)."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{index}: not a readable JSON index ({exc})") from None
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' is missing or empty")
        return {str(k): str(v) for k, v in weight_map.items()}
    single = root / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {k: SINGLE_FILE for k in f.keys()}
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{single}: not a readable safetensors file ({exc})") from None
    raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


@dataclass(frozen=True)
class Inventory:
    """What is on disk, after the checks: name -> (shard, shape), and name -> safetensors dtype."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    dtypes: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tensors)


def check_inventory(root: Path, expected: dict[str, tuple[int, ...]]) -> Inventory:
    """Compare the shards' headers with the expected name -> shape map; raise on any difference."""
    weight_map = _shard_map(root)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    dtypes: dict[str, str] = {}
    duplicates: list[str] = []
    for shard in sorted(set(weight_map.values())):
        path = root / shard
        if not path.is_file():
            raise CheckpointError(f"{root}: shard {shard} named in {INDEX_FILE} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in found:
                        duplicates.append(name)
                        continue
                    view = f.get_slice(name)
                    found[name] = (shard, tuple(view.get_shape()))
                    dtypes[name] = str(view.get_dtype())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    if duplicates:
        raise CheckpointError(f"tensors stored more than once: {_list(duplicates)}")
    not_indexed = [n for n, (shard, _) in found.items() if weight_map.get(n) not in (None, shard)]
    if not_indexed:
        raise CheckpointError(f"tensors stored in a shard other than the index says: {_list(not_indexed)}")
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    if missing:
        raise CheckpointError(f"missing tensors: {_list(missing)}")
    if unexpected:
        raise CheckpointError(f"unexpected tensors: {_list(unexpected)}")
    bad = [f"{n} {found[n][1]} (expected {expected[n]})" for n in expected if found[n][1] != expected[n]]
    if bad:
        raise CheckpointError(f"tensors with the wrong shape: {_list(bad)}")
    return Inventory(found, dtypes)


def expected_inventory(model: LycheeFD) -> dict[str, tuple[int, ...]]:
    expected = {name: tuple(t.shape) for name, t in checkpoint_targets(model).items()}
    expected.update(ignored_tensors(model.cfg))
    return expected


def load_model(
    root: str | Path,
    *,
    dtype: str | torch.dtype = "bf16",
    device: str | torch.device = "cpu",
    config: LycheeConfig | None = None,
    progress: bool = True,
) -> LycheeFD:
    """Build Lychee-FD from a checkpoint folder and load every weight, checked and strict."""
    root = Path(root)
    cfg = config or load_config(root)
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device)
    # Build on meta in the target dtype, so materialising allocates the weights once, already in
    # bf16/fp16 (an fp32 build then cast would peak at 3x the bf16 size on the GPU).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("meta"):
            model = LycheeFD(cfg)
    finally:
        torch.set_default_dtype(previous)
    inventory = check_inventory(root, expected_inventory(model))
    model = model.to_empty(device=device)
    targets = checkpoint_targets(model)
    by_shard: dict[str, list[str]] = {}
    for name in targets:
        by_shard.setdefault(inventory.tensors[name][0], []).append(name)
    bar = tqdm(total=len(targets), desc="loading Lychee-FD", unit="tensor", disable=not progress)
    loaded: set[str] = set()
    with torch.no_grad():
        for shard, names in sorted(by_shard.items()):
            # safetensors can place tensors on CUDA directly, skipping a host copy.
            open_device = str(device) if device.type in ("cuda", "cpu") else "cpu"
            with safe_open(str(root / shard), framework="pt", device=open_device) as f:
                for name in names:
                    targets[name].copy_(f.get_tensor(name).to(torch_dtype))
                    loaded.add(name)
                    bar.update(1)
    bar.close()
    # Every destination must have been written: with to_empty() an unwritten parameter would be
    # uninitialised memory, so this is checked, not assumed.
    assert loaded == set(targets), "loader bug: not every parameter was written"
    model.eval()
    log.info("Lychee-FD loaded: %d tensors read, %d side tables skipped, dtype %s, device %s",
             len(loaded), len(ignored_tensors(cfg)), torch_dtype, device)
    return model
