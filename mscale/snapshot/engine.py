"""Snapshot and restore of the whole training state, in memory and on disk.

A snapshot at step N is the state after step N's optimizer step: model and optimizer state
split per MPU, grad scaler, LR scheduler, RNG states (python, numpy, torch CPU, every CUDA
device), the data position, the step counter and the MPU-to-device binding. Restoring it and
running step N+1 continues exactly as the uninterrupted run would have.

- In memory, every `memory_every` steps: a copy into reused host buffers (pinned, on a side
  CUDA stream, when the state is on a GPU), the last `memory_keep` kept. Rollbacks use these.
  Parameters and optimizer state are copied beside the next forward and backward; the next
  optimizer step waits only for what is left of the copy (memory.py).
- On disk, every `disk_every` steps, on demand and in an emergency: the writer thread
  (`writer.py`) writes the in-memory copy so that a crash at any point leaves only complete
  snapshots. A failed write (disk full) is a Finding; training and the in-memory copy go on.
- Loading never unpickles code: tensors are safetensors files, the rest `train_state.pt` read
  with `torch.load(weights_only=True)`; each file is checked against `manifest.json` (size,
  BLAKE3) as it is read, into the live tensors where it fits them (inplace.py), and a
  snapshot that fails is refused, naming the file, for the next older.

The layout of a snapshot directory is in `format.py`.
"""

from __future__ import annotations

import copy
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import mscale.snapshot.distributed as mdist
from mscale.findings import Reason, Severity
from mscale.snapshot import worlds
from mscale.snapshot.capture import SnapshotCapture
from mscale.snapshot.data import describe_batches, step_batches
from mscale.snapshot.fit import check_fits
from mscale.snapshot.format import SnapshotError, list_snapshots
from mscale.snapshot.inplace import load_newest_valid
from mscale.snapshot.memory import MemorySnapshot, rng_state, set_rng_state, to_host

__all__ = ["SnapshotEngine", "RollbackUnavailable"]


_ATOMS = (int, float, str, bool, bytes, type(None))


def _light(obj: Any) -> Any:
    """A copy of a state dict for the step mark, paid every step: containers rebuilt, tensors
    copied to the host, immutable leaves shared (a deep copy of each float costs more than the
    rest of the mark together); anything else deep-copied."""
    if isinstance(obj, _ATOMS):
        return obj
    if type(obj) is dict:
        return {k: _light(v) for k, v in obj.items()}
    if type(obj) is list:
        return [_light(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_light(v) for v in obj)
    return to_host(obj)


class RollbackUnavailable(SnapshotError):
    """No in-memory snapshot to roll back to (on every rank)."""


class SnapshotEngine(SnapshotCapture):
    """Snapshots and restores a training job's state; see the module docstring. Taking them
    is SnapshotCapture's (mscale.snapshot.capture: the constructor's arguments are there);
    this class restores them: `rollback`, `agree_rollback`, `resume`, `rewind`.

    The step mark: at every step end (and after every restore) the engine keeps what a
    snapshot holds besides the tensors (RNG states, data position, scheduler, grad scaler,
    the optimizer's hyperparameters, the extras: a few kilobytes), so that a step whose update
    was dropped can be run again from its start without a rollback (`rewind`): its weights and
    optimizer state are what they were, the rest is put back."""

    _mark: dict | None = None

    def _take_mark(self) -> None:
        objects: dict = {"step": self.step, "rng": rng_state()}
        if self.data is not None and getattr(self.data, "rewinds", True):
            objects["data"] = _light(self.data.state_dict())
        if self.optimizer is not None:
            objects["groups"] = [
                _light({k: v for k, v in g.items() if k != "params"}) for g in self.optimizer.param_groups
            ]
        if self.scaler is not None:
            objects["scaler"] = _light(self.scaler.state_dict())
        if self.scheduler is not None:
            objects["scheduler"] = _light(self.scheduler.state_dict())
        objects["extra"] = {name: _light(obj.state_dict()) for name, obj in self.extra.items()}
        self._mark = objects

    def step_end(self, step: int) -> None:
        super().step_end(step)
        if self.mark_step_held != step:  # (a snapshot of this step took it already)
            self._take_mark()

    def snapshot(self, step: int | None = None) -> MemorySnapshot:
        snap = super().snapshot(step)
        self._take_mark()
        return snap

    @property
    def mark_step_held(self) -> int | None:
        """The step whose end the step mark holds (None: none yet)."""
        return None if self._mark is None else int(self._mark["step"])

    def rewind(self, step: int) -> int:
        """Put back the step mark of `step` (the end of the step before the one to run again):
        RNG, data position (a loader that cannot rewind goes on with its next batch),
        scheduler, scaler, the optimizer's hyperparameters and the extras. Weights and
        optimizer state are left as they are: the caller knows they did not change (the step's
        update was dropped). Training continues at `step` + 1. RollbackUnavailable: no mark of
        that step (a rollback is needed)."""
        mark = self._mark
        if mark is None or int(mark["step"]) != step:
            raise RollbackUnavailable(f"no step mark of step {step} (held: {self.mark_step_held})")
        if self.data is not None and "data" in mark:
            self.data.load_state_dict(copy.deepcopy(mark["data"]))
        if self.optimizer is not None and "groups" in mark:
            for group, saved in zip(self.optimizer.param_groups, mark["groups"], strict=True):
                group.update(copy.deepcopy(saved))
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(mark["scaler"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(mark["scheduler"]))
        for name, obj in self.extra.items():
            obj.load_state_dict(copy.deepcopy(mark["extra"].get(name)))
        set_rng_state(mark["rng"])
        self.step = step
        self.mark_step()
        return step

    # -- restore ----------------------------------------------------------------------
    def _apply(
        self, tensors: dict[str, dict[str, torch.Tensor]], objects: dict, *, where: str, owned: bool = False
    ) -> None:
        """Restores the live objects from a snapshot's tensors and objects. owned: the tensors
        are fresh (read from disk) and may become the optimizer's state without a copy."""
        check_fits(self, tensors, objects, where)
        self.copier.fence()  # a snapshot copy still reading the live tensors finishes first
        if self.data is not None:  # first: it validates before it changes anything
            self.data.load_state_dict(copy.deepcopy(objects["data"]))
        model_sd: dict[str, torch.Tensor] = {}
        opt_tensors: dict[str, dict[str, torch.Tensor]] = {}
        for d in tensors.values():
            for k, t in d.items():
                if k.startswith("model/"):
                    model_sd[k[6:]] = t
                elif k.startswith("optim/"):
                    fqn, _, name = k[6:].rpartition("/")
                    opt_tensors.setdefault(fqn, {})[name] = t
        if any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in self.model.modules()):
            with torch.no_grad():  # the model customises loading: go through it
                self.model.load_state_dict(model_sd, strict=True)
        else:  # keys and shapes were checked: copy in place, in parallel
            live = self.model.state_dict()
            self.copier.parallel_copy([(live[k], t) for k, t in model_sd.items()])
        if self.named_optimizer is not None:
            self.named_optimizer.restore(
                opt_tensors, objects["optimizer"], copy_pairs=self.copier.parallel_copy, owned=owned
            )
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(objects["scaler"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(objects["scheduler"]))
        for name, obj in self.extra.items():
            obj.load_state_dict(copy.deepcopy(objects["extra"].get(name)))
        set_rng_state(objects["rng"])
        self.step = int(objects["step"])
        self._take_mark()  # the restored step's end: a step after it can be run again from its start

    def rollback(self, step: int | None = None, *, skip_batch: bool = False, micro_batches: Sequence[int] = ()) -> int:
        """Restores the newest in-memory snapshot (or the one at `step`) into the live objects;
        training continues at the returned step + 1. skip_batch: the offending step's batches are
        stepped over on the replay (mscale.snapshot.data.step_batches); `last_skipped` lists them."""
        try:
            return self._rollback(step, skip_batch, micro_batches)
        except BaseException:
            self.mark_step()  # nothing was restored: the next step draws afresh
            raise

    def _rollback(self, step: int | None, skip_batch: bool, micro_batches: Sequence[int]) -> int:
        t0 = time.perf_counter()
        with self._lock:
            candidates = [s for s in self._kept if step is None or s.step == step]
            snap = candidates[-1] if candidates else None
            if snap is not None:
                snap.pins += 1
        resumed = self._resumed if snap is None and self._resumed and step in (None, self._resumed[0]) else None
        if snap is None and resumed is None:
            raise RollbackUnavailable(
                f"no in-memory snapshot{'' if step is None else f' of step {step}'} (held: {self.held_steps})"
            )
        from_step = self.step
        bad = step_batches(self.data, micro_batches) if skip_batch else []
        if bad is None or (skip_batch and not hasattr(self.data, "skip_batch_at")):
            if snap is not None:
                self._unpin(snap)
            raise SnapshotError("skip_batch needs a data object with last_batch_position and skip_batch_at()")
        if snap is not None:
            tag, target = "memory", snap.step
            try:
                snap.wait_ready()
                self._apply(snap.tensors, snap.objects, where=f"in-memory snapshot of step {snap.step}")
            finally:
                self._unpin(snap)
        else:  # no in-memory copy yet since the start-up resume: back to that disk snapshot
            assert resumed is not None and self.rank_dir is not None  # the check above
            # ... or, alone and that one refused now, to the newest older one that verifies
            infos = self._mine(list_snapshots(self.rank_dir)) if self.world_size == 1 else []
            older = {i.step for i in infos if i.path.parent == self.rank_dir and i.step < resumed[0]}
            found = load_newest_valid(self, [resumed[0], *sorted(older, reverse=True)], collective=False)
            if found is None:
                raise RollbackUnavailable(f"the disk snapshot of step {resumed[0]} is refused, and no older one")
            tag, (target, path, tensors, objects) = "disk", found
            self._apply(tensors, objects, where=str(path), owned=True)
            self._resumed = (target, path)
        for position in bad:
            self.data.skip_batch_at(position)
        self.last_skipped = bad
        with self._lock:  # snapshots newer than the target belong to the abandoned timeline
            for s in [s for s in self._kept if s.step > target]:
                self._kept.remove(s)
                self._retire(s)
        for writer in (self._disk, self._node_writer):
            if writer is not None:
                writer.prune_after(target)
        seconds = time.perf_counter() - t0
        self.recovery_seconds[tag] = seconds
        self.stall_s += seconds
        self.emit(
            Reason.ROLLBACK,
            Severity.WARNING,
            f"rolled back to the {'in-memory' if tag == 'memory' else 'disk'} snapshot of step {target} (last completed step {from_step}) in {seconds:.3f} s"
            + (f", {describe_batches(bad)} will be skipped" if bad else ""),
            step=target,
            from_step=from_step,
            tag=tag,
            recovery_seconds=f"{seconds:.6f}",
        )
        return target

    @property
    def held_steps(self) -> list[int]:
        """Steps a rollback can go to: the in-memory snapshots, and the disk snapshot resumed
        from until the first in-memory one replaces it."""
        steps = self.memory_steps
        if self._resumed and not steps:
            steps = [self._resumed[0]]
        return steps

    def agree_rollback(self, fault: bool, *, skip_batch: bool = False, micro_batches: Sequence[int] = ()) -> int | None:
        """Collective commit point: every rank calls it at the same point of each step with its
        own fault flag. If any rank has a fault, all ranks restore the newest step every rank
        holds in memory, or none does (RollbackUnavailable on every rank). None: no fault."""
        if self.world_size == 1:
            return self.rollback(skip_batch=skip_batch, micro_batches=micro_batches) if fault else None
        if not mdist.any_flag(fault, self.group):
            return None
        target = mdist.newest_common(self.held_steps, self.group)
        if target is None:
            self.emit(
                Reason.ROLLBACK,
                Severity.CRITICAL,
                "a rank reported a fault but no in-memory snapshot is held by every rank: no rank rolls back",
                step=self.step,
            )
            raise RollbackUnavailable("no in-memory snapshot common to every rank")
        return self.rollback(target, skip_batch=skip_batch, micro_batches=micro_batches)

    def _sources(self) -> tuple[list[tuple[int, Path, str]], dict[int, worlds.Candidate]]:
        """What a resume tries, newest first, the node tier (or, for a rank whose node copy is
        gone, its peer's replica: peer_tier.py) before the disk at the same step: the steps every
        rank holds in each tier (collective with several ranks), and the disk plan."""
        plan = worlds.plan(self, keep=self._mine_unflagged)  # this run's, any world it can take
        node: dict[int, Path] = {}
        if self.node is not None and self._node_writer is not None:
            node = self.node.candidates(self._node_writer.own.mine)
        if self.peer is not None:
            near = [(s, p, tier) for s, (p, tier) in self.peer.fetch(node).items()]
        else:
            common = mdist.common_steps(sorted(node), self.group) if self.world_size > 1 else sorted(node)
            near = [(s, node[s], "node") for s in common]
        sources = near + [(s, c.path, "disk") for s, c in plan.items()]
        return sorted(sources, key=lambda x: (-x[0], x[2] == "disk")), plan

    def resume(self) -> int | None:
        """Start-up: restores the newest valid snapshot of the node tier (node_tier.py) or the
        disk, the node's first at the same step (a corrupted or partial one is refused with the
        file named, and the next tried; another world size's: worlds.py, disk only). Returns its
        step (training goes on at step + 1), or None. Collective with several ranks."""
        if self.rank_dir is None:
            return None
        t0 = time.perf_counter()
        sources, plan = self._sources()
        found = load_newest_valid(
            self, [], collective=self.world_size > 1, read=worlds.reader(self, plan), sources=sources
        )
        if found is None:
            if sources:
                self.emit(
                    Reason.SNAPSHOT_REFUSED,
                    Severity.CRITICAL,
                    f"no valid snapshot in {self.rank_dir}{' or the node tier' if self.node else ''}: starting from scratch",
                )
            return None
        step, path, tensors, objects = found
        tier = next(t for s, p, t in sources if (s, p) == (step, path))
        other_world = tier == "disk" and plan[step].world_size != self.world_size
        self._apply(
            tensors, worlds.fit(self, step, objects, plan) if tier == "disk" else objects, where=str(path), owned=True
        )
        del found, tensors, objects  # the engine's copies are applied: let these go
        if self.peer is not None:  # the replicas fetched back are in the live state now
            shutil.rmtree(self.peer.fetched, ignore_errors=True)
        if tier != "disk" or other_world:  # a rollback goes back to an in-memory copy of it
            self.snapshot(step=step)
        if tier == "disk":
            # Until the first in-memory snapshot, a rollback goes back to this one on disk:
            # copying 3x the parameter bytes again at start-up would double the restore time.
            self._resumed = (step, path)
        seconds = time.perf_counter() - t0
        self.recovery_seconds[tier] = seconds
        note = worlds.note(plan[step], self.world_size, "sharding" in self.extra) if tier == "disk" else ""
        self.emit(
            Reason.SNAPSHOT_RESUMED,
            Severity.INFO,
            f"resumed from {path} ({tier} tier, step {step}{note}) in {seconds:.3f} s; "
            f"training continues at step {step + 1}",
            world_size_then=plan[step].world_size if tier == "disk" else self.world_size,
            step=step,
            tag=tier,
            tier=tier,
            recovery_seconds=f"{seconds:.6f}",
        )
        return step
