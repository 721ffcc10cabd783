"""Issue 39, the node tier: snapshots in the node's shared memory (a per-test root under
/dev/shm, conftest.py), written by their own writer thread in the disk tier's format, private
to the job's uid and keyed by job id and directory; a resume takes the newest valid step of
either tier (the node's first), and a node-tier snapshot that is corrupt, truncated, of a
flagged step or of another job is refused with a finding naming why, and the disk tier used."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from mscale.findings import Reason
from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.format import list_snapshots, mpu_file
from mscale.snapshot.node_tier import node_job_dir
from support.tiny_snapshot_job import job, train

JOB = "team-a/run-7"


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": t.detach().clone() for k, t in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reasons(engine, reason: Reason) -> list[str]:
    return [f.message for f in engine.findings if f.reason is reason]


def trained(tmp_path: Path, last: int = 7, **settings):
    """A job trained to `last`: disk snapshots at 4, node-tier ones at every step (the newest
    `node_keep`, default 1 here). Returns the directory, the state at `last` and the random
    draw that would follow it."""
    settings = {"disk_every": 4, "memory_every": 1, "node_every": 1, "node_keep": 1, **settings}
    model, opt, engine = job(tmp_path / "snaps", job_id=JOB, **settings)
    train(model, opt, engine, 1, last)
    at_last, draw = state(model, opt), torch.rand(3)
    engine.close()
    return tmp_path / "snaps", at_last, draw


def resumed(directory: Path, job_id: str = JOB, **settings):
    settings = {"disk_every": 4, "memory_every": 1, "node_every": 1, "node_keep": 1, **settings}
    model, opt, engine = job(directory, seed=99, job_id=job_id, **settings)  # other weights until the resume
    step = engine.resume()
    return step, state(model, opt), engine


def node_dir(directory: Path, node_root: str) -> Path:
    return node_job_dir(node_root, JOB, directory) / "rank_00000"


def test_node_tier_is_on_by_default_private_keyed_and_keeps_the_newest(tmp_path, node_root):
    model, opt, engine = job(tmp_path / "snaps", job_id=JOB, memory_every=4, disk_every=100, node_every=None)
    train(model, opt, engine, 1, 31)
    engine.close()
    on = reasons(engine, Reason.SNAPSHOT_TIER)
    assert len(on) == 1 and "node snapshot tier on: every 12 steps, the newest 2 kept" in on[0]
    rank_dir = node_dir(tmp_path / "snaps", node_root)
    kept = [i.step for i in list_snapshots(rank_dir)]  # node_keep=2 of 12, 24 (every 12: memory_every=4)
    assert kept[-1] == 24 and len(kept) <= 2 and set(kept) <= {12, 24}
    assert list_snapshots(tmp_path / "snaps") == []  # nothing due on disk yet
    for p in [rank_dir.parent.parent, rank_dir.parent, rank_dir, *rank_dir.rglob("*")]:
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
        assert os.lstat(p).st_uid == os.geteuid()
    # another job id, or the same id on another directory, never shares it
    assert node_job_dir(node_root, "team-a/run-8", tmp_path / "snaps") != rank_dir.parent
    assert node_job_dir(node_root, JOB, tmp_path / "other") != rank_dir.parent


def test_node_tier_is_off_with_the_reason_where_there_is_no_room_or_the_directory_is_another_uids(
    tmp_path, node_root, monkeypatch
):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10**12))  # as many ranks on this node as would never fit
    _, _, engine = job(tmp_path / "a", job_id=JOB, memory_every=2, node_every=None)
    engine.close()
    (off,) = reasons(engine, Reason.SNAPSHOT_TIER)
    assert off.startswith("node snapshot tier off:") and "has no room for 3 snapshots of each rank here" in off
    assert engine.node is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    theirs = node_job_dir(node_root, JOB, tmp_path / "b").parent
    theirs.mkdir(mode=0o700, exist_ok=True)  # (the first job made it)
    os.chown(theirs, 4242, 4242)  # another uid made this uid's node directory first
    _, _, engine = job(tmp_path / "b", job_id=JOB, memory_every=2, node_every=None)
    engine.close()
    (off,) = reasons(engine, Reason.SNAPSHOT_TIER)
    assert off.startswith(f"node snapshot tier off: {theirs} is owned by uid 4242") and engine.node is None


def test_resume_takes_the_node_tiers_newer_step_bitwise(tmp_path, node_root):
    directory, at7, draw = trained(tmp_path)
    assert max(i.step for i in list_snapshots(directory)) == 4  # the disk's newest is older
    step, got, engine = resumed(directory)
    assert step == 7 and same(got, at7)
    assert torch.equal(torch.rand(3), draw)  # the RNG continues where it was
    (msg,) = reasons(engine, Reason.SNAPSHOT_RESUMED)
    assert "(node tier, step 7)" in msg and engine.recovery_seconds.keys() == {"node"}
    assert engine.memory_steps == [7]  # a rollback target at once
    engine.close()


def flip_bits(path: Path) -> None:
    f = path / mpu_file("001", "vision")
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10
    f.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    f = path / mpu_file("002", "text")
    f.write_bytes(f.read_bytes()[:-4])


def other_job(path: Path) -> None:
    """Another job's snapshot of the same step put where this job's was (a same-named file copy)."""
    elsewhere = path.parent.parent.parent / "elsewhere"
    model, opt, engine = job(elsewhere, seed=5, job_id="team-b/run-1", disk_every=7, node_every=0)
    train(model, opt, engine, 1, 7)
    engine.close()
    shutil.rmtree(path)
    shutil.copytree(elsewhere / path.name, path)


CASES = {
    "flipped bits": (flip_bits, "BLAKE3", "vision"),
    "truncated": (truncate, "partial or altered", "text"),
    "another job": (other_job, "of job 'team-b/run-1'", ""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_node_tier_snapshot_is_refused_naming_why_and_the_disk_tier_is_used(tmp_path, node_root, case):
    spoil, why, file = CASES[case]
    directory, _, _ = trained(tmp_path)
    model, opt, engine = job(tmp_path / "plain", job_id=JOB, disk_every=4, node_every=0)
    train(model, opt, engine, 1, 4)  # the same run to step 4, disk only: what step 4 holds
    at4 = state(model, opt)
    engine.close()
    spoil(node_dir(directory, node_root) / "step_00000007")
    step, got, engine = resumed(directory)
    assert step == 4 and same(got, at4)
    refused = reasons(engine, Reason.SNAPSHOT_REFUSED)
    assert any(why in m and "step_00000007" in m and file in m for m in refused), refused
    if case != "another job":  # the refusal names the tier tried next
        assert any("trying the disk tier's step 4" in m for m in refused), refused
    assert "(disk tier, step 4)" in reasons(engine, Reason.SNAPSHOT_RESUMED)[0]
    engine.close()


def test_a_step_flagged_after_it_was_taken_is_never_restored_from(tmp_path, node_root):
    model, opt, engine = job(tmp_path / "snaps", job_id=JOB, disk_every=4, memory_every=1, node_every=1, node_keep=2)
    train(model, opt, engine, 1, 7)
    engine.flag_steps(5, 7, "weight_corruption at step 7")  # what protect.py does on such a finding
    engine.close()
    step, got, resumer = resumed(tmp_path / "snaps", node_keep=2)
    refused = reasons(resumer, Reason.SNAPSHOT_REFUSED)
    assert any("step 7 was flagged after it was taken (weight_corruption at step 7)" in m for m in refused), refused
    assert step == 4  # the node tier keeps two of 5-7 (all flagged): the disk's 4
    resumer.close()
    # a snapshot of a flagged step taken after the flag (the step re-run) is restorable again
    model, opt, engine = job(tmp_path / "snaps", job_id=JOB, disk_every=4, memory_every=1, node_every=1, node_keep=2)
    assert engine.resume() == 4
    train(model, opt, engine, 5, 7)
    engine.close()
    step, _, resumer = resumed(tmp_path / "snaps", node_keep=2)
    assert step == 7
    resumer.close()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="node_every"):
        SnapshotConfig(node_every=-1)
    with pytest.raises(ValueError, match="node_keep"):
        SnapshotConfig(node_keep=0)
    with pytest.raises(ValueError, match="node_root"):
        SnapshotConfig(node_root="")
    assert SnapshotConfig(node_root="/x").node_root_path == "/x"


def test_snapshot_list_shows_the_node_tier_of_a_job(tmp_path, node_root, capsys):
    from mscale.cli import main

    directory, _, _ = trained(tmp_path)
    capsys.readouterr()  # the training's log lines
    assert main(["snapshot", "list", str(directory), "--job", JOB, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tier"], r["step"]) for r in rows] == [("disk", 4), ("node", 7)]
    assert rows[1]["path"] == str(node_dir(directory, node_root) / "step_00000007") and rows[1]["complete"]
    assert main(["snapshot", "list", str(directory)]) == 0  # without --job: the disk tier as before
    out = capsys.readouterr().out
    assert "TIER" not in out and "step_00000004" in out and "step_00000007" not in out


def test_the_agent_keeps_each_tiers_newest_write_apart_from_the_disk_figures(tmp_path, node_root):
    from mscale.daemon.jobs import SnapshotStats

    model, opt, engine = job(tmp_path / "snaps", job_id=JOB, disk_every=4, memory_every=2, node_every=2)
    train(model, opt, engine, 1, 6)
    engine.close()
    stats = SnapshotStats()
    for f in engine.findings:
        stats.observe(f)
    disk = [f for f in engine.findings if f.reason is Reason.SNAPSHOT_WRITTEN and f.labels["tier"] == "disk"]
    assert stats.writes == len(disk) == 1  # the disk's histogram counts the disk's writes only
    assert stats.tiers["disk"][0] == 4 and stats.tiers["node"][0] == 6
    assert stats.tiers["node"][2] == sum(i.nbytes for i in list_snapshots(node_dir(tmp_path / "snaps", node_root))[-1:])


def test_attach_says_the_node_tier_is_on_and_a_weight_written_outside_the_optimizer_flags_its_steps(
    tmp_path, node_root
):
    import mscale
    from mscale.snapshot.node_tier import Flags
    from support.tiny_snapshot_job import Net

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = SnapshotConfig(directory=tmp_path / "snaps", memory_every=1, disk_every=100)
    mpus = {"vision": model.vision, "text": model.text}
    guard = mscale.attach(model, opt, job_id=JOB, snapshots=cfg, connect=False, mpus=mpus)
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    tier = [f.message for f in guard.findings if f.reason is Reason.SNAPSHOT_TIER]
    assert len(tier) == 1 and tier[0].startswith("node snapshot tier on: every 10 steps"), tier
    with torch.no_grad():
        model.vision.weight[0, 0] += 1.0  # the test's own fault: a weight written outside the optimizer
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    found = [f for f in guard.findings if f.reason is Reason.WEIGHT_CORRUPTION]
    assert found, [f.reason for f in guard.findings]
    guard.detach()
    step = int(found[0].labels["step"])
    flags = Flags(node_dir(tmp_path / "snaps", node_root)).entries()
    assert [(e["first"], e["last"]) for e in flags][:1] == [(step - 1, step)]
    assert flags[0]["why"] == f"weight_corruption at step {step}"
