"""`mscale snapshot export --format dcp`: one snapshot as a torch.distributed.checkpoint (DCP)
checkpoint, for tools that read DCP (torchtitan, torch.distributed.checkpoint.load, the
format converters `torch.distributed.checkpoint.format_utils` ships).

The checkpoint holds the state dict in the FQN-keyed form of torch.distributed.checkpoint's
`get_state_dict`:

    {"model": {fqn: tensor},                          every parameter and buffer
     "optim": {"state": {fqn: {key: value}},          tensors and scalars per parameter
               "param_groups": [{..., "params": [fqn, ...]}]},
     "train": {"step": int}}

so `dcp.load({"model": model.state_dict()}, checkpoint_id=DIR)` fills a model in place. The
snapshot is verified first (sizes and SHA-256 against its manifest); a refused one exports
nothing. Under DDP every rank's snapshot holds the whole model: rank 0's is exported unless
another is named. Written by one process with no process group (DCP's single-process save).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from mscale.snapshot.format import SnapshotError
from mscale.snapshot.tensors import load_snapshot
from mscale.snapshot.values import StateDict, as_dict, as_int


def state_dict_of(snapshot: str | os.PathLike[str]) -> StateDict:
    """The DCP state dict (see the module docstring) of one verified snapshot directory."""
    tensors, objects, _manifest = load_snapshot(snapshot)
    sharding = as_dict(as_dict(objects.get("extra") or {}, "the extras' state").get("sharding") or {}, "sharding")
    if sharding.get("sharded"):
        raise SnapshotError(
            f"{snapshot}: holds one rank's shard of a model sharded over {sharding.get('world_size')} ranks "
            "(FSDP2); exporting a shard as a whole-model checkpoint would mislead. Save a sharded model "
            "with torch.distributed.checkpoint from the job"
        )
    model: dict[str, torch.Tensor] = {}
    state: dict[str, StateDict] = {}
    for file in tensors.values():
        for key, t in file.items():
            kind, _, rest = key.partition("/")
            if kind == "model":
                model[rest] = t
            elif kind == "optim":
                fqn, _, name = rest.rpartition("/")
                state.setdefault(fqn, {})[name] = t
    opt = as_dict(objects.get("optimizer") or {}, "the optimizer state")
    for fqn, scalars in as_dict(opt.get("scalars") or {}, "the optimizer's scalars").items():
        state.setdefault(fqn, {}).update(as_dict(scalars, f"the scalars of {fqn}"))
    step = as_int(objects["step"], "the step")
    out: StateDict = {"model": model, "train": {"step": step}}
    if opt:
        out["optim"] = {"state": state, "param_groups": opt.get("param_groups", [])}
    return out


def export(snapshot: str | os.PathLike[str], out: str | os.PathLike[str]) -> StateDict:
    """Write the snapshot at `snapshot` as a DCP checkpoint in `out` (a new or empty directory);
    a summary of what was written."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SnapshotError(f"{out}: exists and is not an empty directory (refusing to mix checkpoints)")
    sd = state_dict_of(snapshot)
    out.mkdir(parents=True, exist_ok=True)
    dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    optim = as_dict(sd.get("optim", {}), "optim")
    return {
        "snapshot": str(snapshot),
        "out": str(out),
        "step": as_dict(sd["train"], "train")["step"],
        "model_tensors": len(as_dict(sd["model"], "model")),
        "optimizer_parameters": len(as_dict(optim.get("state", {}), "optim state")),
    }
