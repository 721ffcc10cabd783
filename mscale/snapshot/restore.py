"""Putting a snapshot's state into the engine's live objects (`apply`), for a rollback and a
resume alike (engine.py). Keys and shapes are checked first (fit.py): a snapshot that does not
fit the live model changes nothing."""

from __future__ import annotations

import copy
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import mscale.snapshot.distributed as mdist
from mscale.findings import Reason, Severity
from mscale.snapshot import worlds
from mscale.snapshot.fit import check_fits
from mscale.snapshot.inplace import load_newest_valid
from mscale.snapshot.mark import put_back_stateful
from mscale.snapshot.values import StateDict, as_dict, as_int

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine

__all__ = ["apply", "resume"]


def _split(
    tensors: dict[str, dict[str, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The model's state dict, and the optimizer's tensors per parameter name."""
    model_sd: dict[str, torch.Tensor] = {}
    opt_tensors: dict[str, dict[str, torch.Tensor]] = {}
    for d in tensors.values():
        for k, t in d.items():
            if k.startswith("model/"):
                model_sd[k[6:]] = t
            elif k.startswith("optim/"):
                fqn, _, name = k[6:].rpartition("/")
                opt_tensors.setdefault(fqn, {})[name] = t
    return model_sd, opt_tensors


def apply(
    engine: SnapshotEngine,
    tensors: dict[str, dict[str, torch.Tensor]],
    objects: StateDict,
    *,
    where: str,
    owned: bool = False,
) -> None:
    """Restores the live objects from a snapshot's tensors and objects. owned: the tensors
    are fresh (read from disk) and may become the optimizer's state without a copy."""
    check_fits(engine, tensors, objects, where)
    engine.copier.fence()  # a snapshot copy still reading the live tensors finishes first
    if engine.data is not None:  # first: it validates before it changes anything
        engine.data.load_state_dict(copy.deepcopy(objects["data"]))
    model_sd, opt_tensors = _split(tensors)
    model = engine.model
    if any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in model.modules()):
        with torch.no_grad():  # the model customises loading: go through it
            model.load_state_dict(model_sd, strict=True)
    else:  # keys and shapes were checked: copy in place, in parallel
        live = model.state_dict()
        engine.copier.parallel_copy([(live[k], t) for k, t in model_sd.items()])
    if engine.named_optimizer is not None:
        engine.named_optimizer.restore(
            opt_tensors,
            as_dict(objects["optimizer"], "the optimizer state"),
            copy_pairs=engine.copier.parallel_copy,
            owned=owned,
        )
    put_back_stateful(engine, objects, "the snapshot's")
    engine.step = as_int(objects["step"], "the step")
    engine.step_mark.take(engine)  # the restored step's end: a step after it can be run again from its start


def _sources(engine: SnapshotEngine) -> tuple[list[tuple[int, Path, str]], dict[int, worlds.Candidate]]:
    """What a resume tries, newest first, the node tier (or, for a rank whose node copy is
    gone, its peer's replica: peer_tier.py) before the disk at the same step: the steps every
    rank holds in each tier (collective with several ranks), and the disk plan."""
    plan = worlds.plan(engine, keep=engine._mine_unflagged)  # this run's, any world it can take
    node: dict[int, Path] = {}
    if engine.node is not None and engine._node_writer is not None:
        node = engine.node.candidates(engine._node_writer.own.mine)
    if engine.peer is not None:
        near = [(s, p, tier) for s, (p, tier) in engine.peer.fetch(node).items()]
    else:
        common = mdist.common_steps(sorted(node), engine.group) if engine.world_size > 1 else sorted(node)
        near = [(s, node[s], "node") for s in common]
    sources = near + [(s, c.path, "disk") for s, c in plan.items()]
    return sorted(sources, key=lambda x: (-x[0], x[2] == "disk")), plan


def resume(engine: SnapshotEngine) -> tuple[int, Path, str] | None:
    """Start-up: restores the newest valid snapshot of the node tier (node_tier.py) or the
    disk, the node's first at the same step (a corrupted or partial one is refused with the
    file named, and the next tried; another world size's: worlds.py, disk only). Returns its
    step (training goes on at step + 1), or None. Collective with several ranks."""
    if engine.rank_dir is None:
        return None
    t0 = time.perf_counter()
    sources, plan = _sources(engine)
    found = load_newest_valid(
        engine, [], collective=engine.world_size > 1, read=worlds.reader(engine, plan), sources=sources
    )
    if found is None:
        if sources:
            engine.emit(
                Reason.SNAPSHOT_REFUSED,
                Severity.CRITICAL,
                f"no valid snapshot in {engine.rank_dir}{' or the node tier' if engine.node else ''}: starting from scratch",
            )
        return None
    step, path, tensors, objects = found
    tier = next(t for s, p, t in sources if (s, p) == (step, path))
    other_world = tier == "disk" and plan[step].world_size != engine.world_size
    apply(
        engine,
        tensors,
        worlds.fit(engine, step, objects, plan) if tier == "disk" else objects,
        where=str(path),
        owned=True,
    )
    del found, tensors, objects  # the engine's copies are applied: let these go
    if engine.peer is not None:  # the replicas fetched back are in the live state now
        shutil.rmtree(engine.peer.fetched, ignore_errors=True)
    if tier != "disk" or other_world:  # a rollback goes back to an in-memory copy of it
        engine.snapshot(step=step)
    seconds = time.perf_counter() - t0
    engine.recovery_seconds[tier] = seconds
    note = worlds.note(plan[step], engine.world_size, "sharding" in engine.extra) if tier == "disk" else ""
    engine.emit(
        Reason.SNAPSHOT_RESUMED,
        Severity.INFO,
        f"resumed from {path} ({tier} tier, step {step}{note}) in {seconds:.3f} s; "
        f"training continues at step {step + 1}",
        world_size_then=plan[step].world_size if tier == "disk" else engine.world_size,
        step=step,
        tag=tier,
        tier=tier,
        recovery_seconds=f"{seconds:.6f}",
    )
    return step, path, tier
