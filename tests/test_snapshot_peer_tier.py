"""Issue 39, the peer tier: a 2-rank gloo DDP group of the tiny LLaVA as two "nodes" (one rank
each, LOCAL_WORLD_SIZE=1, each its own node root under /dev/shm) replicates each rank's node-tier
snapshot to the other. Rank 1 SIGKILLs itself at step 11 and its node is lost (its node root
removed, an empty one in its place, as a fresh node's): the restarted group resumes rank 1 from
the replica rank 0 holds and rank 0 from its own node tier, both at step 10, bitwise the
uninterrupted run's. A replica with a flipped bit, a truncated one, one of another job and one
of a step flagged later are each refused with a finding naming why, and every rank goes to the
next tier together (the disk's step 8: rank 1 has nothing newer left), as when the rank holding
the replica does not answer at resume. Under torchrun (two agents, --max-restarts 1) the
restarted rank of a fresh node resumes from its replica. And a 4-rank FSDP2 group of two nodes
loses its second: both its ranks resume from their replicas."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from mscale.snapshot.node_tier import node_job_dir
from support import REPO, free_port
from support.ddp_run import run_agents, run_group, torchrun_argv, torchrun_env

# nine 2-rank group runs, one torchrun pair, three 4-rank runs: about 8.5 min on 2 busy cores
pytestmark = pytest.mark.slow

# node-tier snapshots and replicas every 2 steps (node tier: 8 and 10 kept, replicas: 10),
# disk ones every 8 (8); rank 1 killed at step 11
ARGS = ["--steps", "12", "--every", "8", "--node-every", "2", "--peer-every", "2", "--nodes", "2"]


def world(out: Path, directory: Path, base: Path, *extra: str, ranks: int = 2) -> tuple[int, list[dict], str]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv = [sys.executable, "tests/support/world_job.py", "--world", str(ranks), "--port", str(free_port())]
    argv += ["--out", str(out), "--dir", str(directory), "--node-base", str(base), *ARGS, *extra]
    log = out.with_suffix(".log")
    code = run_group(argv, log, env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
    return code, ranks, log.read_text()


class Run:
    """A group killed at step 11, whose state (disk snapshots, both node roots) each test
    starts from again: `reset()` puts the state the kill left back in place, at the same paths
    (the node tier is keyed by the snapshot directory's path)."""

    def __init__(self, tmp: Path, *extra: str, ranks: int = 2, wrap: str = "ddp") -> None:
        self.tmp, self.ranks, self.wrap = tmp, ranks, ["--wrap", wrap]
        self.base = Path(tempfile.mkdtemp(prefix="peers-", dir=os.environ["MSCALE_SNAPSHOT_NODE_ROOT"]))
        self.snaps = tmp / "snaps"
        for n in ("node0", "node1"):
            (self.base / n).mkdir()
        kill = ["--kill-at", "11", "--kill-rank", str(ranks - 1)]
        code, _, log = world(tmp / "killed", self.snaps, self.base, *kill, *self.wrap, *extra, ranks=ranks)
        assert code != 0, log[-3000:]  # rank 1 SIGKILLed itself, rank 0 lost its peer
        self.saved = tmp / "saved"
        shutil.copytree(self.snaps, self.saved / "snaps", symlinks=True)
        shutil.copytree(self.base, self.saved / "base", symlinks=True)

    def reset(self) -> None:
        for live, kept in ((self.snaps, "snaps"), (self.base, "base")):
            shutil.rmtree(live)
            shutil.copytree(self.saved / kept, live, symlinks=True)

    def lose_node_1(self) -> None:
        shutil.rmtree(self.base / "node1")
        (self.base / "node1").mkdir(mode=0o700)  # a fresh node's empty /dev/shm

    def replica(self) -> Path:
        """The replica of rank 1's step 10 that rank 0 holds."""
        job = node_job_dir(self.base / "node0", "world-job", self.snaps)
        return job / "peer" / "rank_00001" / "step_00000010"

    def restart(self, name: str, *extra: str) -> dict[int, dict]:
        code, again, log = world(self.tmp / name, self.snaps, self.base, *self.wrap, *extra, ranks=self.ranks)
        assert code == 0 and len(again) == self.ranks, log[-3000:]
        return {r["rank"]: r for r in again}

    def cleanup(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict]:
    """The uninterrupted 2-rank run, each rank's hashes at every step."""
    tmp = tmp_path_factory.mktemp("plain")
    base = Path(tempfile.mkdtemp(prefix="plain-", dir=os.environ["MSCALE_SNAPSHOT_NODE_ROOT"]))
    for n in ("node0", "node1"):
        (base / n).mkdir()
    code, ranks, log = world(tmp / "out", tmp / "snaps", base)
    shutil.rmtree(base, ignore_errors=True)
    assert code == 0 and len(ranks) == 2, log[-3000:]
    return ranks


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("killed"))
    yield run
    run.cleanup()


def resumed_at(r: dict, tier: str, step: int, plain: list[dict]) -> None:
    assert r["start"] == step + 1, r
    assert any(f"({tier} tier, step {step})" in m for m in r["resumed"]), r["resumed"]
    assert r["start_hash"] == plain[r["rank"]]["hashes"][str(step)]  # weights, bitwise
    assert r["start_optimizer_hash"] == plain[r["rank"]]["optimizer_hashes"][str(step)]
    assert r["hashes"][str(step + 1)] == plain[r["rank"]]["hashes"][str(step + 1)]  # and the next step


def test_a_lost_node_resumes_its_rank_from_the_peer_replica_bitwise(killed, plain) -> None:
    killed.reset()
    assert (killed.replica() / "manifest.json").is_file()
    assert any("peer snapshot tier on: every 2 steps a replica to rank 1" in m for m in plain[0]["tiers"])
    killed.lose_node_1()
    by_rank = killed.restart("lost")
    resumed_at(by_rank[0], "node", 10, plain)  # its own node tier survived
    resumed_at(by_rank[1], "peer", 10, plain)  # its node's is gone: rank 0's replica of it
    assert by_rank[1]["refused"] == [], by_rank[1]["refused"]


def flip(replica: Path) -> str:
    shard = sorted(replica.glob("mpu_*"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(bytes(raw))
    return f"{shard.name} does not match its primary's BLAKE3 digest"


def truncate(replica: Path) -> str:
    shard = sorted(replica.glob("mpu_*"))[0]
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    return f"{shard.name} is {size - 100} bytes, its primary's manifest says {size}"


def other_job(replica: Path) -> str:
    manifest = replica / "manifest.json"
    m = json.loads(manifest.read_text())
    m["job_id"] = "another-job"
    manifest.write_text(json.dumps(m))
    return "it is a snapshot of job 'another-job', not of this one ('world-job')"


@pytest.mark.parametrize("damage", [flip, truncate, other_job], ids=["flipped-bit", "truncated", "other-job"])
def test_a_bad_replica_is_refused_with_why_and_every_rank_takes_the_next_tier(killed, plain, damage) -> None:
    killed.reset()
    why = damage(killed.replica())
    killed.lose_node_1()
    by_rank = killed.restart(damage.__name__)
    refused = by_rank[1]["refused"]
    assert any("the replica of step 10 held by rank 0 refused" in m and why in m for m in refused), refused
    for r in by_rank.values():  # rank 0's node copy of 10 is whole, but nobody resumes alone
        resumed_at(r, "disk", 8, plain)


def test_a_peer_that_does_not_answer_at_resume_is_named_and_every_rank_takes_the_disk(killed, plain) -> None:
    """Rank 0 holds rank 1's replica of step 10 but its sends on the peer group never arrive (the
    job's own hook: another tag): rank 1's wait for it ends at peer_timeout_s (10 s) with a
    finding naming rank 0, and both ranks resume from the disk's step 8 together (rank 1's node
    tier is gone, so no node-tier step is common), bitwise; the run goes on to its end."""
    killed.reset()
    killed.lose_node_1()
    by_rank = killed.restart("silent", "--mute-peer-rank", "0", "--peer-timeout", "10")
    refused = by_rank[1]["refused"]
    assert any("the peer tier did not answer at resume" in m and "rank 0 did not answer" in m for m in refused), refused
    for r in by_rank.values():
        resumed_at(r, "disk", 8, plain)
        assert sorted(map(int, r["hashes"])) == [9, 10, 11], r["hashes"].keys()  # trained on to the end


def test_a_replica_of_a_step_flagged_later_is_never_restored_from(tmp_path, plain) -> None:
    run = Run(tmp_path, "--flag-rank", "1")  # rank 1 flags step 10 before it is killed
    try:
        run.lose_node_1()
        by_rank = run.restart("flagged")
    finally:
        run.cleanup()
    refused = by_rank[1]["refused"]
    assert any("replica of step 10 refused: the step was flagged after it was taken" in m for m in refused), refused
    for r in by_rank.values():
        resumed_at(r, "disk", 8, plain)


def test_under_torchrun_a_restarted_rank_on_a_fresh_node_resumes_from_its_peer_replica(tmp_path, plain) -> None:
    """Two torchrun agents of one rank each (two nodes, one c10d rendezvous, --max-restarts 1):
    rank 1 SIGKILLs itself at step 11; its agent restarts it and the new rendezvous round
    restarts rank 0 too. The restarted rank 1 finds its node's tier empty (--lose-node: the node
    that replaced the lost one) and takes rank 0's replica: rank 0 resumes from its node tier,
    rank 1 from the peer tier, both at step 10, bitwise, and both agents end with status 0."""
    base = Path(tempfile.mkdtemp(prefix="torchrun-", dir=os.environ["MSCALE_SNAPSHOT_NODE_ROOT"]))
    out = tmp_path / "out"
    out.mkdir()
    for n in ("node0", "node1"):
        (base / n).mkdir()
    job = ["tests/support/world_job.py", "--torchrun", "--world", "2", "--out", str(out)]
    job += ["--dir", str(tmp_path / "snaps"), "--node-base", str(base), *ARGS]
    job += ["--kill-at", "11", "--kill-rank", "1", "--lose-node"]
    launch = torchrun_argv(nnodes=2, nproc=1, endpoint=f"127.0.0.1:{free_port()}", restarts=1)
    logs = [tmp_path / "agent0.log", tmp_path / "agent1.log"]
    try:
        codes = run_agents([launch + job, launch + job], logs, env=torchrun_env())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    by_rank = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank_*.json"))}
    assert by_rank[1]["attempt"] == 1, by_rank[1]  # written by the restarted rank
    resumed_at(by_rank[0], "node", 10, plain)
    resumed_at(by_rank[1], "peer", 10, plain)  # its node tier emptied: rank 0's replica of it


def test_a_lost_node_of_a_4_rank_fsdp2_group_resumes_both_its_ranks_from_replicas(tmp_path) -> None:
    """Two nodes of two ranks each, FSDP2 shards: node 1 (ranks 2 and 3) is lost, and its ranks
    take their shards back from ranks 0 and 1, which held them (replicate_to = rank + 2 mod 4)."""
    base = Path(tempfile.mkdtemp(prefix="plain4-", dir=os.environ["MSCALE_SNAPSHOT_NODE_ROOT"]))
    for n in ("node0", "node1"):
        (base / n).mkdir()
    code, ref, log = world(tmp_path / "plain", tmp_path / "plain-snaps", base, "--wrap", "fsdp", ranks=4)
    shutil.rmtree(base, ignore_errors=True)
    assert code == 0 and len(ref) == 4, log[-3000:]
    run = Run(tmp_path, ranks=4, wrap="fsdp")
    try:
        held = node_job_dir(run.base / "node0", "world-job", run.snaps) / "peer"
        assert sorted(p.name for p in held.iterdir()) == ["rank_00002", "rank_00003"]
        run.lose_node_1()
        by_rank = run.restart("lost4")
    finally:
        run.cleanup()
    for rank, r in by_rank.items():
        resumed_at(r, "node" if rank < 2 else "peer", 10, ref)


def test_a_node_write_its_cap_refuses_on_one_rank_keeps_the_replication_in_step(tmp_path) -> None:
    """Rank 0's node tier is capped at 1 byte: every node write of its is refused (its writer
    thread weighs the cap, with a finding) and it sends nothing in each exchange, in step with
    rank 1, whose replicas it refuses for want of room; rank 1's node tier and replication go on.
    Were rank 0 to skip the exchange, rank 1 would wait for it and replication would stop."""
    base = Path(tempfile.mkdtemp(prefix="peers-", dir=os.environ["MSCALE_SNAPSHOT_NODE_ROOT"]))
    for n in ("node0", "node1"):
        (base / n).mkdir()
    code, ranks, log = world(tmp_path / "capped", tmp_path / "snaps", base, "--cap-rank", "0", "--steps", "6")
    shutil.rmtree(base, ignore_errors=True)
    assert code == 0 and len(ranks) == 2, log[-3000:]
    r0, r1 = ranks
    assert [m for r in ranks for m in r["failed"] if "replication stopped" in m] == []
    assert sum("past node_cap_bytes" in m and "not written" in m for m in r0["failed"]) == 3, r0["failed"]
    assert sum("past node_cap_bytes" in m for m in r0["refused"]) == 3, r0["refused"]  # rank 1's replicas
    assert r1["failed"] == [] and r1["refused"] == []
