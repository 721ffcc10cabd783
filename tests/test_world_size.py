"""A job restarted on another world size, with the README's protection line on the tiny LLaVA
(gloo ranks forked by tests/support/world_job.py): under DDP it resumes at the snapshot's step
with the weights bitwise those the old world saved, its data positions re-split; under FSDP2 its
shards are re-sharded (the weights and optimizer state bitwise those saved), and a restart the
directory cannot re-shard (an old rank's shards missing) is refused with a finding naming both
world sizes. The directory never holds snapshots that
resume, listing or pruning cannot see (`step_*` beside `rank_*`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from mscale.snapshot.format import STEP_DIR, list_snapshots
from support import REPO, free_port
from support.ddp_run import run_group

EVERY = 4  # a disk snapshot every 4 steps: steps 0, 4, 8
FIRST, SECOND = 9, 11  # steps run by the first job (0-8), then up to 11 after the restart
LONGER = 17  # ... or up to 17: disk snapshots 12 and 16 after the restart, so pruning runs


def run(tmp: Path, name: str, *, world: int, steps: int, directory: Path, wrap: str = "ddp") -> list[dict]:
    out = tmp / name
    out.mkdir()
    argv = [sys.executable, "tests/support/world_job.py", "--world", str(world), "--port", str(free_port())]
    argv += ["--out", str(out), "--dir", str(directory), "--steps", str(steps), "--every", str(EVERY)]
    argv += ["--wrap", wrap]
    log = tmp / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    code = run_group(argv, log, env=env)
    assert code == 0, log.read_text()[-3000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


def visible(directory: Path) -> None:
    """Every step_ directory under `directory` is one list_snapshots (resume, prune, the CLI) sees."""
    on_disk = {p for p in directory.rglob("step_*") if p.is_dir() and STEP_DIR.match(p.name)}
    assert on_disk == {i.path for i in list_snapshots(directory)}
    assert not [p for p in on_disk if p.parent == directory and any(directory.glob("rank_*"))]


def restart(tmp_path: Path, before: int, after: int, steps: int = SECOND) -> None:
    directory = tmp_path / "snaps"
    first = run(tmp_path, "first", world=before, steps=FIRST, directory=directory)
    second = run(tmp_path, "second", world=after, steps=steps, directory=directory)
    saved = first[0]["hashes"]["8"]
    assert all(r["hashes"]["8"] == saved for r in first)  # the old world's replicas were equal
    for r in second:
        assert "error" not in r, r
        assert r["start"] == 9  # the snapshot of step 8, not step 0
        assert r["start_hash"] == saved  # bitwise the weights the old world saved
        assert any(f"written by {before} rank(s), resumed on {after}" in m for m in r["resumed"]), r["resumed"]
    # data positions re-split: the old ranks had consumed 9 batches of 2 samples each
    assert [r["index"] for r in second] == [9 * 2 * before // after] * after
    for step in ("9", "10"):  # the new world's replicas stay equal
        assert len({r["hashes"][step] for r in second}) == 1
    visible(directory)


def test_ddp_restart_on_2_ranks_after_1(tmp_path: Path) -> None:
    restart(tmp_path, 1, 2)


def test_ddp_restart_on_1_rank_after_2(tmp_path: Path) -> None:
    restart(tmp_path, 2, 1, steps=LONGER)
    # the single rank kept the directory's per-rank layout: later restarts see what it wrote
    assert [i.step for i in list_snapshots(tmp_path / "snaps" / "rank_00000")] == [12, 16]  # disk_keep=2
    assert not list(tmp_path.joinpath("snaps").glob("step_*"))
    # old rank 1's snapshots, older than every one the new world keeps, were pruned by rank 0
    assert not list_snapshots(tmp_path / "snaps" / "rank_00001")


@pytest.mark.slow
def test_ddp_restart_on_4_ranks_after_2(tmp_path: Path) -> None:
    restart(tmp_path, 2, 4)


@pytest.mark.slow
def test_fsdp2_restart_on_1_rank_after_2_reshards_and_is_refused_without_every_shard(tmp_path: Path) -> None:
    directory = tmp_path / "snaps"
    first = run(tmp_path, "first", world=2, steps=FIRST, directory=directory, wrap="fsdp")
    # a copy without old rank 1's shards (written to a disk this job cannot read): refused
    lost = tmp_path / "lost"
    shutil.copytree(directory, lost)
    shutil.rmtree(lost / "rank_00001")
    (second,) = run(tmp_path, "second", world=1, steps=SECOND, directory=directory, wrap="fsdp")
    assert "error" not in second, second
    assert second["start"] == 9  # the snapshot of step 8, re-sharded onto one rank
    assert second["start_hash"] == first[0]["hashes"]["8"]  # bitwise the weights the old world saved
    assert second["start_optimizer_hash"] == first[0]["optimizer_hashes"]["8"]  # and its optimizer state
    assert any("written by 2 rank(s), resumed on 1" in m and "shards re-sharded" in m for m in second["resumed"])
    assert second["index"] == 9 * 2 * 2 // 1  # data positions re-split as under DDP
    visible(directory)
    (refused,) = run(tmp_path, "refused", world=1, steps=SECOND, directory=lost, wrap="fsdp")
    assert refused["error"].startswith("WorldSizeChanged: the newest snapshot (step 8) was written by 2 rank(s)")
    assert "this job runs 1" in refused["error"] and "only the shards of rank(s) [0]" in refused["error"]


@pytest.mark.slow
def test_fsdp2_restart_on_2_ranks_after_1_reshards(tmp_path: Path) -> None:
    directory = tmp_path / "snaps"
    (first,) = run(tmp_path, "first", world=1, steps=FIRST, directory=directory, wrap="fsdp")
    second = run(tmp_path, "second", world=2, steps=SECOND, directory=directory, wrap="fsdp")
    for r in second:  # each new rank took its half of the one old shard
        assert "error" not in r, r
        assert r["start"] == 9
        assert r["start_hash"] == first["hashes"]["8"]
        assert r["start_optimizer_hash"] == first["optimizer_hashes"]["8"]
    visible(directory)


def test_old_shards_land_bitwise_in_the_new_ranks_boxes_and_a_missing_one_is_named(tmp_path: Path) -> None:
    """Fast: the re-sharding copy (mscale/snapshot/reshard.py) from 2 row shards into 3, and
    why a step without every old rank's shard cannot be re-sharded."""
    import torch

    from mscale.snapshot.reshard import _overlap
    from mscale.snapshot.worlds import Candidate, unshardable

    whole = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    old = [(whole[:5], [0, 0]), (whole[5:], [5, 0])]  # torch.chunk over 2 ranks, as FSDP2 shards
    at = 0
    for new in torch.chunk(whole, 3):  # rows 0-3, 4-7, 8-9
        dst = torch.full_like(new, float("nan"))
        written = sum(_overlap(src, src_at, dst, [at, 0]) for src, src_at in old)
        assert written == new.numel() and torch.equal(dst, new)
        at += new.shape[0]
    lost = Candidate(8, tmp_path / "rank_00000" / "step_00000008", 2, {0: tmp_path / "rank_00000" / "step_00000008"})
    assert unshardable(lost) == "only the shards of rank(s) [0] are in the directory"


def test_a_layout_whose_boxes_overlap_or_leave_a_gap_is_refused() -> None:
    """Issue 38 item 8: every box of rank 1 planted at rank 0's offset (the manifest re-hashed)
    counted each of rank 0's elements twice and left rank 1's rows unwritten; the boxes must tile."""
    from mscale.snapshot.reshard import tiling_error

    shape = [10, 3]
    assert tiling_error(shape, {0: ([0, 0], [5, 3]), 1: ([5, 0], [5, 3])}) == ""
    assert tiling_error(shape, {0: ([0, 0], [5, 3]), 1: ([5, 0], [5, 3]), 2: ([10, 0], [0, 3])}) == ""  # an empty shard
    # the plant: rank 1's box at rank 0's offset (the volumes add up to the whole)
    assert tiling_error(shape, {0: ([0, 0], [5, 3]), 1: ([0, 0], [5, 3])}) == "the boxes of ranks 0 and 1 overlap"
    assert tiling_error(shape, {0: ([0, 0], [6, 3]), 1: ([4, 0], [4, 3])}) == "the boxes of ranks 0 and 1 overlap"
    assert (
        tiling_error(shape, {0: ([0, 0], [5, 3]), 1: ([6, 0], [4, 3])})
        == "the boxes hold 27 elements, the [10, 3] tensor 30"
    )
    assert "outside" in tiling_error(shape, {0: ([0, 0], [5, 3]), 1: ([7, 0], [5, 3])})
