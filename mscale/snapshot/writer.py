"""The background thread that writes memory snapshots to a rank's snapshot directory.

A write goes to `.tmp-step_N-...`: every file is written and hashed chunk by chunk (two files
at once, each hash in a helper thread), fsynced, the manifest written last, the directory
fsynced and renamed to `step_N` (then the parent fsynced), so a crash at any point leaves only
complete snapshots. Old snapshots beyond `keep` are renamed away and removed. A failed write
(disk full) is a Finding and the exception of its future; the thread goes on.

Jobs are queued without a lock (a deque and a non-blocking pipe), so posting one is safe from a
signal handler.
"""

from __future__ import annotations

import errno
import io
import json
import os
import platform
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from mscale.findings import Reason, Severity
from mscale.snapshot.format import (
    ASIDE_PREFIX,
    BINDING,
    FORMAT,
    MANIFEST,
    RANK_DIR,
    TEMP_PREFIX,
    TRAIN_STATE,
    SnapshotError,
    fsync_dir,
    list_snapshots,
    step_dir_name,
    write_file,
)
from mscale.snapshot.manifest import FileMeta, Identity, parse_manifest
from mscale.snapshot.memory import MemorySnapshot
from mscale.snapshot.ownership import Ownership
from mscale.snapshot.tensors import safetensors_parts
from mscale.snapshot.values import JSONObject
from mscale.version import __version__

_T = TypeVar("_T")
# (kind, payload: a MemorySnapshot to write or a function to call, its future, why)
_Job = tuple[str, Any, "Future[Any]", str]

__all__ = ["DiskWriter"]

_WRITERS = 2  # files written (and hashed) at once

log = structlog.get_logger("mscale.snapshot")


def _train_state(snap: MemorySnapshot) -> io.BytesIO:
    """The snapshot's objects as `train_state.pt` bytes, refused now if loading them with
    weights_only would be refused later."""
    train_state = io.BytesIO()
    torch.save(snap.objects, train_state)
    try:
        torch.load(io.BytesIO(train_state.getvalue()), weights_only=True)
    except Exception as e:
        raise SnapshotError(f"the training state holds objects that weights_only loading refuses: {e}") from None
    return train_state


class DiskWriter:
    """Writes MemorySnapshots to `rank_dir` in a thread of its own, keeping the newest `keep`.

    identity: the manifest's rank, world_size, job_id and mpus entries.
    emit(reason, severity, message, **labels): how findings are reported.
    unpin(snap): called once a queued snapshot is written, failed or skipped.
    admit(snap): asked in the writer thread before a queued snapshot is written; False skips it
    (result None; admit's finding says why): the node tier's cap (node_tier.py), off the
    training thread.
    """

    def __init__(
        self,
        rank_dir: Path,
        *,
        keep: int,
        identity: Identity,
        emit: Callable[..., object],
        unpin: Callable[[MemorySnapshot], None],
        tier: str = "disk",
        private: bool = False,
        admit: Callable[[MemorySnapshot], bool] | None = None,
    ) -> None:
        self.rank_dir, self.keep, self.identity = rank_dir, keep, identity
        # the node tier (node_tier.py): its findings say so; private: 0700 directories, 0600 files
        self.tier, self._file_mode, self._dir_mode = tier, (0o600 if private else 0o644), (0o700 if private else 0o777)
        self._emit, self._unpin, self._admit = emit, unpin, admit
        self.own = Ownership(identity["job_id"], emit)  # only this run's snapshots
        self.last_write: JSONObject = {}
        self._clean_leftovers()
        self._jobs: deque[_Job] = deque()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # Two files are written at once, each hashed chunk by chunk in a helper thread while
        # the chunk is written (BLAKE3 chunk tree, digest.py): hashing would otherwise bound it.
        self._hasher = ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="mscale-snapshot-hash")
        self._file_writers = ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="mscale-snapshot-write")
        self._thread = threading.Thread(target=self._loop, name="mscale-snapshot-writer", daemon=True)
        self._thread.start()

    def _clean_leftovers(self) -> None:
        # Temporary directories of writers that died (kill -9, power loss): never complete.
        for p in self.rank_dir.iterdir():
            if (p.name.startswith(TEMP_PREFIX) or p.name.startswith(ASIDE_PREFIX)) and self.own.owns_dir(p):
                shutil.rmtree(p, ignore_errors=True)

    # -- the queue --------------------------------------------------------------------
    def _post(self, job: _Job) -> Future[Any]:
        # Lock-free, so it is safe from a signal handler: deque.append is atomic, and the
        # pipe write end is non-blocking (a full pipe already means a wake-up is pending).
        if self._closed:
            job[2].set_exception(SnapshotError("the snapshot engine is closed"))
            return job[2]
        self._jobs.append(job)
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass
        return job[2]

    def write(self, snap: MemorySnapshot, why: str) -> Future[Path | None]:
        """Queues a write of `snap` (pinned by the caller; unpinned when done). Its future
        gives the snapshot's directory. A scheduled write with a newer one queued behind it
        is skipped (result None): the disk is slower than the schedule."""
        return self._post(("write", snap, Future(), why))

    def call(self, fn: Callable[[], _T]) -> Future[_T]:
        """Runs fn() in the writer thread, in queue order; its future gives what fn returns."""
        return self._post(("call", fn, Future(), ""))

    def prune_after(self, step: int) -> Future[None]:
        """Removes, in queue order, the snapshots newer than `step` (an abandoned timeline)."""
        return self.call(lambda: self._prune_after(step))

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every write queued so far is finished (written or failed)."""
        self._post(("barrier", None, Future(), "")).result(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Finishes queued writes and stops the thread."""
        if self._closed:
            return
        self._post(("stop", None, Future(), ""))
        self._closed = True
        self._thread.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._hasher.shutdown(wait=False)
        self._file_writers.shutdown(wait=False)

    def _loop(self) -> None:
        while True:
            if not self._jobs:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    return
                continue
            kind, payload, fut, why = self._jobs.popleft()
            if kind == "stop":
                fut.set_result(None)
                return
            if kind == "barrier":
                fut.set_result(None)
                continue
            if kind == "call":
                try:
                    fut.set_result(payload())
                except BaseException as e:  # the caller's to report; never kill the writer
                    fut.set_exception(e)
                continue
            snap = payload
            if self._skipped(snap, why):
                self._unpin(snap)
                fut.set_result(None)
                continue
            try:
                fut.set_result(self.write_now(snap, why))
            except BaseException as e:  # reported as a Finding by write_now; never kill the writer
                fut.set_exception(e)
            finally:
                self._unpin(snap)

    def _skipped(self, snap: MemorySnapshot, why: str) -> bool:
        """Whether a queued write is not to be done: a scheduled one with a newer one queued
        behind it, or one `admit` refuses (an admit that fails refuses it, with a finding)."""
        if why == "schedule" and any(j[0] == "write" for j in list(self._jobs)):
            log.warning("scheduled snapshot superseded before it was written", step=snap.step, tier=self.tier)
            return True
        try:
            return self._admit is not None and not self._admit(snap)
        except Exception as e:  # never kill the writer
            self._emit_failed(snap, e, why)
            return True

    # -- writing ----------------------------------------------------------------------
    def write_now(self, snap: MemorySnapshot, why: str) -> Path:
        """Writes `snap` in the calling thread (the writer's); returns its directory."""
        t0 = time.perf_counter()
        name = step_dir_name(snap.step)
        final = self.rank_dir / name
        tmp = self.rank_dir / f"{TEMP_PREFIX}{name}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            snap.wait_ready()
            train_state = _train_state(snap)
            tmp.mkdir(self._dir_mode)
            files = self._write_files(snap, tmp, train_state)
            self._write_manifest(snap, tmp, files, why)
            self._put_in_place(tmp, final, name)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            self._emit_failed(snap, e, why)
            raise
        snap.disk_path = final
        seconds = time.perf_counter() - t0
        total = sum(f["size"] for f in files.values())
        self.last_write = {"step": snap.step, "bytes": total, "seconds": seconds, "path": str(final)}
        self._emit(
            Reason.SNAPSHOT_WRITTEN,
            Severity.INFO,
            f"snapshot of step {snap.step} written to {final} ({total} bytes, {seconds:.3f} s)",
            step=snap.step,
            why=why,
            tier=self.tier,
            bytes=total,
            seconds=f"{seconds:.6f}",
        )  # the agent's snapshot metrics
        try:
            self._prune()
        except OSError as e:
            log.error("could not remove old snapshots", error=str(e), keep=self.keep)
        return final

    def _write_files(self, snap: MemorySnapshot, tmp: Path, train_state: io.BytesIO) -> dict[str, FileMeta]:
        """Every file but the manifest, fsynced: the tensors (the largest first, on the file
        writers' threads), the train state and the binding. Returns name -> size and digest."""
        files: dict[str, FileMeta] = {}
        meta = {"format": FORMAT, "step": str(snap.step)}

        def write(fname: str) -> tuple[str, tuple[int, FileMeta]]:
            # fsync in the writer: the device flushes one file while the other writer
            # thread is still hashing and copying the next.
            parts = safetensors_parts(snap.tensors[fname], meta)
            return fname, write_file(tmp / fname, parts, self._hasher, mode=self._file_mode)

        by_size = sorted(
            snap.tensors, key=lambda f: -sum(t.numel() * t.element_size() for t in snap.tensors[f].values())
        )
        futures = [self._file_writers.submit(write, f) for f in by_size]
        wait_futures(futures)  # all of them, even when one failed: then the cleanup is whole
        for fname, (_, entry) in sorted((f.result() for f in futures), key=lambda done: done[0]):
            files[fname] = entry
        files[TRAIN_STATE] = write_file(
            tmp / TRAIN_STATE, [train_state.getbuffer()], self._hasher, mode=self._file_mode
        )[1]
        raw = json.dumps(snap.binding, indent=2, sort_keys=True).encode()
        files[BINDING] = write_file(tmp / BINDING, [raw], self._hasher, mode=self._file_mode)[1]
        return files

    def _write_manifest(self, snap: MemorySnapshot, tmp: Path, files: dict[str, FileMeta], why: str) -> None:
        manifest = {
            "format": FORMAT,
            "step": snap.step,
            **self.identity,
            "created_unix": snap.created,
            "why": why,
            "versions": {"mscale": __version__, "torch": torch.__version__, "python": platform.python_version()},
            "files": files,
        }
        raw_manifest = json.dumps(manifest, indent=2, sort_keys=True).encode()
        parse_manifest(raw_manifest, tmp)  # never a snapshot its own loader would refuse
        # Written last: a directory with a manifest had every other file fsynced first.
        write_file(tmp / MANIFEST, [raw_manifest], self._hasher, mode=self._file_mode)
        fsync_dir(tmp)

    def _put_in_place(self, tmp: Path, final: Path, name: str) -> None:
        """The complete snapshot renamed to its step's name (one of that step already there,
        after a rollback, is replaced whole)."""
        aside = None
        if final.exists():
            aside = self.rank_dir / f"{ASIDE_PREFIX}{name}-{os.urandom(4).hex()}"
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(self.rank_dir)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def _emit_failed(self, snap: MemorySnapshot, e: BaseException, why: str) -> None:
        if isinstance(e, OSError):
            code = errno.errorcode.get(e.errno or 0, str(e.errno))
            msg = f"snapshot of step {snap.step} not written to {self.rank_dir}: {e.strerror or e} ({code}); training continues, the in-memory snapshot is kept"
            self._emit(
                Reason.SNAPSHOT_FAILED, Severity.CRITICAL, msg, step=snap.step, errno=code, why=why, tier=self.tier
            )
        else:
            self._emit(
                Reason.SNAPSHOT_FAILED,
                Severity.CRITICAL,
                f"snapshot of step {snap.step} not written: {e}",
                step=snap.step,
                why=why,
                tier=self.tier,
            )

    # -- removing ---------------------------------------------------------------------
    def _remove(self, path: Path) -> None:
        # Renamed away first (atomic), so a crash mid-delete never leaves a step_ directory
        # with some files gone; leftovers are removed at the next start.
        aside = self.rank_dir / f"{ASIDE_PREFIX}{path.name}-{os.urandom(4).hex()}"
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)

    def _prune(self) -> None:
        infos = self.own.mine(list_snapshots(self.rank_dir))
        complete = [i for i in infos if i.path.parent == self.rank_dir and i.complete]
        for info in sorted(complete, key=lambda i: i.step)[: -self.keep]:
            self._remove(info.path)
        fsync_dir(self.rank_dir)
        kept = sorted(i.step for i in complete)[-self.keep :]
        if self.identity["rank"] == 0 and len(kept) == self.keep and RANK_DIR.match(self.rank_dir.name):
            self._prune_outside_world(kept[0])

    def _prune_outside_world(self, oldest_kept: int) -> None:
        """Rank 0: the rank directories of ranks beyond this world (an older run's, on more ranks:
        mscale/snapshot/worlds.py) lose their snapshots older than every one this rank keeps; no
        rank of this world would ever prune them, nor resume them over the newer ones."""
        world = self.identity["world_size"] or 1
        for d in self.rank_dir.parent.iterdir():
            m = RANK_DIR.match(d.name)
            if not (m and d.is_dir() and int(m.group(1)) >= world):
                continue
            for info in self.own.mine(list_snapshots(d)):
                if info.complete and info.step < oldest_kept and info.path.parent == d:
                    self._remove(info.path)

    def _prune_after(self, step: int) -> None:
        # Snapshots newer than a rollback target belong to the abandoned timeline.
        try:
            for info in self.own.mine(list_snapshots(self.rank_dir)):
                if info.step > step and info.path.parent == self.rank_dir:
                    self._remove(info.path)
                    log.info("removed snapshot of the abandoned timeline", step=info.step, path=str(info.path))
            fsync_dir(self.rank_dir)
        except OSError as e:
            log.error("could not remove snapshots of the abandoned timeline", error=str(e))
