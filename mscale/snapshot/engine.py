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

The engine holds its parts and calls them: the layout of the MPUs' files and the directory
set-up (capture.py), the kept in-memory snapshots (store.py), the step mark (mark.py), the
restore into the live objects (restore.py), and the tiers: this rank's disk writer, the node
tier and its writer (node_tier.py), the peer tier (peer_tier.py). The layout of a snapshot
directory is in `format.py`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self, TypeVar

import structlog
import torch
from torch import nn
from torch.distributed import ProcessGroup

import mscale.snapshot.distributed as mdist
import mscale.snapshot.memory as mem
from mscale.findings import Finding, Reason, Severity
from mscale.logs import debug_wanted
from mscale.snapshot import capture, restore
from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.data import describe_batches, step_batches
from mscale.snapshot.format import MANIFEST, SnapshotError, SnapshotInfo, list_snapshots
from mscale.snapshot.inplace import load_newest_valid
from mscale.snapshot.keys import bare
from mscale.snapshot.mark import StepMark
from mscale.snapshot.memory import HostCopier, MemorySnapshot
from mscale.snapshot.node_tier import Flags, NodeTier
from mscale.snapshot.optim import NamedOptimizer
from mscale.snapshot.peer_tier import PeerTier
from mscale.snapshot.store import MemoryStore
from mscale.snapshot.values import JSONObject, StateDict, Stateful
from mscale.snapshot.verify import Verifier
from mscale.snapshot.writer import DiskWriter

__all__ = ["SnapshotEngine", "RollbackUnavailable"]

log = structlog.get_logger("mscale.snapshot")
_T = TypeVar("_T")


class RollbackUnavailable(SnapshotError):
    """No in-memory snapshot to roll back to (on every rank)."""


def _failed(why: str) -> Future[_T]:
    fut: Future[_T] = Future()
    fut.set_exception(SnapshotError(why))
    return fut


class SnapshotEngine:
    """Snapshots and restores a training job's state; see the module docstring. Takes them
    (`snapshot`, `step_end`, `save`, `emergency`) and restores them (`rollback`,
    `agree_rollback`, `resume`, `rewind`).

    config: the snapshots' directory, schedules and how many are kept (SnapshotConfig; by
    default in memory only, every 10 steps).
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
        config: SnapshotConfig | None = None,
        mpus: Mapping[str, tuple[str, nn.Module]] | None = None,
        scaler: Stateful | None = None,
        scheduler: Stateful | None = None,
        data: Any = None,
        extra: Mapping[str, Stateful] | None = None,
        binding: Callable[[], Mapping[str, Mapping[str, object]]] | None = None,
        emit: Callable[[Finding], None] | None = None,
        job_id: str = "",
        group: ProcessGroup | None = None,
        copy_threads: int | None = None,
    ) -> None:
        cfg = config if config is not None else SnapshotConfig()
        self.config = cfg
        # the model inside DDP and torch.compile wrappers: snapshots carry its names (keys.py)
        model = self.model = bare(model)
        self.optimizer = optimizer
        self.scaler, self.scheduler, self.data = scaler, scheduler, data
        self.extra = dict(extra or {})
        self.memory_every, self.memory_keep = cfg.memory_every, cfg.memory_keep
        self.disk_every, self.disk_keep = cfg.disk_every, cfg.disk_keep
        self.job_id, self.group = job_id, group
        self._binding_fn, self._emit_fn = binding, emit
        self.rank, self.world_size = mdist.rank_and_size(group)
        self.step = 0
        self.findings: deque[Finding] = deque(maxlen=256)
        self.last_skipped: list[StateDict] = []  # the data positions the last rollback stepped over
        self.recovery_seconds: dict[str, float] = {}  # checkpoint_recovery_time_seconds{tag}
        self.stall_s = 0.0  # seconds training waited on in-memory snapshots and restores (hook.goodput)
        self.layout = capture.MpuLayout(model, mpus or {})  # which file each key goes to
        self.mpu_names = self.layout.names
        # optimizer state keyed by parameter name; the in-place restore reads it too (inplace.py)
        self.named_optimizer = NamedOptimizer(model, optimizer) if optimizer is not None else None
        self.store = MemoryStore()  # the in-memory snapshots
        self.step_mark = StepMark()
        # the host copies' threads: they read snapshot files too (inplace.py, reshard.py)
        self.copier = HostCopier(copy_threads if copy_threads is not None else min(4, os.cpu_count() or 1))
        self._late = mem.late_keys(model, optimizer)  # copied beside training, fenced by the next step
        self._fence = mem.fence_on_step(optimizer, self.copier)
        self.wait_copy = self.copier.fence  # before writing parameters outside optimizer.step()
        self.verifier = Verifier(self.store, self.copier, self.flag_steps, self.emit)  # on the copier's thread
        self._closed = False
        self._prev_handler: tuple[int, Any] | None = None
        self._resumed: tuple[int, Path] | None = None
        self._open_tiers(cfg)

    def _open_tiers(self, cfg: SnapshotConfig) -> None:
        """This rank's directory and disk writer; the node and peer tiers where they are on."""
        self.directory = Path(cfg.directory) if cfg.directory is not None else None
        self.rank_dir: Path | None = None
        self._disk: DiskWriter | None = None
        self.node: NodeTier | None = None  # the node tier (node_tier.py), when on
        self._node_writer: DiskWriter | None = None
        self.peer: PeerTier | None = None  # the peer tier (peer_tier.py), when on
        opened = capture.open_directory(self, self.directory) if self.directory is not None else None
        if opened is None:
            return
        self.rank_dir, self._disk = opened
        # (on every rank alike: the peer tier's start is collective)
        node = capture.open_node_tier(self, self._disk)
        if node is not None:
            self.node, self._node_writer = node
        self.peer = PeerTier.open(self, self.node)

    @property
    def last_write(self) -> JSONObject:
        """The last disk write: step, bytes, seconds, path (empty before the first)."""
        return self._disk.last_write if self._disk is not None else {}

    # -- findings ---------------------------------------------------------------------
    def emit(self, reason: Reason, severity: Severity, message: str, **labels: object) -> Finding:
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
    def _binding(self) -> JSONObject:
        return capture.binding(self)

    def snapshot(self, step: int | None = None) -> MemorySnapshot:
        """Takes an in-memory snapshot of the current state now (at a step boundary)."""
        if step is not None:
            self.step = step
        t0 = time.perf_counter()
        files, objects = capture.live_state(self)
        bufs = self.store.buffers_for(files, self.memory_keep)
        ready = self.copier.copy_state(files, bufs, self._late)
        nbytes = sum(t.numel() * t.element_size() for d in bufs.values() for t in d.values())
        snap = MemorySnapshot(self.step, bufs, objects, self._binding(), nbytes, ready=ready)
        self.store.keep(snap, self.memory_keep)
        self.verifier.submit(snap, model=self.model, optimizer=self.optimizer)  # restored once it passed
        self.stall_s += time.perf_counter() - t0
        if debug_wanted():  # not by default: the library configures no logging (mscale.logs)
            log.debug("memory snapshot", step=self.step, bytes=nbytes, seconds=round(time.perf_counter() - t0, 6))
        self.step_mark.take(self)
        return snap

    @property
    def memory_steps(self) -> list[int]:
        return self.store.steps()

    def latest(self, step: int | None = None) -> MemorySnapshot | None:
        """The newest in-memory snapshot, or the newest of `step`."""
        return self.store.latest(step)

    # -- the per-step hook --------------------------------------------------------------
    def step_end(self, step: int) -> None:
        """Call after step `step` completed (optimizer and scheduler stepped)."""
        self.step = step
        self.mark_step()
        self.verifier.settle()  # failed verifications flagged and reported here, on this thread
        to_disk = self.directory is not None and self.disk_every and step % self.disk_every == 0
        to_node = self.node is not None and step % self.node.every == 0
        if (self.memory_every and step % self.memory_every == 0) or to_disk or to_node:
            snap = self.snapshot()
            if to_disk:
                self._queue_write(snap, why="schedule")
            if to_node and self.node is not None:  # (its writer weighs the cap: node_tier.past_cap)
                written = self._queue_write(snap, why="schedule", writer=self._node_writer)
                if self.peer is not None and step % self.peer.every == 0:
                    # sent by its thread once written; nothing, in step with the peer, if it was not
                    self.peer.replicate(step, written)
        if self.mark_step_held != step:  # (a snapshot of this step took it already)
            self.step_mark.take(self)

    def mark_step(self) -> None:  # a step ended (or was undone): the next batch opens the next one
        getattr(self.data, "mark_step", lambda: None)()

    # -- disk -------------------------------------------------------------------------
    def _queue_write(self, snap: MemorySnapshot, *, why: str, writer: DiskWriter | None = None) -> Future[Path | None]:
        writer = writer if writer is not None else self._disk
        if writer is None:
            return _failed("no snapshot directory configured")
        self.store.pin(snap)
        return writer.write(snap, why)

    def flag_steps(self, first: int, last: int, why: str) -> None:
        """The snapshots of steps first..last taken so far are never to be restored from, in any
        tier (a later finding puts their state in doubt: node_tier.Flags). The fuse, or the
        findings protect.py passes on, call it."""
        dirs = [w.rank_dir for w in (self._node_writer, self._disk) if w is not None]
        for d in dirs:
            try:
                Flags(d).add(first, last, why)
            except OSError as e:
                log.error("could not flag snapshots", directory=str(d), error=str(e))
        if dirs:
            log.warning("snapshots flagged", first=first, last=last, why=why)

    def save(self, *, wait: bool = False, timeout: float | None = None) -> Future[Path | None]:
        """On demand: snapshot the current state and write it to disk in the background."""
        latest = self.latest()
        snap = latest if latest is not None and latest.step == self.step else self.snapshot()
        fut = self._queue_write(snap, why="demand")
        if wait:
            fut.result(timeout)
        return fut

    def emergency(self, why: str = "command") -> Future[Path]:
        """Writes the newest in-memory snapshot to disk now (it is not re-taken: the live state
        may be what failed). Safe to call from any thread and from a signal handler."""
        if self._disk is None:
            return _failed("no snapshot directory configured")
        disk = self._disk
        return disk.call(lambda: self._write_emergency(disk, why))

    def _write_emergency(self, disk: DiskWriter, why: str) -> Path:
        # In the writer thread, in queue order: the newest whose copies have landed.
        snap = self.store.pin_newest_ready()
        if snap is None and self._resumed is not None:  # the newest state saved is on disk already
            return self._resumed[1]
        if snap is None:
            self.emit(
                Reason.SNAPSHOT_FAILED,
                Severity.CRITICAL,
                f"emergency snapshot ({why}): no in-memory snapshot to write",
                why=why,
            )
            raise SnapshotError("no in-memory snapshot to write")
        try:
            # on disk: written by the disk tier (a node-tier copy does not survive the node)
            written = snap.disk_path
            if written is not None and written.parent == disk.rank_dir and (written / MANIFEST).exists():
                log.info("emergency snapshot already on disk", step=snap.step, path=str(written))
                return written
            return disk.write_now(snap, why)
        finally:
            self.store.unpin(snap)

    def install_signal_handler(self, signum: int = signal.SIGUSR1) -> None:
        """SIGUSR1 (by default) writes the newest in-memory snapshot. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        self._prev_handler = (
            signum,
            signal.signal(signum, lambda s, f: self.emergency(why=f"signal {signal.Signals(s).name}")),
        )

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every write and peer replication queued so far is done (or failed)."""
        for writer in (self._disk, self._node_writer, self.peer):
            if writer is not None:
                writer.flush(timeout)

    def _mine(self, infos: list[SnapshotInfo]) -> list[SnapshotInfo]:
        return self._disk.own.mine(infos) if self._disk is not None else infos

    def _mine_unflagged(self, infos: list[SnapshotInfo]) -> list[SnapshotInfo]:
        """This run's disk snapshots, less those of flagged steps (each a finding)."""
        if self.rank_dir is None:
            return self._mine(infos)
        flags, out = Flags(self.rank_dir), []
        for info in self._mine(infos):
            why = flags.why(info) if info.path.parent == self.rank_dir else ""
            if why:
                self.emit(
                    Reason.SNAPSHOT_REFUSED,
                    Severity.WARNING,
                    f"{info.path} refused: step {info.step} was flagged after it was taken ({why}); never restored from",
                    step=info.step,
                    tier="disk",
                    file=info.path.name,
                )
            else:
                out.append(info)
        return out

    # -- shutdown ---------------------------------------------------------------------
    def close(self, timeout: float | None = 60.0) -> None:
        """Finishes queued writes and stops the writer thread."""
        if self._closed:
            return
        if self._prev_handler is not None:
            signum, prev = self._prev_handler
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, prev)
        for writer in (self._disk, self._node_writer, self.peer):
            if writer is not None:
                writer.close(timeout)
        if self._fence is not None:
            self._fence.remove()
        self.copier.close()
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restore ----------------------------------------------------------------------
    @property
    def mark_step_held(self) -> int | None:
        """The step whose end the step mark holds (None: none yet)."""
        return self.step_mark.step

    def rewind(self, step: int) -> int:
        """Put back the step mark of `step` (the end of the step before the one to run again):
        RNG, data position (a loader that cannot rewind goes on with its next batch),
        scheduler, scaler, the optimizer's hyperparameters and the extras. Weights and
        optimizer state are left as they are: the caller knows they did not change (the step's
        update was dropped). Training continues at `step` + 1. RollbackUnavailable: no mark of
        that step (a rollback is needed)."""
        if self.step_mark.step != step:
            raise RollbackUnavailable(f"no step mark of step {step} (held: {self.mark_step_held})")
        self.step_mark.put_back(self)
        self.step = step
        self.mark_step()
        return step

    def rollback(self, step: int | None = None, *, skip_batch: bool = False, micro_batches: Sequence[int] = ()) -> int:
        """Restores the newest in-memory snapshot that passed its verification (or the one at
        `step`, if it passed; one in flight is waited for: verify.py) into the live objects;
        training continues at the returned step + 1. skip_batch: the offending step's batches are
        stepped over on the replay (mscale.snapshot.data.step_batches); `last_skipped` lists them."""
        try:
            return self._rollback(step, skip_batch, micro_batches)
        except BaseException:
            self.mark_step()  # nothing was restored: the next step draws afresh
            raise

    def _rollback(self, step: int | None, skip_batch: bool, micro_batches: Sequence[int]) -> int:
        t0 = time.perf_counter()
        snap = self.verifier.newest_passed(step)  # pinned; one in flight waited for (verify.py)
        resumed = self._resumed if snap is None and self._resumed and step in (None, self._resumed[0]) else None
        if snap is None and resumed is None:
            raise RollbackUnavailable(
                f"no in-memory snapshot{'' if step is None else f' of step {step}'} (held: {self.held_steps})"
            )
        from_step = self.step
        bad = step_batches(self.data, micro_batches) if skip_batch else []
        if bad is None or (skip_batch and not hasattr(self.data, "skip_batch_at")):
            if snap is not None:
                self.store.unpin(snap)
            raise SnapshotError("skip_batch needs a data object with last_batch_position and skip_batch_at()")
        if snap is not None:
            tag, target = "memory", snap.step
            try:
                snap.wait_ready()
                restore.apply(self, snap.tensors, snap.objects, where=f"in-memory snapshot of step {snap.step}")
            finally:
                self.store.unpin(snap)
        else:  # no in-memory copy yet since the start-up resume: back to that disk snapshot
            assert resumed is not None and self.rank_dir is not None  # the check above
            # ... or, alone and that one refused now, to the newest older one that verifies
            infos = self._mine(list_snapshots(self.rank_dir)) if self.world_size == 1 else []
            older = {i.step for i in infos if i.path.parent == self.rank_dir and i.step < resumed[0]}
            found = load_newest_valid(self, [resumed[0], *sorted(older, reverse=True)], collective=False)
            if found is None:
                raise RollbackUnavailable(f"the disk snapshot of step {resumed[0]} is refused, and no older one")
            tag, (target, path, tensors, objects) = "disk", found
            restore.apply(self, tensors, objects, where=str(path), owned=True)
            self._resumed = (target, path)
        for position in bad:
            self.data.skip_batch_at(position)
        self.last_skipped = bad
        self.verifier.forget_after(target)
        self.store.drop_after(target)  # newer snapshots belong to the abandoned timeline
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
        """Steps a rollback can go to: the in-memory snapshots whose verification passed (one in
        flight waited for: verify.py), and the disk snapshot resumed from until the first
        in-memory one replaces it."""
        steps = self.verifier.passed_steps()
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

    def resume(self) -> int | None:
        """Start-up: restores the newest valid snapshot of the node tier (node_tier.py) or the
        disk, the node's first at the same step (a corrupted or partial one is refused with the
        file named, and the next tried; another world size's: worlds.py, disk only). Returns its
        step (training goes on at step + 1), or None. Collective with several ranks."""
        found = restore.resume(self)
        if found is None:
            return None
        step, path, tier = found
        if tier == "disk":
            # Until the first in-memory snapshot, a rollback goes back to this one on disk:
            # copying 3x the parameter bytes again at start-up would double the restore time.
            self._resumed = (step, path)
        return step
