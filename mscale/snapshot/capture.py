"""The capturing half of the snapshot engine (mscale.snapshot.engine adds the restore):
set-up from a `SnapshotConfig` (which file each model key and optimizer state goes to), the
in-memory snapshots (taken into reused host buffers, kept newest last, pinned while a writer
or a restore reads them), the per-step schedule, the disk writes (scheduled, on demand, in an
emergency, on a signal), the findings, and shutdown. See engine.py's docstring for the whole.
"""

from __future__ import annotations

import os
import platform
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self

import structlog
import torch
from torch import nn

import mscale.snapshot.distributed as mdist
import mscale.snapshot.memory as mem
from mscale.findings import Finding, Reason, Severity
from mscale.logs import debug_wanted
from mscale.snapshot import worlds
from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.format import (
    FORMAT,
    MANIFEST,
    NONMPU_FILE,
    NONMPU_OPTIM_FILE,
    SnapshotError,
    SnapshotInfo,
    mpu_file,
    optim_file,
)
from mscale.snapshot.keys import bare
from mscale.snapshot.memory import HostCopier, MemorySnapshot, rng_state, to_host
from mscale.snapshot.node_tier import Flags, NodeTier
from mscale.snapshot.optim import NamedOptimizer
from mscale.snapshot.ownership import dir_refused
from mscale.snapshot.peer_tier import PeerTier
from mscale.snapshot.writer import DiskWriter

__all__ = ["SnapshotCapture"]

log = structlog.get_logger("mscale.snapshot")


class SnapshotCapture:
    """Takes a training job's snapshots; SnapshotEngine (engine.py) restores them.

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
        scaler: Any = None,
        scheduler: Any = None,
        data: Any = None,
        extra: Mapping[str, Any] | None = None,
        binding: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
        emit: Callable[[Finding], None] | None = None,
        job_id: str = "",
        group: Any = None,
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
        self.last_skipped: list[dict] = []  # the data positions the last rollback stepped over
        self.recovery_seconds: dict[str, float] = {}  # checkpoint_recovery_time_seconds{tag}
        self.stall_s = 0.0  # seconds training waited on in-memory snapshots and restores (hook.goodput)
        self._mpus = self._check_mpus(mpus or {})
        self._prefixes = sorted(self._mpus.values(), key=lambda pf: -len(pf[0]))
        # optimizer state keyed by parameter name; the in-place restore reads it too (inplace.py)
        self.named_optimizer = NamedOptimizer(model, optimizer) if optimizer is not None else None
        self._lock = threading.Lock()
        self._kept: list[MemorySnapshot] = []  # oldest first
        self._spare: list[MemorySnapshot] = []  # retired, unpinned: buffers to reuse
        # the host copies' threads: they read snapshot files too (inplace.py, reshard.py)
        self.copier = HostCopier(copy_threads if copy_threads is not None else min(4, os.cpu_count() or 1))
        self._late = mem.late_keys(model, optimizer)  # copied beside training, fenced by the next step
        self._fence = mem.fence_on_step(optimizer, self.copier)
        self.wait_copy = self.copier.fence  # before writing parameters outside optimizer.step()
        self._closed = False
        self._prev_handler: Any = None
        self._resumed: tuple[int, Path] | None = None
        self.directory = Path(cfg.directory) if cfg.directory is not None else None
        self.rank_dir: Path | None = None
        self._disk: DiskWriter | None = None
        self.node: NodeTier | None = None  # the node tier (node_tier.py), when on
        self._node_writer: DiskWriter | None = None
        self.peer: PeerTier | None = None  # the peer tier (peer_tier.py), when on
        if self.directory is not None:
            self._disk = self._open_directory(self.directory)
        if self._disk is not None:  # (on every rank alike: the peer tier's start is collective)
            self._open_node_tier()
            self.peer = PeerTier.open(self, self.node)

    def _open_node_tier(self) -> None:
        """The node tier and its own writer thread, where NodeTier.open says it is on."""
        tier = NodeTier.open(self)
        if tier is None or self._disk is None:
            return
        self.node = tier
        self._node_writer = DiskWriter(
            tier.rank_dir,
            keep=self.config.node_keep,
            identity=self._disk.identity,
            emit=self.emit,
            unpin=self._unpin,
            tier="node",
            private=True,
        )

    def _open_directory(self, directory: Path) -> DiskWriter | None:
        """This rank's directory under `directory` (made), and the writer thread that fills it.
        None (no disk tier, on every rank alike) where a rank's directory is another user's."""
        if self.world_size > 1 and self.rank == 0:
            worlds.adopt_single(directory)  # before any rank lists it: worlds.plan waits for this
        rank_dir = worlds.rank_dir(directory, self.rank, self.world_size)
        try:
            rank_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            # a rank directory must be this uid's; the root may be shared (sticky, like /tmp)
            why = dir_refused(rank_dir) if rank_dir != directory else ""
        except OSError as e:
            why = f"not made ({e.strerror or e})"
        # every rank alike: resume and rollback to disk are collective
        if mdist.any_flag(bool(why), self.group):
            message = (
                f"{rank_dir} is {why}: never written to, listed or resumed from; this job keeps no disk "
                f"snapshots (in-memory ones go on). Remove it or give a directory of your own"
                if why
                else f"another rank's snapshot directory under {directory} is refused: this job keeps no "
                "disk snapshots, since every rank must resume the same step"
            )
            self.emit(Reason.SNAPSHOT_REFUSED, Severity.CRITICAL, message, file=rank_dir.name)
            return None
        self.rank_dir = rank_dir
        self._report_foreign(directory)
        identity = {
            "rank": self.rank,
            "world_size": self.world_size,
            "job_id": self.job_id,
            "optimizer": self.optimizer is not None,  # so the manifest's completeness can be checked
            "mpus": {
                mpu_id: {"name": self.mpu_names[mpu_id], "file": f, "optim_file": optim_file(f)}
                for mpu_id, (_, f) in self._mpus.items()
            },
        }
        return DiskWriter(self.rank_dir, keep=self.disk_keep, identity=identity, emit=self.emit, unpin=self._unpin)

    def _report_foreign(self, directory: Path, most: int = 8) -> None:
        """One finding naming the rank directories of `directory` that are not this uid's (at most
        `most` named): ignored, never written to, listed or resumed from (ownership.py)."""
        try:
            names = sorted(p.name for p in directory.iterdir() if worlds.RANK_DIR.match(p.name))
        except OSError:
            return
        foreign = [(n, why) for n in names if (why := dir_refused(directory / n))]
        if foreign:
            named = "; ".join(f"{n} is {why}" for n, why in foreign[:most])
            more = f" (and {len(foreign) - most} more)" if len(foreign) > most else ""
            self.emit(
                Reason.SNAPSHOT_REFUSED,
                Severity.WARNING,
                f"{named}{more}: ignored, never written to, listed or resumed from by this run",
                file=foreign[0][0],
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
            out[mpu_id] = (prefix_of[id(module)], mpu_file(mpu_id, name))
            self.mpu_names[mpu_id] = name
        self._mpu_modules = {mpu_id: module for name, (mpu_id, module) in mpus.items()}
        return out

    def _file_of(self, key: str, *, optim: bool = False) -> str:
        """The file a model key (or, optim, the optimizer state of a parameter) goes to.
        Model and optimizer state are separate files: more files hash in parallel."""
        for prefix, fname in self._prefixes:
            if prefix == "" or key == prefix or key.startswith(prefix + "."):
                return optim_file(fname) if optim else fname
        return NONMPU_OPTIM_FILE if optim else NONMPU_FILE

    # -- findings ---------------------------------------------------------------------
    def emit(self, reason: Reason, severity: Severity, message: str, **labels: Any) -> Finding:
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
                files[optim_file(f)] = {}
        for key, t in self.model.state_dict().items():
            files[self._file_of(key)]["model/" + key] = t
        objects: dict[str, Any] = {"format": FORMAT, "step": self.step}
        if self.named_optimizer is not None:
            objects["optimizer"] = self.named_optimizer.capture(files, lambda fqn: self._file_of(fqn, optim=True))
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
        ready = self.copier.copy_state(files, bufs, self._late)
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
        to_node = self.node is not None and step % self.node.every == 0
        if (self.memory_every and step % self.memory_every == 0) or to_disk or to_node:
            snap = self.snapshot()
            if to_disk:
                self._queue_write(snap, why="schedule")
            if to_node and self.node is not None and not self.node.past_cap(self.peer, self._node_writer):
                written = self._queue_write(snap, why="schedule", writer=self._node_writer)
                if self.peer is not None and step % self.peer.every == 0:
                    self.peer.replicate(step, written)  # sent by its thread once written

    # -- disk -------------------------------------------------------------------------
    def _queue_write(self, snap: MemorySnapshot, *, why: str, writer: DiskWriter | None = None) -> Future:
        writer = writer if writer is not None else self._disk
        if writer is None:
            fut: Future = Future()
            fut.set_exception(SnapshotError("no snapshot directory configured"))
            return fut
        with self._lock:
            snap.pins += 1
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

    def mark_step(self) -> None:  # a step ended (or was undone): the next batch opens the next one
        getattr(self.data, "mark_step", lambda: None)()

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

    def __exit__(self, *exc: Any) -> None:
        self.close()
