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
import os
import platform
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

import mscale.snapshot.distributed as mdist
import mscale.snapshot.memory as mem
from mscale.findings import Finding, Reason, Severity
from mscale.logs import debug_wanted
from mscale.snapshot import worlds
from mscale.snapshot.data import describe_batches, step_batches
from mscale.snapshot.fit import check_fits
from mscale.snapshot.format import (
    FORMAT,
    MANIFEST,
    NONMPU_FILE,
    NONMPU_OPTIM_FILE,
    SnapshotError,
    SnapshotInfo,
    list_snapshots,
)
from mscale.snapshot.inplace import load_newest_valid
from mscale.snapshot.manifest import safe_name
from mscale.snapshot.memory import HostCopier, MemorySnapshot, rng_state, set_rng_state, to_host
from mscale.snapshot.optim import NamedOptimizer
from mscale.snapshot.writer import DiskWriter

__all__ = ["SnapshotEngine", "RollbackUnavailable"]

log = structlog.get_logger("mscale.snapshot")


class RollbackUnavailable(SnapshotError):
    """No in-memory snapshot to roll back to (on every rank)."""


class SnapshotEngine:
    """Snapshots and restores a training job's state; see the module docstring.

    mpus: name -> (mpu_id, module), modules being submodules of `model`.
    data: an object with state_dict()/load_state_dict() (mscale.snapshot.data.ResumableLoader,
    ResumableFileStream, or e.g. torchdata's StatefulDataLoader); skip_batch rollbacks need its
    `last_batch_position` and `skip_batch_at(position)`.
    extra: name -> object with state_dict()/load_state_dict(), snapshotted alongside.
    binding: returns mpu_id -> {"gpu": index, "gpu_uuid": uuid} (e.g. the simulated binding);
    by default read from the device of each MPU's first parameter.
    emit: called with every Finding (from the training thread or the writer thread).
    group: the torch.distributed process group (default: the world, when initialised).
    copy_threads: threads for host copies (default: min(4, CPUs)).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        mpus: Mapping[str, tuple[str, nn.Module]] | None = None,
        scaler: Any = None,
        scheduler: Any = None,
        data: Any = None,
        extra: Mapping[str, Any] | None = None,
        directory: str | os.PathLike | None = None,
        memory_every: int = 10,
        memory_keep: int = 2,
        disk_every: int = 100,
        disk_keep: int = 3,
        binding: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
        emit: Callable[[Finding], None] | None = None,
        job_id: str = "",
        group: Any = None,
        copy_threads: int | None = None,
    ) -> None:
        if memory_every < 0 or disk_every < 0:
            raise ValueError("memory_every and disk_every must be >= 0 (0: never)")
        if memory_keep < 1 or disk_keep < 1:
            raise ValueError("memory_keep and disk_keep must be >= 1")
        self.model, self.optimizer = model, optimizer
        self.scaler, self.scheduler, self.data = scaler, scheduler, data
        self.extra = dict(extra or {})
        self.memory_every, self.memory_keep = memory_every, memory_keep
        self.disk_every, self.disk_keep = disk_every, disk_keep
        self.job_id, self.group = job_id, group
        self._binding_fn, self._emit_fn = binding, emit
        self.rank, self.world_size = mdist.rank_and_size(group)
        self.step = 0
        self.findings: deque[Finding] = deque(maxlen=256)
        self.last_skipped: list[dict] = []  # the data positions the last rollback stepped over
        self.recovery_seconds: dict[str, float] = {}  # checkpoint_recovery_time_seconds{tag}
        self.stall_s = 0.0  # seconds training waited on in-memory snapshots and restores (hook.goodput)
        self._mpus = self._check_mpus(mpus or {})
        self._prefixes = sorted(self._mpus.values(), key=lambda pf: -len(pf[0]))
        self._named_opt = NamedOptimizer(model, optimizer) if optimizer is not None else None
        self._lock = threading.Lock()
        self._kept: list[MemorySnapshot] = []  # oldest first
        self._spare: list[MemorySnapshot] = []  # retired, unpinned: buffers to reuse
        self._copier = HostCopier(copy_threads if copy_threads is not None else min(4, os.cpu_count() or 1))
        self._late = mem.late_keys(model, optimizer)  # copied beside training, fenced by the next step
        self._fence = mem.fence_on_step(optimizer, self._copier)
        self.wait_copy = self._copier.fence  # before writing parameters outside optimizer.step()
        self._closed = False
        self._prev_handler: Any = None
        self._resumed: tuple[int, Path] | None = None
        self.directory = Path(directory) if directory is not None else None
        self.rank_dir: Path | None = None
        self._disk: DiskWriter | None = None
        if self.directory is not None:
            if self.world_size > 1 and self.rank == 0:
                worlds.adopt_single(self.directory)  # before any rank lists it: worlds.plan waits for this
            self.rank_dir = worlds.rank_dir(self.directory, self.rank, self.world_size)
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            identity = {
                "rank": self.rank,
                "world_size": self.world_size,
                "job_id": self.job_id,
                "optimizer": optimizer is not None,  # so the manifest's completeness can be checked
                "mpus": {
                    mpu_id: {"name": self.mpu_names[mpu_id], "file": f, "optim_file": f.replace("_state.", "_optim.")}
                    for mpu_id, (_, f) in self._mpus.items()
                },
            }
            self._disk = DiskWriter(
                self.rank_dir, keep=disk_keep, identity=identity, emit=self._emit, unpin=self._unpin
            )

    @property
    def last_write(self) -> dict:
        """The last disk write: step, bytes, seconds, path (empty before the first)."""
        return self._disk.last_write if self._disk is not None else {}

    # -- set-up -----------------------------------------------------------------------
    def _check_mpus(self, mpus: Mapping[str, tuple[str, nn.Module]]) -> dict[str, tuple[str, str]]:
        """mpu_id -> (module prefix in the model, file name)."""
        prefix_of = {id(m): name for name, m in self.model.named_modules(remove_duplicate=False)}
        out: dict[str, tuple[str, str]] = {}
        self.mpu_names: dict[str, str] = {}
        for name, (mpu_id, module) in mpus.items():
            if id(module) not in prefix_of:
                raise ValueError(f"MPU {name!r} ({mpu_id}) is not a submodule of the model")
            if mpu_id in out:
                raise ValueError(f"MPU id {mpu_id!r} used twice")
            out[mpu_id] = (prefix_of[id(module)], f"mpu_{safe_name(mpu_id)}_{safe_name(name)}_state.safetensors")
            self.mpu_names[mpu_id] = name
        self._mpu_modules = {mpu_id: module for name, (mpu_id, module) in mpus.items()}
        return out

    def _file_of(self, key: str, *, optim: bool = False) -> str:
        """The file a model key (or, optim, the optimizer state of a parameter) goes to.
        Model and optimizer state are separate files: more files hash in parallel."""
        for prefix, fname in self._prefixes:
            if prefix == "" or key == prefix or key.startswith(prefix + "."):
                return fname.replace("_state.safetensors", "_optim.safetensors") if optim else fname
        return NONMPU_OPTIM_FILE if optim else NONMPU_FILE

    # -- findings ---------------------------------------------------------------------
    def _emit(self, reason: Reason, severity: Severity, message: str, **labels: Any) -> Finding:
        base = {"rank": str(self.rank)}
        if self.job_id:
            base["job_id"] = self.job_id
        finding = Finding("snapshot", reason, severity, message, {**base, **{k: str(v) for k, v in labels.items()}})
        self.findings.append(finding)
        level = {Severity.CRITICAL: "error", Severity.WARNING: "warning"}.get(severity, "info")
        if self._emit_fn is None:  # a consumer (the guard) logs it itself: one line, not two
            getattr(log, level)(message, reason=reason.value, rank=self.rank, **labels)
        else:
            try:
                self._emit_fn(finding)
            except Exception:  # a broken consumer must not stop snapshots
                log.exception("finding consumer failed", reason=reason.value)
        return finding

    # -- capture ----------------------------------------------------------------------
    def _live_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """References to the live tensors per file, and a host copy of everything else."""
        files: dict[str, dict[str, torch.Tensor]] = {}
        for _, f in [*self._mpus.values(), ("", NONMPU_FILE)]:
            files[f] = {}
            if self.optimizer is not None:
                files[f.replace("_state.safetensors", "_optim.safetensors")] = {}
        for key, t in self.model.state_dict().items():
            files[self._file_of(key)]["model/" + key] = t
        objects: dict[str, Any] = {"format": FORMAT, "step": self.step}
        if self._named_opt is not None:
            objects["optimizer"] = self._named_opt.capture(files, lambda fqn: self._file_of(fqn, optim=True))
        if self.scaler is not None:
            objects["scaler"] = to_host(self.scaler.state_dict())
        if self.scheduler is not None:
            objects["scheduler"] = to_host(self.scheduler.state_dict())
        if self.data is not None:
            objects["data"] = to_host(self.data.state_dict())
        objects["extra"] = {name: to_host(obj.state_dict()) for name, obj in self.extra.items()}
        objects["rng"] = rng_state()
        return files, objects

    def _binding(self) -> dict:
        custom = dict(self._binding_fn() or {}) if self._binding_fn else {}
        mpus = {}
        for mpu_id, module in self._mpu_modules.items():
            p = next(module.parameters(), None)
            dev = p.device if p is not None else torch.device("cpu")
            entry: dict[str, Any] = {"name": self.mpu_names[mpu_id], "device": str(dev), "gpu": None, "gpu_uuid": None}
            if dev.type == "cuda":
                entry["gpu"] = dev.index if dev.index is not None else torch.cuda.current_device()
                entry["gpu_uuid"] = str(getattr(torch.cuda.get_device_properties(entry["gpu"]), "uuid", "")) or None
            entry.update({k: v for k, v in dict(custom.get(mpu_id, {})).items()})
            mpus[mpu_id] = entry
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": platform.node(),
            "job_id": self.job_id,
            "mpus": mpus,
        }

    def _buffers_for(self, files: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Host buffers shaped like `files`: the oldest kept snapshot's when keeping this one
        evicts it anyway (so `memory_keep` sets suffice), else a retired one's. Fresh host
        memory costs page faults on first touch, often more than the copy itself."""
        with self._lock:
            old = None
            if len(self._kept) >= self.memory_keep and self._kept[0].pins == 0:
                old = self._kept.pop(0)
                old.retired = True
            elif self._spare:
                old = self._spare.pop()
        return mem.host_buffers(files, old.tensors if old else {})

    def snapshot(self, step: int | None = None) -> MemorySnapshot:
        """Takes an in-memory snapshot of the current state now (at a step boundary)."""
        if step is not None:
            self.step = step
        t0 = time.perf_counter()
        files, objects = self._live_state()
        bufs = self._buffers_for(files)
        ready = self._copier.copy_state(files, bufs, self._late)
        nbytes = sum(t.numel() * t.element_size() for d in bufs.values() for t in d.values())
        snap = MemorySnapshot(self.step, bufs, objects, self._binding(), nbytes, ready=ready)
        with self._lock:
            self._kept = [s for s in self._kept if s.step != snap.step]
            self._kept.append(snap)
            while len(self._kept) > self.memory_keep:
                self._retire(self._kept.pop(0))
        self.stall_s += time.perf_counter() - t0
        if debug_wanted():  # not by default: the library configures no logging (mscale.logs)
            log.debug("memory snapshot", step=self.step, bytes=nbytes, seconds=round(time.perf_counter() - t0, 6))
        return snap

    def _retire(self, snap: MemorySnapshot) -> None:
        # With the lock held. Keep at most one spare set of buffers: bounded memory.
        snap.retired = True
        if snap.pins == 0 and not self._spare:
            self._spare.append(snap)

    def _unpin(self, snap: MemorySnapshot) -> None:
        with self._lock:
            snap.pins -= 1
            if snap.retired and snap.pins == 0 and not self._spare:
                self._spare.append(snap)

    @property
    def memory_steps(self) -> list[int]:
        with self._lock:
            return [s.step for s in self._kept]

    def latest(self, step: int | None = None) -> MemorySnapshot | None:
        """The newest in-memory snapshot, or the newest of `step`."""
        with self._lock:
            kept = [s for s in self._kept if step is None or s.step == step]
            return kept[-1] if kept else None

    # -- the per-step hook --------------------------------------------------------------
    def step_end(self, step: int) -> None:
        """Call after step `step` completed (optimizer and scheduler stepped)."""
        self.step = step
        self.mark_step()
        to_disk = self.directory is not None and self.disk_every and step % self.disk_every == 0
        if (self.memory_every and step % self.memory_every == 0) or to_disk:
            snap = self.snapshot()
            if to_disk:
                self._queue_write(snap, why="schedule")

    # -- disk -------------------------------------------------------------------------
    def _queue_write(self, snap: MemorySnapshot, *, why: str) -> Future:
        if self._disk is None:
            fut: Future = Future()
            fut.set_exception(SnapshotError("no snapshot directory configured"))
            return fut
        with self._lock:
            snap.pins += 1
        return self._disk.write(snap, why)

    def save(self, *, wait: bool = False, timeout: float | None = None) -> Future:
        """On demand: snapshot the current state and write it to disk in the background."""
        latest = self.latest()
        snap = latest if latest is not None and latest.step == self.step else self.snapshot()
        fut = self._queue_write(snap, why="demand")
        if wait:
            fut.result(timeout)
        return fut

    def emergency(self, why: str = "command") -> Future:
        """Writes the newest in-memory snapshot to disk now (it is not re-taken: the live state
        may be what failed). Safe to call from any thread and from a signal handler."""
        if self._disk is None:
            fut: Future = Future()
            fut.set_exception(SnapshotError("no snapshot directory configured"))
            return fut
        disk = self._disk
        return disk.call(lambda: self._write_emergency(disk, why))

    def _write_emergency(self, disk: DiskWriter, why: str) -> Path:
        # In the writer thread, in queue order.
        with self._lock:
            # The newest whose copies have landed: a GPU that stopped answering never
            # completes the copy in flight, and waiting for it would hang the writer.
            ready = [s for s in self._kept if s.is_ready()]
            snap = ready[-1] if ready else None
            if snap is not None:
                snap.pins += 1
        if snap is None and self._resumed is not None:  # the newest state saved is on disk already
            return self._resumed[1]
        if snap is None:
            self._emit(
                Reason.SNAPSHOT_FAILED,
                Severity.CRITICAL,
                f"emergency snapshot ({why}): no in-memory snapshot to write",
                why=why,
            )
            raise SnapshotError("no in-memory snapshot to write")
        try:
            if snap.disk_path is not None and (snap.disk_path / MANIFEST).exists():
                log.info("emergency snapshot already on disk", step=snap.step, path=str(snap.disk_path))
                return snap.disk_path
            return disk.write_now(snap, why)
        finally:
            self._unpin(snap)

    def install_signal_handler(self, signum: int = signal.SIGUSR1) -> None:
        """SIGUSR1 (by default) writes the newest in-memory snapshot. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        self._prev_handler = (
            signum,
            signal.signal(signum, lambda s, f: self.emergency(why=f"signal {signal.Signals(s).name}")),
        )

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every disk write queued so far is finished (written or failed)."""
        if self._disk is not None:
            self._disk.flush(timeout)

    def _mine(self, infos: list[SnapshotInfo]) -> list[SnapshotInfo]:
        return self._disk.own.mine(infos) if self._disk is not None else infos

    # -- restore ----------------------------------------------------------------------
    def _apply(
        self, tensors: dict[str, dict[str, torch.Tensor]], objects: dict, *, where: str, owned: bool = False
    ) -> None:
        """Restores the live objects from a snapshot's tensors and objects. owned: the tensors
        are fresh (read from disk) and may become the optimizer's state without a copy."""
        check_fits(self, tensors, objects, where)
        self._copier.fence()  # a snapshot copy still reading the live tensors finishes first
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
            self._copier.parallel_copy([(live[k], t) for k, t in model_sd.items()])
        if self._named_opt is not None:
            self._named_opt.restore(
                opt_tensors, objects["optimizer"], copy_pairs=self._copier.parallel_copy, owned=owned
            )
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(objects["scaler"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(objects["scheduler"]))
        for name, obj in self.extra.items():
            obj.load_state_dict(copy.deepcopy(objects["extra"].get(name)))
        set_rng_state(objects["rng"])
        self.step = int(objects["step"])

    def rollback(self, step: int | None = None, *, skip_batch: bool = False, micro_batches: Sequence[int] = ()) -> int:
        """Restores the newest in-memory snapshot (or the one at `step`) into the live objects;
        training continues at the returned step + 1. skip_batch: the offending step's batches are
        stepped over on the replay (mscale.snapshot.data.step_batches); `last_skipped` lists them."""
        try:
            return self._rollback(step, skip_batch, micro_batches)
        except BaseException:
            self.mark_step()  # nothing was restored: the next step draws afresh
            raise

    def mark_step(self) -> None:  # a step ended (or was undone): the next batch opens the next one
        getattr(self.data, "mark_step", lambda: None)()

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
        if self._disk is not None:
            self._disk.prune_after(target)
        seconds = time.perf_counter() - t0
        self.recovery_seconds[tag] = seconds
        self.stall_s += seconds
        self._emit(
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
            self._emit(
                Reason.ROLLBACK,
                Severity.CRITICAL,
                "a rank reported a fault but no in-memory snapshot is held by every rank: no rank rolls back",
                step=self.step,
            )
            raise RollbackUnavailable("no in-memory snapshot common to every rank")
        return self.rollback(target, skip_batch=skip_batch, micro_batches=micro_batches)

    def resume(self) -> int | None:
        """Start-up: restores the newest valid snapshot on disk (a corrupted or partial one is
        refused with the file named, and the next older used; another world size's: worlds.py).
        Returns its step (training goes on at step + 1), or None. Collective with several ranks."""
        if self.rank_dir is None:
            return None
        t0 = time.perf_counter()
        # this world's snapshots and other world sizes' it can take, this run's only (ownership.py)
        plan = worlds.plan(self, keep=self._mine)
        steps = sorted(plan, reverse=True)
        found = load_newest_valid(
            self, steps, collective=self.world_size > 1, where=lambda s: plan[s].path, read=worlds.reader(self, plan)
        )
        if found is not None:
            step, path, tensors, objects = found
            self._apply(tensors, worlds.fit(self, step, objects, plan), where=str(path), owned=True)
            del found, tensors, objects  # the engine's copies are applied: let these go
            if plan[step].world_size != self.world_size:  # a rollback must not go back to another world's
                self.snapshot(step=step)
            # Until the first in-memory snapshot, a rollback goes back to this one on disk:
            # copying 3x the parameter bytes again at start-up would double the restore time.
            self._resumed = (step, path)
            seconds = time.perf_counter() - t0
            self.recovery_seconds["disk"] = seconds
            self._emit(
                Reason.SNAPSHOT_RESUMED,
                Severity.INFO,
                f"resumed from {path} (step {step}{worlds.note(plan[step], self.world_size, 'sharding' in self.extra)}) "
                f"in {seconds:.3f} s; "
                f"training continues at step {step + 1}",
                world_size_then=plan[step].world_size,
                step=step,
                tag="disk",
                recovery_seconds=f"{seconds:.6f}",
            )
            return step
        if steps:
            self._emit(
                Reason.SNAPSHOT_REFUSED,
                Severity.CRITICAL,
                f"no valid snapshot in {self.rank_dir}: starting from scratch",
            )
        return None

    # -- shutdown ---------------------------------------------------------------------
    def close(self, timeout: float | None = 60.0) -> None:
        """Finishes queued writes and stops the writer thread."""
        if self._closed:
            return
        if self._prev_handler is not None:
            signum, prev = self._prev_handler
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, prev)
        if self._disk is not None:
            self._disk.close(timeout)
        if self._fence is not None:
            self._fence.remove()
        self._copier.close()
        self._closed = True

    def __enter__(self) -> SnapshotEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
