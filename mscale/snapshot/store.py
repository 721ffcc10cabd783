"""The in-memory snapshots the engine keeps: newest last, at most `keep`, each pinned while a
writer or a restore reads it; a retired one's host buffers are reused by the next snapshot
(fresh host memory costs page faults on first touch, often more than the copy itself). The
engine (engine.py) holds one `MemoryStore` and calls it; every method takes its lock."""

from __future__ import annotations

import threading

import torch

import mscale.snapshot.memory as mem
from mscale.snapshot.memory import MemorySnapshot

__all__ = ["MemoryStore"]


class MemoryStore:
    """The kept snapshots (oldest first) and at most one spare set of buffers: bounded memory."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: list[MemorySnapshot] = []  # oldest first
        self.spare: list[MemorySnapshot] = []  # retired, unpinned: buffers to reuse

    def buffers_for(self, files: dict[str, dict[str, torch.Tensor]], keep: int) -> dict[str, dict[str, torch.Tensor]]:
        """Host buffers shaped like `files`: the oldest kept snapshot's when keeping this one
        evicts it anyway (so `keep` sets suffice), else a retired one's."""
        with self.lock:
            old = None
            if len(self.kept) >= keep and self.kept[0].pins == 0:
                old = self.kept.pop(0)
                old.retired = True
            elif self.spare:
                old = self.spare.pop()
        return mem.host_buffers(files, old.tensors if old else {})

    def keep(self, snap: MemorySnapshot, keep: int) -> None:
        """Keeps `snap` as the newest (replacing one of the same step), at most `keep` in all."""
        with self.lock:
            self.kept = [s for s in self.kept if s.step != snap.step]
            self.kept.append(snap)
            while len(self.kept) > keep:
                self._retire(self.kept.pop(0))

    def _retire(self, snap: MemorySnapshot) -> None:
        # With the lock held. Keep at most one spare set of buffers: bounded memory.
        snap.retired = True
        if snap.pins == 0 and not self.spare:
            self.spare.append(snap)

    def pin(self, snap: MemorySnapshot) -> None:
        with self.lock:
            snap.pins += 1

    def unpin(self, snap: MemorySnapshot) -> None:
        with self.lock:
            snap.pins -= 1
            if snap.retired and snap.pins == 0 and not self.spare:
                self.spare.append(snap)

    def steps(self) -> list[int]:
        with self.lock:
            return [s.step for s in self.kept]

    def latest(self, step: int | None = None, *, pin: bool = False) -> MemorySnapshot | None:
        """The newest snapshot, or the newest of `step`; pin: pinned (the caller unpins it)."""
        with self.lock:
            kept = [s for s in self.kept if step is None or s.step == step]
            snap = kept[-1] if kept else None
            if pin and snap is not None:
                snap.pins += 1
            return snap

    def pin_newest_ready(self) -> MemorySnapshot | None:
        """The newest whose copies have landed, pinned: a GPU that stopped answering never
        completes the copy in flight, and waiting for it would hang the caller."""
        with self.lock:
            ready = [s for s in self.kept if s.is_ready()]
            snap = ready[-1] if ready else None
            if snap is not None:
                snap.pins += 1
            return snap

    def snapshots(self) -> list[MemorySnapshot]:
        """The kept snapshots, oldest first (a copy of the list)."""
        with self.lock:
            return list(self.kept)

    def pin_kept(self, snap: MemorySnapshot) -> bool:
        """Pins `snap` if it is still kept (the caller unpins it); False when it is not."""
        with self.lock:
            if snap not in self.kept:
                return False
            snap.pins += 1
            return True

    def drop(self, snap: MemorySnapshot) -> None:
        """Retires `snap` (one that failed its verification: never restored)."""
        with self.lock:
            if snap in self.kept:
                self.kept.remove(snap)
                self._retire(snap)

    def drop_after(self, step: int) -> None:
        """Retires the snapshots newer than `step`: they belong to an abandoned timeline."""
        with self.lock:
            for s in [s for s in self.kept if s.step > step]:
                self.kept.remove(s)
                self._retire(s)
