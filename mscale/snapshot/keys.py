"""Snapshots name tensors by the unwrapped model's names, so a restart resumes whatever wraps the
model now: DDP on 2 ranks then the plain model on 1 (or the reverse), compiled then eager.

- Taken: the engine holds the model inside DDP's (and DataParallel's) `module` and
  torch.compile's `_orig_mod` (`bare`): its state dict and parameter names carry no wrapper's
  prefix. FSDP2's `fully_shard` keeps the model itself (no prefix to strip).
- Loaded: a snapshot whose names are not the live ones (one written with a wrapper's prefix
  before this, or by a job whose submodules were compiled or wrapped) is renamed to them where
  both name the same tensor once the wrappers' parts are dropped (`canonical`): a leading
  `module.` or `_orig_mod.`, and `_orig_mod.`, `_fsdp_wrapped_module.` or
  `_checkpoint_wrapped_module.` anywhere. Names that still differ are left as they are, for the
  fit check to refuse with both sides named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mscale.snapshot.values import StateDict

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine

__all__ = ["bare", "canonical", "renamed", "renamed_for", "wrapper_prefix"]

_LEADING = ("module", "_orig_mod")  # DDP / DataParallel, torch.compile: the whole model wrapped
_ANYWHERE = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")  # a wrapped submodule
_WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module", "OptimizedModule": "_orig_mod"}


def bare(model: nn.Module) -> nn.Module:
    """The model inside any DDP, DataParallel and torch.compile wrappers around it (in any order)."""
    while (attr := _WRAPPERS.get(type(model).__name__)) is not None:
        inner = getattr(model, attr, None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def wrapper_prefix(model: nn.Module) -> str:
    """What the wrappers around `model` put before its bare model's names (`module.` for DDP,
    `_orig_mod.` for torch.compile, both for one around the other; "" for none)."""
    prefix = ""
    while (attr := _WRAPPERS.get(type(model).__name__)) is not None:
        inner = getattr(model, attr, None)
        if not isinstance(inner, nn.Module):
            break
        prefix, model = f"{prefix}{attr}.", inner
    return prefix


def canonical(name: str) -> str:
    """`name` with every wrapper's part dropped (see the module docstring)."""
    parts = name.split(".")
    i = 0
    while i < len(parts) - 1 and parts[i] in _LEADING:
        i += 1
    return ".".join([p for p in parts[i:-1] if p not in _ANYWHERE] + parts[-1:])


def _mapping(saved: set[str], live: set[str]) -> dict[str, str]:
    """saved name -> live name, for the saved names that are not live but name a live tensor
    once canonical (each live name taken once)."""
    missing = saved - live
    if not missing:
        return {}
    by_canon: dict[str, list[str]] = {}
    for name in live - saved:
        by_canon.setdefault(canonical(name), []).append(name)
    out: dict[str, str] = {}
    for name in missing:
        match = by_canon.get(canonical(name), [])
        if len(match) == 1:
            out[name] = match[0]
    return out if len(set(out.values())) == len(out) else {}


def _split(key: str) -> tuple[str, str, str]:
    """'model/<name>' -> ('model', name, ''); 'optim/<name>/<state key>' -> ('optim', name, key)."""
    kind, _, rest = key.partition("/")
    if kind == "optim":
        name, _, sub = rest.rpartition("/")
        return kind, name, sub
    return kind, rest, ""


def renamed(
    tensors: dict[str, dict[str, torch.Tensor]], objects: StateDict, model_names: set[str], param_names: set[str]
) -> tuple[dict[str, dict[str, torch.Tensor]], StateDict]:
    """A loaded snapshot's (tensors per file, objects) with its model keys and optimizer
    parameter names renamed to the live `model_names` (state dict keys) and `param_names`
    (parameter names) where they differ only by wrappers; unchanged when nothing needs it."""
    saved_model: set[str] = set()
    saved_params: set[str] = set()
    for d in tensors.values():
        for key in d:
            kind, name, _ = _split(key)
            (saved_model if kind == "model" else saved_params if kind == "optim" else set()).add(name)
    optimizer = objects.get("optimizer")
    if isinstance(optimizer, dict):
        for g in optimizer.get("param_groups", []):
            saved_params.update(g.get("params", []))
    model_map = _mapping(saved_model, model_names)
    param_map = _mapping(saved_params, param_names)
    if not model_map and not param_map:
        return tensors, objects
    out: dict[str, dict[str, torch.Tensor]] = {}
    for f, d in tensors.items():
        out[f] = {}
        for key, t in d.items():
            kind, name, sub = _split(key)
            if kind == "model" and name in model_map:
                key = f"model/{model_map[name]}"
            elif kind == "optim" and name in param_map:
                key = f"optim/{param_map[name]}/{sub}"
            out[f][key] = t
    if isinstance(optimizer, dict) and param_map:
        optimizer = {
            **optimizer,
            "param_groups": [
                {**g, "params": [param_map.get(n, n) for n in g.get("params", [])]}
                for g in optimizer.get("param_groups", [])
            ],
            "scalars": {param_map.get(n, n): v for n, v in optimizer.get("scalars", {}).items()},
        }
        objects = {**objects, "optimizer": optimizer}
    return out, objects


def renamed_for(
    engine: SnapshotEngine, tensors: dict[str, dict[str, torch.Tensor]], objects: StateDict
) -> tuple[dict[str, dict[str, torch.Tensor]], StateDict]:
    """`renamed` to the names of `engine`'s live model and its optimizer's parameters."""
    named = engine.named_optimizer
    params = set(named.names) if named is not None else set()
    return renamed(tensors, objects, set(engine.model.state_dict().keys()), params)
