"""The snapshots' settings, `SnapshotConfig`, validated in one place: what `SnapshotEngine`
takes and what `mscale.attach(..., snapshots=...)` is given (a path is
`SnapshotConfig(directory=path)`, True is `SnapshotConfig()`). Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SnapshotConfig"]


@dataclass(frozen=True)
class SnapshotConfig:
    """The snapshots a job takes.

    directory: where disk snapshots go (None: in memory only). memory_every: an in-memory
    snapshot after every N-th step, the rollback targets (0: only those `snapshot()` takes and
    the disk schedule's; `attach` needs >= 1); memory_keep: how many are held. disk_every: a
    disk snapshot after every N-th step (0: only on demand and in emergencies); disk_keep: how
    many stay on disk.
    """

    directory: str | os.PathLike | None = None
    memory_every: int = 10
    memory_keep: int = 2
    disk_every: int = 100
    disk_keep: int = 3

    def __post_init__(self) -> None:
        if self.directory is not None and not os.fspath(self.directory):
            raise ValueError("directory: expected a path, got an empty string")
        if self.memory_every < 0 or self.disk_every < 0:
            raise ValueError(
                f"memory_every, disk_every: expected >= 0 (0: no schedule), got {self.memory_every}, {self.disk_every}"
            )
        if self.memory_keep < 1 or self.disk_keep < 1:
            raise ValueError(f"memory_keep, disk_keep: expected >= 1, got {self.memory_keep}, {self.disk_keep}")
