"""Strict loading of ``flow.pt`` and ``hift.pt`` into our modules.

Checkpoint quirks are resolved here so the forward code stays clean:

* hift.pt keys may carry a ``generator.`` prefix (stripped, as the reference does);
* weight-normed convs may be spelled ``<m>.weight_g/<m>.weight_v`` (legacy) or
  ``<m>.parametrizations.weight.original0/original1`` (torch >= 2.1); both are folded into a plain
  ``<m>.weight`` with the same ``torch._weight_norm`` the parametrization uses;
* HiFT widths are read from ``conv_pre`` and the first F0 conv (the reference has no config file).

Any missing, unexpected or mis-shaped tensor raises ``CheckpointError`` naming it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .config import CheckpointError, FlowConfig, HiftConfig
from .flow import Flow
from .hift import HiFTGenerator

_WN_SPELLINGS = (("weight_g", "weight_v"), ("parametrizations.weight.original0", "parametrizations.weight.original1"))


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors, truncated files
        raise CheckpointError(f"{path.name}: cannot be read as a torch state dict: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path.name}: expected a dict of tensors")
    return dict(state)


def _check_and_load(module: nn.Module, state: dict[str, torch.Tensor], file: str) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{file}: missing tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"{file}: unexpected tensor {unexpected[0]!r}" + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name, ref in expected.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(state[name].shape)}, expected {tuple(ref.shape)}")
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def load_flow(folder: str | Path, config: FlowConfig, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, noise_seed: int = 0) -> Flow:
    state = _read_state(Path(folder) / "flow.pt")
    flow = Flow(config, noise_seed)
    _check_and_load(flow, state, "flow.pt")
    return flow.to(device=device, dtype=dtype).eval()


def _hift_config_from_state(state: dict[str, torch.Tensor]) -> HiftConfig:
    def weight(name: str) -> torch.Tensor:
        for _, v in _WN_SPELLINGS:
            if f"{name}.{v}" in state:
                return state[f"{name}.{v}"]
        raise CheckpointError(f"hift.pt: missing tensor {name + '.weight_v'!r} (or its parametrizations spelling)")

    base = weight("conv_pre").shape[0]
    cond = weight("f0_predictor.condnet.0").shape[0]
    return replace(HiftConfig(), base_channels=int(base), cond_channels=int(cond))


def _fold_weight_norm(state: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """Rewrite WN pairs into ``<m>.weight``; reject a module given in both or neither spelling."""
    expected = module.state_dict()
    out = dict(state)
    for name in expected:
        if not name.endswith(".weight") or name in state:
            continue
        prefix = name[: -len(".weight")]
        found = [(g, v) for g, v in _WN_SPELLINGS if f"{prefix}.{g}" in state or f"{prefix}.{v}" in state]
        if not found:
            continue  # reported as missing by the strict check
        if len(found) > 1:
            raise CheckpointError(f"hift.pt: {prefix!r} has both weight-norm spellings")
        g_key, v_key = (f"{prefix}.{found[0][0]}", f"{prefix}.{found[0][1]}")
        if g_key not in state or v_key not in state:
            missing = g_key if g_key not in state else v_key
            raise CheckpointError(f"hift.pt: missing tensor {missing!r}")
        g, v = out.pop(g_key), out.pop(v_key)
        ref = expected[name]
        if tuple(v.shape) != tuple(ref.shape):
            raise CheckpointError(f"hift.pt: tensor {v_key!r} has shape {tuple(v.shape)}, expected {tuple(ref.shape)}")
        g_shape = (ref.shape[0],) + (1,) * (ref.dim() - 1)
        if tuple(g.shape) != g_shape:
            raise CheckpointError(f"hift.pt: tensor {g_key!r} has shape {tuple(g.shape)}, expected {g_shape}")
        out[name] = torch._weight_norm(v.float(), g.float(), 0)
    return out


def load_hift(folder: str | Path, device: torch.device | str = "cpu") -> HiFTGenerator:
    raw = _read_state(Path(folder) / "hift.pt")
    state = {k.removeprefix("generator."): v for k, v in raw.items()}
    cfg = _hift_config_from_state(state)
    hift = HiFTGenerator(cfg)
    state = _fold_weight_norm(state, hift)
    _check_and_load(hift, state, "hift.pt")
    return hift.to(device).eval()


def hift_wn_module_names(hift: HiFTGenerator) -> list[str]:
    """Modules that carry weight norm in the released checkpoint (all convs except source_downs)."""
    names = []
    for name, mod in hift.named_modules():
        if isinstance(mod, (nn.Conv1d, nn.ConvTranspose1d)) and not name.startswith("source_downs"):
            names.append(name)
    return names
