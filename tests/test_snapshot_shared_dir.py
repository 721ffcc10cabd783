"""Issue 25 item 8: in a shared snapshot directory the engine lists, resumes and prunes only the
snapshots its run wrote (a real directory of its uid, its job id in the manifest). Another
user's snapshot, planted as a directory, a symbolic link or hard links to their own files, is
refused with a finding and never loaded or removed. The planting is done by a real second
user (setpriv), in a sticky world-writable root like /tmp."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from mscale.findings import Reason
from support import require_tool
from support.tiny_snapshot_job import job, train
from support.users import second_uid

VICTIM = "team-a/run-1"


@pytest.fixture
def other() -> tuple[int, int]:
    return second_uid()


@pytest.fixture
def shared_root():
    """A shared snapshot root: root-owned, sticky, world-writable."""
    tmp = tempfile.mkdtemp(prefix="mscale-shared-snap-")
    os.chmod(tmp, 0o1777)
    yield Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def as_other(other: tuple[int, int], script: str, *args: str) -> None:
    setpriv = require_tool("setpriv")
    cmd = [setpriv, f"--reuid={other[0]}", f"--regid={other[1]}", "--clear-groups", "sh", "-ec", script, "sh", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def their_snapshot(other: tuple[int, int], job_id: str) -> Path:
    """A complete, valid snapshot of another run at step 50 (written here, then handed to the
    other user as theirs), in a directory of theirs the victim can read."""
    home = Path(tempfile.mkdtemp(prefix="mscale-theirs-"))
    model, opt, engine = job(home, seed=7, job_id=job_id, disk_every=50)
    train(model, opt, engine, 1, 50)
    engine.close()
    for p in [home, *home.rglob("*")]:
        os.lchown(p, *other)
    os.chmod(home, 0o755)
    return home / "step_00000050"


PLANT = {
    "directory": 'cp -a "$1" "$2/step_00000050"',
    "symlink": 'ln -s "$1" "$2/step_00000050"',
    "hardlinks": 'mkdir "$2/step_00000050"; for f in "$1"/*; do ln "$f" "$2/step_00000050/"; done',
}


@pytest.mark.parametrize("how", sorted(PLANT))
@pytest.mark.parametrize("their_job", [VICTIM, "other-run"], ids=["forged_job_id", "their_job_id"])
def test_another_users_planted_snapshot_is_not_resumed(other, shared_root: Path, how: str, their_job: str) -> None:
    model, opt, engine = job(shared_root, job_id=VICTIM)
    train(model, opt, engine, 1, 10)
    engine.close()
    at10 = {k: v.clone() for k, v in model.state_dict().items()}
    theirs = their_snapshot(other, their_job)
    try:
        as_other(other, PLANT[how], str(theirs), str(shared_root))
        model, opt, engine = job(shared_root, seed=3, job_id=VICTIM)
        try:
            assert engine.resume() == 10
            assert all(torch.equal(v, at10[k]) for k, v in model.state_dict().items())
            refused = [f for f in engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
            assert len(refused) == 1 and refused[0].labels["file"] == "step_00000050", [f.message for f in refused]
            why = "a symbolic link" if how == "symlink" else f"owned by uid {other[0]}"
            assert why in refused[0].message, refused[0].message
        finally:
            engine.close()
    finally:
        shutil.rmtree(theirs.parent, ignore_errors=True)


def test_a_snapshot_of_another_run_by_the_same_user_is_not_resumed(tmp_path: Path) -> None:
    model, opt, engine = job(tmp_path, seed=7, job_id="other-run", disk_every=50)
    train(model, opt, engine, 1, 50)
    engine.close()
    model, opt, engine = job(tmp_path, job_id=VICTIM)
    try:
        assert engine.resume() is None
        refused = [f.message for f in engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
        assert any("a snapshot of job 'other-run', not of this one ('team-a/run-1')" in m for m in refused), refused
    finally:
        engine.close()


def test_a_planted_low_step_does_not_stop_pruning(other, shared_root: Path) -> None:
    # the case: a step_00000001 of another user made every prune fail; the victim kept
    # 8 snapshots with disk_keep=3, more with every write
    theirs = their_snapshot(other, VICTIM)
    try:
        as_other(other, 'cp -a "$1" "$2/step_00000001"', str(theirs), str(shared_root))
        model, opt, engine = job(shared_root, job_id=VICTIM, disk_keep=3)
        for first in range(1, 80, 10):  # each write flushed: 8 written
            train(model, opt, engine, first, first + 9)
        engine.close()
        names = sorted(p.name for p in shared_root.iterdir())
        assert names == ["step_00000001", "step_00000060", "step_00000070", "step_00000080"], names
        assert (shared_root / "step_00000001").stat().st_uid == other[0]  # theirs, left alone
        refused = [f for f in engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
        assert len(refused) == 1 and refused[0].labels["file"] == "step_00000001"  # once, not per prune
    finally:
        shutil.rmtree(theirs.parent, ignore_errors=True)


def resumed_step(root: Path, **settings) -> tuple[int | None, list]:
    _, _, engine = job(root, job_id=VICTIM, **settings)
    try:
        return engine.resume(), list(engine.findings)
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["0755", "0777"])
@pytest.mark.parametrize("name", ["rank_00007", "rank_00000"])
def test_another_users_rank_directory_is_never_written_listed_or_resumed(
    other, shared_root: Path, name: str, mode: str
) -> None:
    """Issue 38 item 7: a rank directory planted by another user made a single rank resume
    nothing (rank_00007), write its snapshots where that user could rename them (rank_00000,
    0777) or fail every write (0755). It is not this run's layout: the run's own top-level
    snapshots stay visible and new ones go beside them."""
    model, opt, engine = job(shared_root, job_id=VICTIM)
    train(model, opt, engine, 1, 20)
    engine.close()
    as_other(other, f'mkdir -m {mode} "$1/{name}"', str(shared_root))
    model, opt, engine = job(shared_root, job_id=VICTIM)
    try:
        assert engine.resume() == 20
        train(model, opt, engine, 21, 30)
        assert list((shared_root / name).iterdir()) == []  # never written into
        assert (shared_root / "step_00000030").stat().st_uid == os.geteuid()
        assert not [f for f in engine.findings if f.reason is Reason.SNAPSHOT_FAILED]
        refused = [f.message for f in engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
        assert any(name in m and f"owned by uid {other[0]}" in m for m in refused), refused
    finally:
        engine.close()


def test_another_users_snapshot_inside_their_rank_directory_is_refused(other, shared_root: Path) -> None:
    """A step directory of this uid's run inside another user's rank directory (which its owner
    could swap at will) is refused with a finding naming that directory, not resumed."""
    as_other(other, 'mkdir -m 0777 "$1/rank_00000"', str(shared_root))
    home = Path(tempfile.mkdtemp(prefix="mscale-own-"))
    try:
        model, opt, engine = job(home, job_id=VICTIM)
        train(model, opt, engine, 1, 10)
        engine.close()
        shutil.copytree(home / "step_00000010", shared_root / "rank_00000" / "step_00000010")
        step, findings = resumed_step(shared_root)
        assert step is None
        refused = [f for f in findings if f.reason is Reason.SNAPSHOT_REFUSED]
        assert any("in rank directory rank_00000, which is owned by uid" in f.message for f in refused), refused
    finally:
        shutil.rmtree(home, ignore_errors=True)
