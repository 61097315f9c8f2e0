"""Check a ``token2wav/`` folder against the released inventory without loading the weights.

The five released files must be there; ``flow.pt`` and ``hift.pt`` are opened memory-mapped, so
only their pickled headers are read: every tensor's name, shape and dtype is compared with what
``flow.yaml`` (flow) and the checkpoint's own widths (HiFT, which has no config file) imply, with
either weight-norm spelling and an optional ``generator.`` prefix, as the loader accepts them. For
the release the counts are fixed: 605 flow tensors (155,802,352 parameters) and 328 HiFT tensors
(20,821,295). Any difference is a :class:`CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import CheckpointError, load_flow_config
from .flow import Flow
from .hift import HiFTGenerator
from .loader import _WN_SPELLINGS, _hift_config_from_state, hift_wn_module_names

FILES = ("flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx")
RELEASED = {"flow.pt": (605, 155_802_352), "hift.pt": (328, 20_821_295)}


@dataclass(frozen=True)
class VocoderFolderReport:
    path: str
    files: int
    bytes: int
    flow_tensors: int
    flow_params: int
    hift_tensors: int
    hift_params: int
    layout: str  # "released" or "other"


def _headers(path: Path) -> dict[str, torch.Tensor]:
    """The state dict with memory-mapped storage: shapes and dtypes without reading the data."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a truncated or foreign file
        raise CheckpointError(f"{path}: cannot be read as a torch state dict ({exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors")
    return dict(state)


def _compare(file: Path, found: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    for what, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise CheckpointError(f"{file}: {what} tensors {', '.join(names[:3])}{more}")
    for name, shape in expected.items():
        if tuple(found[name].shape) != shape:
            raise CheckpointError(f"{file}: tensor {name} has shape {tuple(found[name].shape)}, expected {shape}")
    odd = sorted(n for n, t in found.items() if t.dtype != torch.float32)
    if odd:
        raise CheckpointError(f"{file}: tensor {odd[0]} is {found[odd[0]].dtype}, the release stores float32")


def expected_hift_names(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The names and shapes ``hift.pt`` must hold, in the weight-norm spelling the file uses per module."""
    cfg = _hift_config_from_state(state)
    with torch.device("meta"):
        hift = HiFTGenerator(cfg)
    wn = set(hift_wn_module_names(hift))
    out: dict[str, tuple[int, ...]] = {}
    for name, t in hift.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module not in wn or not name.endswith(".weight"):
            out[name] = tuple(t.shape)
            continue
        g_name, v_name = next(((f"{module}.{g}", f"{module}.{v}") for g, v in _WN_SPELLINGS
                               if f"{module}.{g}" in state or f"{module}.{v}" in state),
                              (f"{module}.weight_g", f"{module}.weight_v"))
        out[g_name] = (t.shape[0],) + (1,) * (t.dim() - 1)
        out[v_name] = tuple(t.shape)
    return out


def verify_token2wav_folder(folder: str | Path, *, released: bool = True) -> VocoderFolderReport:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    missing = [n for n in FILES if not (folder / n).is_file() or (folder / n).stat().st_size == 0]
    if missing:
        raise CheckpointError(f"{folder}: missing or empty {', '.join(missing)}")
    config = load_flow_config(folder)
    with torch.device("meta"):
        flow = Flow(config)
    flow_state = _headers(folder / "flow.pt")
    _compare(folder / "flow.pt", flow_state, {k: tuple(v.shape) for k, v in flow.state_dict().items()})
    hift_state = {k.removeprefix("generator."): v for k, v in _headers(folder / "hift.pt").items()}
    _compare(folder / "hift.pt", hift_state, expected_hift_names(hift_state))
    counts = {"flow.pt": (len(flow_state), sum(t.numel() for t in flow_state.values())),
              "hift.pt": (len(hift_state), sum(t.numel() for t in hift_state.values()))}
    if released:
        for file, (n, params) in counts.items():
            if (n, params) != RELEASED[file]:
                raise CheckpointError(f"{folder / file}: {n} tensors with {params:,} parameters; the release has "
                                      f"{RELEASED[file][0]} with {RELEASED[file][1]:,} (--layout any accepts "
                                      f"another consistent one)")
    size = sum((folder / n).stat().st_size for n in FILES)
    layout = "released" if all(counts[f] == RELEASED[f] for f in RELEASED) else "other"
    return VocoderFolderReport(str(folder), len(FILES), size, *counts["flow.pt"], *counts["hift.pt"], layout)
