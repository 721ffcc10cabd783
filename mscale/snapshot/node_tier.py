"""The node tier: snapshots in the node's shared memory (`/dev/shm`), which outlive the process
(a segfault, an OOM kill, kill -9) and a torchrun restart of the worker group, and are read
back at memory speed. Not a node's loss: the peer tier (peer_tier.py) is for that.

Layout: `<root>/mscale-<uid>/<job>-<dir>/rank_NNNNN/step_*`, where `<job>` is the job id (made
safe for a file name) and `<dir>` the first 12 hex digits of the SHA-256 of the disk snapshot
directory's absolute path: a restarted job (same id, same directory) finds its own, two jobs
never mix. Every directory is made 0700, every file 0600, and each must be a real directory of
this uid (ownership.py): one another uid owns, or a symbolic link, is refused with a finding and
the tier stays off. A snapshot there is the disk tier's format (writer.py, format.py) written by
its own writer thread (another `DiskWriter`, its own `node_keep`), so every file is hashed at
capture and checked against the manifest on read before any byte is applied (inplace.py).

On by default (`node_every=None`: every 10 steps, or the first multiple of `memory_every` past
it, so that each is an in-memory snapshot already taken) where the root has room for
`node_keep + 1` snapshots of this rank and of each other rank on the node (`LOCAL_WORLD_SIZE`):
a finding at start-up says which, and why not. The estimate of a snapshot's size is the model's
state plus the optimizer's (twice the parameters where the optimizer holds no state yet: Adam's
two moments).

Flags (`Flags`): a step whose state a later finding puts in doubt (a checksum, gradient or
weight finding) is written to `flagged.json` in the rank directory, with the time: a snapshot
of a flagged step taken before the flag is never restored from, in any tier.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from mscale.findings import Reason, Severity
from mscale.snapshot.format import SnapshotInfo, list_snapshots, rank_dir_name
from mscale.snapshot.ownership import dir_refused
from mscale.snapshot.values import as_int

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine
    from mscale.snapshot.memory import MemorySnapshot
    from mscale.snapshot.writer import DiskWriter

__all__ = ["NodeTier", "Flags", "node_job_dir", "estimate_bytes", "make_private", "tier_bytes"]

FLAGS = "flagged.json"
MAX_FLAGS = 64  # entries kept, newest last: a bounded file
DEFAULT_EVERY = 10  # steps between node-tier snapshots by default, at least (default_every)


def node_job_dir(root: str | os.PathLike[str], job_id: str, directory: str | os.PathLike[str]) -> Path:
    """Where a job's node tier lives under `root` (see the module docstring)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", job_id)[:64] or "job"
    key = hashlib.sha256(os.fspath(Path(directory).absolute()).encode()).hexdigest()[:12]
    return Path(root) / f"mscale-{os.geteuid()}" / f"{safe}-{key}"


def default_every(memory_every: int) -> int:
    """The node tier's default schedule: the first multiple of `memory_every` of at least
    DEFAULT_EVERY steps (its snapshots are in-memory ones already taken; 0: none)."""
    return -(-DEFAULT_EVERY // memory_every) * memory_every if memory_every > 0 else 0


def estimate_bytes(model: Any, optimizer: Any) -> int:
    """A snapshot's size: the model's state and the optimizer's (see the module docstring)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if optimizer is None:
        return total
    held = 0
    params = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            params += p.numel() * p.element_size()
            for v in optimizer.state.get(p, {}).values():
                if hasattr(v, "numel"):
                    held += v.numel() * v.element_size()
    return total + (held if held else 2 * params)


def tier_bytes(directory: Path) -> int:
    """The bytes of the files under `directory` (0 when it is missing)."""
    total = 0
    for top, _, names in os.walk(directory):
        for n in names:
            try:
                total += os.lstat(os.path.join(top, n)).st_size
            except OSError:
                pass  # removed while counted
    return total


class Flag(TypedDict):
    """One entry of the flags file: the snapshots of steps first..last taken before `before`
    (seconds since 1970) are flagged, and why."""

    first: int
    last: int
    before: float
    why: str


class Flags:
    """The steps of a rank directory never to be restored from (see the module docstring)."""

    def __init__(self, rank_dir: Path) -> None:
        self.path = rank_dir / FLAGS

    def entries(self) -> list[Flag]:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(raw, list):
            return []
        return [
            Flag(first=e["first"], last=e["last"], before=e["before"], why=e["why"])
            for e in raw
            if isinstance(e, dict)
            and {"first", "last", "before", "why"} <= e.keys()
            and all(isinstance(e[k], int) for k in ("first", "last"))
            and isinstance(e["before"], int | float)
            and isinstance(e["why"], str)
        ]

    def add(self, first: int, last: int, why: str) -> None:
        """Flags the snapshots of steps first..last taken until now (atomically, 0600)."""
        entries = [*self.entries(), {"first": first, "last": last, "before": time.time(), "why": why[:256]}]
        tmp = self.path.with_name(f".{FLAGS}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entries[-MAX_FLAGS:], f)
        os.replace(tmp, self.path)

    def why(self, info: SnapshotInfo) -> str:
        """Why `info` is flagged ('' when it is not)."""
        created = float(info.manifest["created_unix"]) if info.manifest is not None else 0.0
        for e in self.entries():
            if e["first"] <= info.step <= e["last"] and created <= e["before"]:
                return e["why"]
        return ""


def make_private(path: Path) -> str:
    """Makes `path` (0700) if missing; '' when it is a real directory of this uid, else why not."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        return f"not made ({e.strerror or e})"
    return dir_refused(path)


class NodeTier:
    """Where this rank's node-tier snapshots go, and which of them a resume may take.
    `open()` decides whether the tier is on (a finding says so either way)."""

    def __init__(self, engine: SnapshotEngine, root: Path, job_dir: Path, every: int, explicit: bool) -> None:
        self.engine, self.root, self.job_dir, self.every = engine, root, job_dir, every
        self.rank_dir = job_dir / rank_dir_name(engine.rank)
        self.explicit = explicit  # node_every given: on even when the room looks short
        self.flags = Flags(self.rank_dir)

    @classmethod
    def open(cls, engine: SnapshotEngine) -> NodeTier | None:
        """The tier for `engine` (a SnapshotEngine with a directory), or None: off, with the reason."""
        cfg = engine.config
        every = default_every(cfg.memory_every) if cfg.node_every is None else cfg.node_every
        root = Path(cfg.node_root_path)
        why = ""
        if cfg.node_every == 0:
            return None  # asked for none: nothing to say
        if engine.directory is None:
            why = "no snapshot directory to key it by"
        elif not every:
            why = "neither node_every nor memory_every schedules a snapshot"
        elif not root.is_dir():
            why = f"{root} is not a directory"
        tier = cls(
            engine, root, node_job_dir(root, engine.job_id, engine.directory or "."), every, cfg.node_every is not None
        )
        if not why:
            why = tier._prepare()
        if why:
            engine.emit(Reason.SNAPSHOT_TIER, Severity.WARNING, f"node snapshot tier off: {why}", tier="node")
            return None
        return tier

    def _prepare(self) -> str:
        """Makes the tier's directories and checks the room; why not ('' when on)."""
        for path in (self.job_dir.parent, self.job_dir, self.rank_dir):
            if why := make_private(path):
                return f"{path} is {why}"
        need, free = self.room()
        cfg, where = self.engine.config, f"{self.root} ({free / 2**20:.1f} MiB free)"
        if need > free and not self.explicit:
            return f"{where} has no room for {cfg.node_keep + 1} snapshots of each rank here ({need / 2**20:.1f} MiB)"
        short = "" if need <= free else f"; short of room ({need / 2**20:.1f} MiB wanted), node_every was given"
        self.engine.emit(
            Reason.SNAPSHOT_TIER,
            Severity.INFO if not short else Severity.WARNING,
            f"node snapshot tier on: every {self.every} steps, the newest {cfg.node_keep} kept in {self.rank_dir}, "
            f"{where}{short}",
            tier="node",
            need_bytes=need,
            free_bytes=free,
        )
        return ""

    def room(self) -> tuple[int, int]:
        """(bytes this node's ranks need, bytes free in the root plus what this rank's tier holds)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        size = estimate_bytes(self.engine.model, self.engine.optimizer)
        st = os.statvfs(self.root)
        held = sum(i.nbytes for i in list_snapshots(self.rank_dir))
        return (self.engine.config.node_keep + 1) * size * max(local, 1), st.f_bavail * st.f_frsize + held

    def past_cap(self, snap: MemorySnapshot, writer: DiskWriter) -> bool:
        """Whether writing `snap` would take this rank's node-tier bytes (its snapshots and the
        replicas it holds) past node_cap_bytes; a finding says so each time it is refused. Asked
        by the node tier's writer thread before it writes (its `admit`): the directories are
        walked there, never on the training thread."""
        cap = self.engine.config.node_cap_bytes
        if cap is None:
            return False
        peer = self.engine.peer
        held = sum(tier_bytes(d) for d in (self.rank_dir, *((peer.dir, peer.fetched) if peer is not None else ())))
        size = as_int(writer.last_write.get("bytes") or 0, "the last node write's size") or snap.nbytes
        if held + size <= cap:
            return False
        self.engine.emit(
            Reason.SNAPSHOT_FAILED,
            Severity.WARNING,
            f"node-tier snapshot of step {snap.step} not written: {size} bytes more would take this rank's "
            f"node tier past node_cap_bytes ({held} of {cap} bytes held)",
            step=snap.step,
            tier="node",
        )
        return True

    def candidates(self, keep: Any) -> dict[int, Path]:
        """step -> path of this rank's node-tier snapshots a resume may try: this run's (`keep`:
        ownership.py), of this world size and rank, not flagged (each flagged one a finding).
        A step directory whose manifest is refused is tried too: the load names the file."""
        out: dict[int, Path] = {}
        for info in keep(list_snapshots(self.rank_dir)):
            if info.path.parent != self.rank_dir or info.step < 0:
                continue
            m = info.manifest
            if m is not None and (int(m.get("world_size") or 1), int(m.get("rank") or 0)) != (
                self.engine.world_size,
                self.engine.rank,
            ):
                continue  # another world's: the disk tier re-splits those (worlds.py)
            if why := self.flags.why(info):
                self.engine.emit(
                    Reason.SNAPSHOT_REFUSED,
                    Severity.WARNING,
                    f"{info.path} refused: step {info.step} was flagged after it was taken ({why}); "
                    "never restored from, the next tier is tried",
                    step=info.step,
                    tier="node",
                    file=info.path.name,
                )
                continue
            out[info.step] = info.path
        return out
