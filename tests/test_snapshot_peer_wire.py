"""Issue 39, the peer tier's checks as a replica lands (mscale.snapshot.peer_wire), on real
node-tier snapshots of the tiny job: the stream a peer sends (Outgoing's chunks) fed to the
receiving side (Landing) keeps a whole replica byte for byte, and refuses one with a flipped bit,
a truncated file, another job's, another rank's or one past node_cap_bytes, naming why and
leaving nothing behind; the node tier's own writes stop at the cap too; `mscale snapshot list
--job` shows the replicas a node holds. The transfer itself over gloo, and resumes from the
replicas, are tests/test_snapshot_peer_tier.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mscale.findings import Reason
from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.format import list_snapshots
from mscale.snapshot.node_tier import node_job_dir
from mscale.snapshot.peer_wire import Landing, Outgoing
from support.tiny_snapshot_job import job, train

JOB = "team-a/run-7"


@pytest.fixture
def primary(tmp_path, node_root) -> Path:
    """A node-tier snapshot of step 4 (the primary a replica is sent from)."""
    model, opt, engine = job(tmp_path / "snaps", job_id=JOB, memory_every=1, node_every=4, node_keep=1)
    train(model, opt, engine, 1, 4)
    engine.close()
    return node_job_dir(node_root, JOB, tmp_path / "snaps") / "rank_00000" / "step_00000004"


def send(
    primary: Path, target: Path, *, job_id: str = JOB, source: int = 0, room: int = 1 << 40, world: int = 1
) -> Landing:
    """What the receiving side of an exchange does with `primary` as sent (peer_wire.exchange)."""
    out = Outgoing(primary, JOB, 0)
    target.mkdir(parents=True, exist_ok=True)
    landing = Landing(target, out.index, job_id=job_id, source=source, room=room, keep=1, world=world)
    for chunk in out.chunks():
        landing.take(memoryview(chunk.numpy()).cast("B"))
    landing.finish()
    return landing


def test_a_whole_replica_lands_byte_for_byte(primary, tmp_path):
    got = send(primary, tmp_path / "peer" / "rank_00000")
    assert got.why == "" and got.path == tmp_path / "peer" / "rank_00000" / "step_00000004"
    names = sorted(p.name for p in primary.iterdir())
    assert sorted(p.name for p in got.path.iterdir()) == names
    for n in names:
        assert (got.path / n).read_bytes() == (primary / n).read_bytes(), n
    assert [p.name for p in got.path.parent.iterdir()] == ["step_00000004"]  # no temporary left


def flipped(primary: Path) -> str:
    shard = sorted(primary.glob("mpu_*"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    shard.write_bytes(bytes(raw))
    return f"{shard.name} does not match its primary's BLAKE3 digest"


def truncated(primary: Path) -> str:
    shard = sorted(primary.glob("mpu_*"))[0]
    size = shard.stat().st_size
    os.truncate(shard, size - 8)
    return f"{shard.name} is {size - 8} bytes, its primary's manifest says {size}"


def other_job(primary: Path) -> str:
    m = json.loads((primary / "manifest.json").read_text())
    m["job_id"] = "team-b/run-1"
    (primary / "manifest.json").write_text(json.dumps(m))
    return "it is a snapshot of job 'team-b/run-1', not of this one ('team-a/run-7')"


@pytest.mark.parametrize("damage", [flipped, truncated, other_job])
def test_a_bad_replica_is_refused_naming_why_and_nothing_is_kept(primary, tmp_path, damage):
    why = damage(primary)
    got = send(primary, tmp_path / "peer")
    assert got.path is None and why in got.why, got.why
    assert list((tmp_path / "peer").iterdir()) == []


def test_another_ranks_or_worlds_replica_or_one_past_the_cap_is_refused(primary, tmp_path):
    got = send(primary, tmp_path / "a", source=3)
    assert got.path is None and got.why == "it is rank 0's, not rank 3's"
    got = send(primary, tmp_path / "w", world=2)  # an older run's, on another number of ranks
    assert got.path is None and got.why == "it is of a world of 1 ranks, not 2"
    size = sum(p.stat().st_size for p in primary.iterdir() if p.name != "manifest.json")
    got = send(primary, tmp_path / "b", room=size - 1)
    assert got.path is None and f"{size} bytes would take the node tier past node_cap_bytes" in got.why
    assert send(primary, tmp_path / "c", room=size).path is not None  # exactly the room: kept


def test_the_node_tier_stops_at_its_cap_with_a_finding(tmp_path, node_root):
    cap = 50_000  # room for two snapshots of the tiny job (about 20 KB each, manifest included)
    model, opt, engine = job(tmp_path / "snaps", job_id=JOB, memory_every=1, node_every=1, node_cap_bytes=cap)
    for step in range(1, 5):
        train(model, opt, engine, step, step)
        engine.flush()  # each write done before the next is weighed
    engine.close()
    refused = [f.message for f in engine.findings if f.reason is Reason.SNAPSHOT_FAILED]
    written = list_snapshots(node_job_dir(node_root, JOB, tmp_path / "snaps") / "rank_00000")
    assert [i.step for i in written] == [1, 2]
    assert len(refused) == 2 and all("past node_cap_bytes" in m for m in refused), refused
    assert "node-tier snapshot of step 3 not written" in refused[0]


def test_snapshot_list_shows_the_replicas_a_node_holds(primary, tmp_path, node_root, capsys):
    from mscale.cli import main

    send(primary, node_job_dir(node_root, JOB, tmp_path / "snaps") / "peer" / "rank_00000")
    capsys.readouterr()
    assert main(["snapshot", "list", str(tmp_path / "snaps"), "--job", JOB, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tier"], r["step"]) for r in rows if r["tier"] != "disk"] == [("node", 4), ("peer", 4)]


def test_peer_settings_are_checked():
    with pytest.raises(ValueError, match="peer_every"):
        SnapshotConfig(peer_every=-1)
    with pytest.raises(ValueError, match="peer_keep"):
        SnapshotConfig(peer_keep=0)
    with pytest.raises(ValueError, match="peer_timeout_s"):
        SnapshotConfig(peer_timeout_s=0)
    with pytest.raises(ValueError, match="node_cap_bytes"):
        SnapshotConfig(node_cap_bytes=0)


def test_a_replica_of_an_older_step_replaces_the_newer_ones_of_an_abandoned_timeline(tmp_path, node_root):
    model, opt, engine = job(tmp_path / "snaps", job_id=JOB, memory_every=1, node_every=2, node_keep=2)
    train(model, opt, engine, 1, 4)
    engine.close()
    rank_dir = node_job_dir(node_root, JOB, tmp_path / "snaps") / "rank_00000"
    held = tmp_path / "peer" / "rank_00000"
    assert send(rank_dir / "step_00000004", held).path is not None
    assert send(rank_dir / "step_00000002", held).path is not None  # sent after a rollback to step 2
    assert [p.name for p in held.iterdir()] == ["step_00000002"]
