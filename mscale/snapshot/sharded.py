"""Snapshots of a sharded model (FSDP2 `fully_shard`): each rank saves and restores its shard.

The snapshot engine copies plain tensors. For a model whose parameters are DTensors, `LocalView`
gives it plain views of this rank's shards instead: a mirror of the module tree whose
parameters and buffers are `to_local()` views sharing storage with the shards, and an
optimizer facade whose state, groups and state_dict are the real optimizer's with every
DTensor read as its local tensor. What the engine captures is then each rank's shard (in
`rank_NNNNN/` directories, as for any job of several ranks), and what it restores in place
lands in the shards themselves, bitwise. A state handed over whole (a resume from disk on a
fresh optimizer) is turned back into DTensors with the placements of the parameter it
belongs to. Collectives (the agreed rollback, the resume) are the engine's, as for DDP.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

from mscale.snapshot.values import StateDict, as_dict


def is_sharded(model: nn.Module) -> bool:
    """A parameter is a DTensor, or an FSDP2 `fully_shard` module is in `model` (during a forward
    FSDP2 swaps in unsharded plain parameters: the fuse asks then too, mscale.hook.fuse.fuse)."""
    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


class _Group(MutableMapping[str, Any]):
    """An optimizer param group seen through the mirror: its params are the mirror's; every
    other key reads and writes the real group (a restored lr reaches the real optimizer)."""

    def __init__(self, group: StateDict, params: list[nn.Parameter]) -> None:
        self._group, self._params = group, params

    def __getitem__(self, k: str) -> Any:
        return self._params if k == "params" else self._group[k]

    def __setitem__(self, k: str, v: Any) -> None:
        if k == "params":
            raise KeyError("params: the mirror's parameters are fixed")
        self._group[k] = v

    def __delitem__(self, k: str) -> None:
        del self._group[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)


class _State(MutableMapping[str, Any]):
    """One parameter's optimizer state: DTensor values read as their local tensors (views:
    an in-place copy lands in the shard), others as they are; writes go to the real state."""

    def __init__(self, state: StateDict) -> None:
        self._state = state

    def __getitem__(self, k: str) -> Any:
        return _local(self._state[k])

    def __setitem__(self, k: str, v: Any) -> None:
        cur: Any = self._state.get(k)
        if cur is not None and hasattr(cur, "to_local") and isinstance(v, torch.Tensor) and not hasattr(v, "to_local"):
            with torch.no_grad():
                cur.to_local().copy_(v)
        else:
            self._state[k] = v

    def __delitem__(self, k: str) -> None:
        del self._state[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class LocalOptimizer:
    """The optimizer as the snapshot engine sees it for a sharded model (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, mirror_of: dict[int, nn.Parameter]) -> None:
        self.optimizer = optimizer
        self._mirror_of = mirror_of

    @property
    def param_groups(self) -> list[MutableMapping[str, Any]]:
        return [_Group(g, [self._mirror_of[id(p)] for p in g["params"]]) for g in self.optimizer.param_groups]

    @property
    def state(self) -> dict[nn.Parameter, MutableMapping[str, Any]]:
        return {
            self._mirror_of[id(p)]: _State(self.optimizer.state[p])
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p in self.optimizer.state
        }

    def state_dict(self) -> StateDict:
        sd = self.optimizer.state_dict()
        return {**sd, "state": {i: {k: _local(v) for k, v in st.items()} for i, st in sd["state"].items()}}

    def load_state_dict(self, sd: StateDict) -> None:
        from torch.distributed.tensor import DTensor

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state: dict[int, StateDict] = {}
        saved = sd["state"]
        if not isinstance(saved, dict):
            raise TypeError(f"the optimizer's state must be a dict, not {type(saved).__name__}")
        for i, st in saved.items():  # parameter index -> its state
            p = params[int(i)]
            state[i] = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                if isinstance(v, torch.Tensor) and hasattr(p, "device_mesh") and v.shape == p.to_local().shape
                else v
                for k, v in as_dict(st, f"the state of parameter {i}").items()
            }
        self.optimizer.load_state_dict({**sd, "state": state})


class LocalView:
    """The mirror of `model` (and of `optimizer`) over this rank's shards."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._modules: dict[int, nn.Module] = {}
        self._params: dict[int, nn.Parameter] = {}
        self.model = self._mirror(model)
        self.optimizer = LocalOptimizer(optimizer, self._params) if optimizer is not None else None

    def _mirror(self, module: nn.Module) -> nn.Module:
        mirror = nn.Module()
        self._modules[id(module)] = mirror
        for name, p in module.named_parameters(recurse=False):
            local = nn.Parameter(_local(p.detach()), requires_grad=p.requires_grad)  # shares the shard's storage
            self._params[id(p)] = local
            mirror.register_parameter(name, local)
        for name, b in module.named_buffers(recurse=False):
            mirror.register_buffer(name, _local(b), persistent=name not in module._non_persistent_buffers_set)
        for name, child in module.named_children():
            mirror.add_module(name, self._mirror(child))
        return mirror

    def module(self, real: nn.Module) -> nn.Module:
        """The mirror of a sub-module of the model (an MPU)."""
        return self._modules[id(real)]


def layout_of(model: nn.Module) -> dict[str, StateDict]:
    """Where each sharded parameter's local tensor on this rank lies in the whole one: fqn ->
    {"shape": global shape, "offset": global offset of the local box, "local": its shape}, or
    {"unsupported": placements} for a placement whose local part is not one box (Partial,
    strided shards). Recorded in every snapshot so that another world size can re-shard it
    (mscale.snapshot.reshard)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, StateDict] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not hasattr(param, "device_mesh"):
            continue
        p: Any = param  # a DTensor
        if not all(type(pl) is Shard or isinstance(pl, Replicate) for pl in p.placements):
            out[name] = {"unsupported": str(tuple(p.placements))}
            continue
        local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        out[name] = {"shape": list(p.shape), "offset": list(offset), "local": list(local)}
    return out


class ShardingMarker:
    """Snapshotted with a sharded model's state (the engine's `extra`), so that tools reading a
    snapshot know it holds one rank's shard, not the whole model, and where that shard lies
    (`layout_of`). It describes the live job: loading a snapshot's (another world's, re-sharded)
    changes nothing."""

    def __init__(self, world_size: int, model: nn.Module | None = None) -> None:
        self.world_size = world_size
        self.layout = layout_of(model) if model is not None else {}

    def state_dict(self) -> StateDict:
        return {"sharded": True, "world_size": self.world_size, "layout": self.layout}

    def load_state_dict(self, state: StateDict) -> None:
        pass
