"""The snapshots' settings, `SnapshotConfig`, validated in one place: what `SnapshotEngine`
takes and what `mscale.attach(..., snapshots=...)` is given (a path is
`SnapshotConfig(directory=path)`, True is `SnapshotConfig()`). Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SnapshotConfig", "NODE_ROOT_ENV", "DEFAULT_NODE_ROOT"]

NODE_ROOT_ENV = "MSCALE_SNAPSHOT_NODE_ROOT"  # where the node tier lives when node_root is not given
DEFAULT_NODE_ROOT = "/dev/shm"


@dataclass(frozen=True)
class SnapshotConfig:
    """The snapshots a job takes, tier by tier (docs/snapshots.md).

    directory: where disk snapshots go (None: in memory only). memory_every: an in-memory
    snapshot after every N-th step, the rollback targets (0: only those `snapshot()` takes and
    the disk schedule's; `attach` needs >= 1); memory_keep: how many are held. disk_every: a
    disk snapshot after every N-th step (0: only on demand and in emergencies); disk_keep: how
    many stay on disk.
    node_every: a snapshot in the node's shared memory (survives the process and a torchrun
    restart) after every N-th step; None (the default): every 10 steps (the first multiple of
    `memory_every` of at least 10: in-memory snapshots already taken) where the node root has room for two snapshots (checked at start-up, said in a finding either way),
    0: no node tier. It needs a directory (the node tier's snapshots are keyed by the job id
    and the directory). node_keep: how many stay there. node_root: the shared-memory file
    system it lives in (default: $MSCALE_SNAPSHOT_NODE_ROOT, else /dev/shm).
    peer_every: a replica of the node-tier snapshot every N steps (rounded up to a multiple of
    the node tier's schedule) sent to the rank (rank + LOCAL_WORLD_SIZE) % world, on another node,
    which keeps it in its own node tier (survives the loss of this node; peer_tier.py); 0: none.
    peer_keep: how many replicas of its source a rank holds. peer_timeout_s: the longest any
    wait of the replication takes (a peer that does not answer stops it, with a finding).
    node_cap_bytes: the most bytes a rank's node-tier snapshots and the replicas it holds may
    take in the node root; a write past it is refused with a finding (None: no cap but the room).
    """

    directory: str | os.PathLike[str] | None = None
    memory_every: int = 10
    memory_keep: int = 2
    disk_every: int = 100
    disk_keep: int = 3
    node_every: int | None = None
    node_keep: int = 2
    node_root: str | os.PathLike[str] | None = None
    peer_every: int = 50
    peer_keep: int = 1
    peer_timeout_s: float = 120.0
    node_cap_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.directory is not None and not os.fspath(self.directory):
            raise ValueError("directory: expected a path, got an empty string")
        if self.node_root is not None and not os.fspath(self.node_root):
            raise ValueError("node_root: expected a path, got an empty string")
        if self.memory_every < 0 or self.disk_every < 0 or (self.node_every or 0) < 0:
            raise ValueError(
                f"memory_every, disk_every, node_every: expected >= 0 (0: no schedule), got "
                f"{self.memory_every}, {self.disk_every}, {self.node_every}"
            )
        if self.memory_keep < 1 or self.disk_keep < 1 or self.node_keep < 1:
            raise ValueError(
                f"memory_keep, disk_keep, node_keep: expected >= 1, got {self.memory_keep}, {self.disk_keep}, {self.node_keep}"
            )

        if self.peer_every < 0 or self.peer_keep < 1:
            raise ValueError(f"peer_every: expected >= 0, peer_keep >= 1, got {self.peer_every}, {self.peer_keep}")
        if not self.peer_timeout_s > 0:
            raise ValueError(f"peer_timeout_s: expected seconds > 0, got {self.peer_timeout_s}")
        if self.node_cap_bytes is not None and self.node_cap_bytes < 1:
            raise ValueError(f"node_cap_bytes: expected bytes >= 1 or None, got {self.node_cap_bytes}")

    @property
    def node_root_path(self) -> str:
        """The node tier's file system: node_root, else $MSCALE_SNAPSHOT_NODE_ROOT, else /dev/shm."""
        return (
            os.fspath(self.node_root)
            if self.node_root is not None
            else os.environ.get(NODE_ROOT_ENV) or DEFAULT_NODE_ROOT
        )
