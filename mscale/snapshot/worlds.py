"""Snapshot directories across world sizes: a job restarted on fewer or more ranks.

Layout. One rank alone writes `step_*` in the directory itself; several ranks write
`rank_NNNNN/step_*`. A directory keeps the layout it has once it holds rank directories: a
single rank then writes `rank_00000/`, never `step_*` beside `rank_*` (which listing, resume
and pruning, all looking in the rank directories, would not see). When several ranks first use
a single-rank directory, rank 0 moves its `step_*` into `rank_00000/` before anyone lists it.

Resume. The candidates are every complete snapshot in the directory, by step:
- written by the current world size: each rank resumes its own, as always (bitwise);
- written by another world size under DDP (replicated weights and optimizer state): rank r
  resumes old rank r % old_world's snapshot. The weights and optimizer state are the same on
  every old rank; the RNG state is that old rank's. A `ResumableLoader`'s position is re-split:
  the old ranks had consumed the first `index * old_world` samples of the epoch's permutation,
  so each new rank starts at `index * old_world // new_world` of its own share; with the
  division exact the remaining samples are exactly those not yet seen (in the same global
  order, dealt to a different number of ranks), otherwise up to `new_world - 1` samples are seen
  twice. Batches marked to be skipped are dropped (their positions are the old split's). A
  `ResumableFileStream` keeps old rank r % old_world's byte offset, with records dealt anew:
  up to one batch per old rank is seen twice or skipped. Other loaders' states are loaded as
  they are (their own `load_state_dict` decides);
- written by another world size for a sharded (FSDP2) model: refused. Each snapshot holds one
  rank's shard; re-sharding it is not done here. `WorldSizeChanged` (a SnapshotError) names both
  world sizes, with a `snapshot_refused` finding, at attach: restart on the old world size, or
  export and reload through torch.distributed.checkpoint (`mscale snapshot export --format dcp`
  covers DDP snapshots).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mscale.snapshot.format import RANK_DIR, STEP_DIR, SnapshotError, SnapshotInfo, list_snapshots

__all__ = ["Candidate", "WorldSizeChanged", "candidates", "per_rank", "rank_dir", "resplit"]


class WorldSizeChanged(SnapshotError):
    """The newest snapshot was written by another world size and cannot be resumed on this one."""


@dataclass(frozen=True)
class Candidate:
    step: int
    path: Path  # the snapshot this rank resumes
    world_size: int  # the world size that wrote it


def per_rank(directory: Path) -> bool:
    return directory.is_dir() and any(p.is_dir() and RANK_DIR.match(p.name) for p in directory.iterdir())


def rank_dir(directory: Path, rank: int, world_size: int) -> Path:
    """Where this rank writes (see the module docstring)."""
    if world_size > 1 or per_rank(directory):
        return directory / f"rank_{rank:05d}"
    return directory


def adopt_single(directory: Path) -> None:
    """Rank 0 of several, before anyone lists: a single rank's `step_*` moves into `rank_00000/`."""
    if not directory.is_dir():
        return
    steps = [p for p in directory.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    if not steps:
        return
    target = directory / "rank_00000"
    target.mkdir(exist_ok=True)
    for p in steps:
        if (target / p.name).exists():  # the same step from the other layout: keep the per-rank one
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.rename(p, target / p.name)


def candidates(
    directory: Path,
    rank: int,
    world_size: int,
    own: Path | None = None,
    keep: Callable[[list[SnapshotInfo]], list[SnapshotInfo]] | None = None,
) -> dict[int, Candidate]:
    """step -> what this rank would resume at that step, for every step some world wrote whole
    (of the listed snapshots `keep` keeps: this run's own, mscale.snapshot.ownership).
    A step directory in this rank's own directory (`own`) counts even with a bad manifest: it
    exists only after the rename, so it is corruption to report (the load refuses it), not an
    interrupted write."""
    by_step: dict[int, dict[int, tuple[Path, int]]] = {}
    broken: dict[int, Path] = {}
    infos = list_snapshots(directory)
    for info in keep(infos) if keep is not None else infos:
        if info.manifest is None:
            if info.path.parent == own and info.step >= 0:
                broken[info.step] = info.path
            continue
        world = int(info.manifest.get("world_size") or 1)
        by_step.setdefault(info.step, {})[int(info.manifest.get("rank") or 0)] = (info.path, world)
    out: dict[int, Candidate] = {}
    for step, ranks in by_step.items():
        worlds = {w for _, w in ranks.values()}
        if len(worlds) != 1:
            continue  # two worlds wrote this step: neither is whole beside the other
        (world,) = worlds
        source = rank if world == world_size else rank % world  # a missing one: not this rank's to resume
        if source in ranks:
            out[step] = Candidate(step, ranks[source][0], world)
    for step, path in broken.items():
        out.setdefault(step, Candidate(step, path, world_size))
    return out


def resplit(state: dict | None, rank: int, world_size: int, old_world: int) -> dict | None:
    """A data position written by `old_world` ranks, for `rank` of `world_size` (the module
    docstring says what each loader keeps)."""
    if not isinstance(state, dict) or state.get("kind") not in ("resumable_loader", "file_stream"):
        return state
    out = {**state, "rank": rank, "world_size": world_size, "skip": [], "last_batch_position": None}
    if state["kind"] == "resumable_loader":
        out["index"] = int(state["index"]) * old_world // world_size
    return out


def plan(engine, keep: Callable[[list[SnapshotInfo]], list[SnapshotInfo]] | None = None) -> dict[int, Candidate]:
    """The steps `engine` (a SnapshotEngine with a directory) may resume, agreed across its ranks
    (collective with several); raises WorldSizeChanged, with a finding, where the newest was
    written by another world size and this job's state cannot take it (FSDP2 shards)."""
    import mscale.snapshot.distributed as mdist  # torch: job side only
    from mscale.findings import Reason, Severity

    several = engine.world_size > 1
    if several:
        mdist.any_flag(False, engine.group)  # rank 0 moved a single rank's snapshots (adopt_single) first
    found = candidates(engine.directory, engine.rank, engine.world_size, engine.rank_dir, keep)
    steps = mdist.common_steps(sorted(found), engine.group) if several else sorted(found, reverse=True)
    if steps and found[steps[0]].world_size != engine.world_size and "sharding" in engine.extra:
        old = found[steps[0]].world_size
        message = (
            f"the newest snapshot (step {steps[0]}) was written by {old} rank(s), this job runs "
            f"{engine.world_size}: each holds one rank's shard of a sharded (FSDP2) model, which is not "
            f"re-sharded here. Restart on {old} rank(s), or give an empty directory"
        )
        labels = {"step": steps[0], "world_size_then": old, "world_size_now": engine.world_size}
        engine._emit(Reason.SNAPSHOT_REFUSED, Severity.CRITICAL, message, **labels)
        raise WorldSizeChanged(message)
    return {s: found[s] for s in steps}


def note(found: Candidate, world_size: int) -> str:
    if found.world_size == world_size:
        return ""
    return f", written by {found.world_size} rank(s), resumed on {world_size}: data positions re-split"


def fit(engine, step: int, objects: dict, found: dict[int, Candidate]) -> dict:
    """The loaded objects of `step`, the data position re-split when another world wrote it."""
    old = found[step].world_size
    if old == engine.world_size:
        return objects
    objects["data"] = resplit(objects.get("data"), engine.rank, engine.world_size, old)
    return objects
