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
- written by another world size for a sharded (FSDP2) model: re-sharded (reshard.py). Each
  snapshot holds one old rank's shard and where it lies in the whole tensor (the layout that
  `ShardingMarker` records); every rank reads every old rank's snapshot of the step and keeps
  the part of each tensor its own shard covers, bitwise. Its RNG state, data position and
  non-tensor state are old rank r % old_world's, as under DDP. Refused where the state does
  not allow it: not every old rank's shard of the newest step is in the directory (a shard
  written to a disk this rank cannot read), the snapshot holds no layout (written before one
  was recorded), or a parameter's placement is not a set of boxes (Partial, the strided shards
  of FSDP2 with tensor parallelism). `WorldSizeChanged` (a SnapshotError) then names both
  world sizes and why, with a `snapshot_refused` finding, at attach.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mscale.snapshot.format import (
    RANK_DIR,
    STEP_DIR,
    TRAIN_STATE,
    SnapshotError,
    SnapshotInfo,
    list_snapshots,
    rank_dir_name,
    read_train_state,
)
from mscale.snapshot.ownership import dir_refused
from mscale.snapshot.values import JSONObject, StateDict, as_dict, as_int

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine
    from mscale.snapshot.tensors import Tensors

__all__ = ["Candidate", "WorldSizeChanged", "candidates", "per_rank", "rank_dir", "resplit"]


class WorldSizeChanged(SnapshotError):
    """The newest snapshot was written by another world size and cannot be resumed on this one."""


@dataclass(frozen=True)
class Candidate:
    step: int
    path: Path  # the snapshot this rank resumes
    world_size: int  # the world size that wrote it
    shards: dict[int, Path] = field(default_factory=dict)  # another world's: every old rank's of the step held


def per_rank(directory: Path) -> bool:
    """Whether `directory` holds rank directories of this uid (another user's do not count:
    ownership.py)."""
    return directory.is_dir() and any(RANK_DIR.match(p.name) and not dir_refused(p) for p in directory.iterdir())


def rank_dir(directory: Path, rank: int, world_size: int) -> Path:
    """Where this rank writes (see the module docstring)."""
    if world_size > 1 or per_rank(directory):
        return directory / rank_dir_name(rank)
    return directory


def adopt_single(directory: Path) -> None:
    """Rank 0 of several, before anyone lists: a single rank's `step_*` moves into `rank_00000/`."""
    if not directory.is_dir():
        return
    steps = [p for p in directory.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    if not steps:
        return
    target = directory / rank_dir_name(0)
    target.mkdir(mode=0o700, exist_ok=True)
    if dir_refused(target):  # another user's: nothing moves into it (capture.py refuses the disk tier)
        return
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
        world = info.manifest["world_size"] or 1
        by_step.setdefault(info.step, {})[info.manifest["rank"] or 0] = (info.path, world)
    out: dict[int, Candidate] = {}
    for step, ranks in by_step.items():
        worlds = {w for _, w in ranks.values()}
        if len(worlds) != 1:
            continue  # two worlds wrote this step: neither is whole beside the other
        (world,) = worlds
        source = rank if world == world_size else rank % world  # a missing one: not this rank's to resume
        if source in ranks:
            shards = {r: p for r, (p, _) in sorted(ranks.items())} if world != world_size else {}
            out[step] = Candidate(step, ranks[source][0], world, shards)
    for step, path in broken.items():
        out.setdefault(step, Candidate(step, path, world_size))
    return out


def resplit(state: JSONObject | None, rank: int, world_size: int, old_world: int) -> JSONObject | None:
    """A data position written by `old_world` ranks, for `rank` of `world_size` (the module
    docstring says what each loader keeps)."""
    if not isinstance(state, dict) or state.get("kind") not in ("resumable_loader", "file_stream"):
        return state
    out = {**state, "rank": rank, "world_size": world_size, "skip": [], "last_batch_position": None}
    if state["kind"] == "resumable_loader":
        out["index"] = as_int(state["index"], "index") * old_world // world_size
    return out


def plan(
    engine: SnapshotEngine, keep: Callable[[list[SnapshotInfo]], list[SnapshotInfo]] | None = None
) -> dict[int, Candidate]:
    """The steps `engine` (a SnapshotEngine with a directory) may resume, agreed across its ranks
    (collective with several); raises WorldSizeChanged, with a finding, where the newest was
    written by another world size and this job's state cannot take it (sharded, and not
    re-shardable: `unshardable`). Older steps that cannot be re-sharded are left out."""
    import mscale.snapshot.distributed as mdist  # torch: job side only
    from mscale.findings import Reason, Severity

    assert engine.directory is not None and engine.rank_dir is not None  # (with a directory)
    several = engine.world_size > 1
    if several:
        mdist.any_flag(False, engine.group)  # rank 0 moved a single rank's snapshots (adopt_single) first
    found = candidates(engine.directory, engine.rank, engine.world_size, engine.rank_dir, keep)
    steps = mdist.common_steps(sorted(found), engine.group) if several else sorted(found, reverse=True)
    if "sharding" not in engine.extra:
        return {s: found[s] for s in steps}
    out: dict[int, Candidate] = {}
    for i, step in enumerate(steps):  # the same files on every rank: the same answer on every rank
        why = unshardable(found[step]) if found[step].world_size != engine.world_size else None
        if why is None:
            out[step] = found[step]
            continue
        if i > 0:
            continue
        old = found[step].world_size
        message = (
            f"the newest snapshot (step {step}) was written by {old} rank(s), this job runs "
            f"{engine.world_size}: each holds one rank's shard of a sharded (FSDP2) model, and {why}, so it "
            f"cannot be re-sharded. Restart on {old} rank(s), or give an empty directory"
        )
        labels = {"step": step, "world_size_then": old, "world_size_now": engine.world_size}
        engine.emit(Reason.SNAPSHOT_REFUSED, Severity.CRITICAL, message, **labels)
        raise WorldSizeChanged(message)
    return out


def unshardable(found: Candidate) -> str | None:
    """Why another world's sharded snapshot cannot be re-sharded (the module docstring), or None."""
    if sorted(found.shards) != list(range(found.world_size)):
        return f"only the shards of rank(s) {sorted(found.shards)} are in the directory"
    try:
        objects = read_train_state(found.shards[0] / TRAIN_STATE)
    except SnapshotError as e:
        return f"rank 0's train state is unreadable ({e})"
    marker = as_dict(objects.get("extra") or {}, "the extras' state").get("sharding")
    if not isinstance(marker, dict):
        return "it does not say how it was sharded"
    layout = marker.get("layout")
    if not layout:
        return "it records no shard layout (written before mscale recorded one)"
    odd = sorted(fqn for fqn, box in layout.items() if "unsupported" in box)
    if odd:
        return f"{odd[0]} is placed {layout[odd[0]]['unsupported']}, which is not one box per rank"
    return None


def reader(engine: SnapshotEngine, found: dict[int, Candidate]) -> Callable[[int], tuple[Tensors, StateDict] | None]:
    """For load_newest_valid: another world's sharded snapshot re-sharded for this rank
    (reshard.read); None for the others (read as they are)."""

    def read(step: int) -> tuple[Tensors, StateDict] | None:
        if found[step].world_size == engine.world_size or "sharding" not in engine.extra:
            return None
        from mscale.snapshot.reshard import read as reshard  # torch: job side only

        return reshard(engine, found[step])

    return read


def note(found: Candidate, world_size: int, sharded: bool = False) -> str:
    if found.world_size == world_size:
        return ""
    shards = ", shards re-sharded" if sharded else ""
    return f", written by {found.world_size} rank(s), resumed on {world_size}: data positions re-split{shards}"


def fit(engine: SnapshotEngine, step: int, objects: JSONObject, found: dict[int, Candidate]) -> JSONObject:
    """The loaded objects of `step`, the data position re-split when another world wrote it."""
    old = found[step].world_size
    if old == engine.world_size:
        return objects
    data = objects.get("data")
    objects["data"] = resplit(data if isinstance(data, dict) else None, engine.rank, engine.world_size, old)
    return objects
