"""Which snapshots in a directory this engine wrote: only those are listed, resumed and pruned.

In a shared snapshot root another user can plant a complete, valid snapshot of another run at
a higher step (a real directory, a symbolic link to one, hard links to their own files), and a
resume would load it: the victim's weights replaced by the other run's. A planted lower step
makes pruning fail (another user's directory cannot be renamed away in a sticky directory),
so old snapshots pile up. So a snapshot is this engine's only when its step directory is a
real directory (not a link) owned by this process's uid, inside a rank directory (when it is in
one) that is too, and its manifest names this run's job id (the run identity every manifest
carries). Any other is refused with a `snapshot_refused` finding (once per directory) and never
read, resumed or removed.

A rank directory (`rank_00003`) another user made in the shared root is never written to: its
owner could rename the snapshots written there, or make every write fail. Such a directory does
not count as the root's per-rank layout (a single rank keeps writing `step_*` at the top), and a
rank whose own rank directory is another user's refuses the disk tier (capture.py).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from mscale.findings import Reason, Severity
from mscale.snapshot.format import RANK_DIR, SnapshotInfo
from mscale.snapshot.manifest import Manifest

__all__ = ["Ownership", "dir_refused"]

MAX_REPORTED = 1024  # directories reported once each, at most: a flood of plants stays bounded


def dir_refused(path: Path, uid: int | None = None) -> str:
    """'' when `path` is a real directory (not a link) owned by `uid` (this process's), else why not."""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not a directory this run made"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not this process's uid {uid}"
    return ""


class Ownership:
    """The run identity of one engine (its job id and uid) and the test of a snapshot's."""

    def __init__(self, job_id: str, emit: Callable[..., object]) -> None:
        self.job_id, self.uid, self._emit = job_id, os.geteuid(), emit
        self._reported: set[Path] = set()

    def why_not(self, path: Path, manifest: Manifest | None) -> str:
        """'' when this engine's run wrote the snapshot at `path`, else why not."""
        why = dir_refused(path, self.uid)
        if why:
            return why.replace("this run made", "this run wrote")
        if RANK_DIR.match(path.parent.name) and (why := dir_refused(path.parent, self.uid)):
            return f"in rank directory {path.parent.name}, which is {why}"
        if manifest is not None and manifest.get("job_id", "") != self.job_id:
            return f"a snapshot of job {str(manifest.get('job_id'))[:64]!r}, not of this one ({self.job_id!r})"
        return ""

    def mine(self, infos: Iterable[SnapshotInfo]) -> list[SnapshotInfo]:
        """The snapshots of `infos` this engine wrote; each other one a finding, once."""
        out = []
        for info in infos:
            why = self.why_not(info.path, info.manifest)
            if not why:
                out.append(info)
            elif info.path not in self._reported and len(self._reported) < MAX_REPORTED:
                self._reported.add(info.path)
                self._emit(
                    Reason.SNAPSHOT_REFUSED,
                    Severity.WARNING,
                    f"{info.path} is {why}: not listed, resumed or pruned by this run",
                    step=info.step,
                    file=info.path.name,
                )
        return out

    def owns_dir(self, path: Path) -> bool:
        """Whether `path` is a real directory of this uid (a leftover this engine may remove)."""
        return not dir_refused(path, self.uid)
