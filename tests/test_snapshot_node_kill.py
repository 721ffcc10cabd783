"""Issue 39: a process killed with SIGKILL resumes from the node tier (its snapshots in the
node's shared memory outlive it), bitwise, at a step newer than the newest disk snapshot: a
guarded tiny LLaVA on one process, and a 2-rank gloo DDP group one of whose ranks is killed, the
restarted group resuming every rank at the same node-tier step (forked, and under torchrun
--max-restarts, which restarts the group itself). The node root is a per-test
directory under /dev/shm (conftest.py), inherited by the processes and removed after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mscale.snapshot.format import list_snapshots
from mscale.snapshot.node_tier import node_job_dir
from support import REPO, free_port
from support.ddp_run import run_group, torchrun_argv, torchrun_env

# nine job runs, six of them 2-rank groups (one under torchrun): about 5 min on 2 busy cores
pytestmark = pytest.mark.slow

LLAVA = Path(__file__).parent / "support" / "guarded_llava_job.py"
STEPS, KILL_AT = 20, 13  # node-tier snapshots every 2 steps (10, 12 kept), disk ones every 8 (8)


def llava(directory: Path, result: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(LLAVA), "--dir", str(directory), "--steps", str(STEPS), "--result", str(result)]
    cmd += ["--every", "2", "--disk-every", "8", "--node-every", "2", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_a_killed_process_resumes_from_the_node_tier_bitwise_newer_than_the_disk(tmp_path) -> None:
    plain = llava(tmp_path / "plain", tmp_path / "plain.json")
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed = llava(tmp_path / "killed", tmp_path / "killed.json", "--kill-at", str(KILL_AT))
    assert killed.returncode == -9, killed.stderr[-3000:]  # a real SIGKILL, mid-run
    on_disk = max(i.step for i in list_snapshots(tmp_path / "killed"))
    assert on_disk == 8
    restarted = llava(tmp_path / "killed", tmp_path / "killed.json")
    assert restarted.returncode == 0, restarted.stderr[-3000:]

    ref = json.loads((tmp_path / "plain.json").read_text())
    got = json.loads((tmp_path / "killed.json").read_text())
    assert got["resumed"] == [None, 12] and got["tiers"][-1] == ["node"]  # newer than the disk's 8
    assert got["lr"] == ref["lr"] and got["alpha"] == ref["alpha"]  # scheduler and CMSA state
    assert got["digest"] == ref["digest"]  # weights and optimizer state, bitwise


def world(tmp: Path, name: str, directory: Path, *extra: str, node_root: str = "") -> tuple[int, list[dict], str]:
    out = tmp / name
    out.mkdir()
    argv = [sys.executable, "tests/support/world_job.py", "--world", "2", "--port", str(free_port())]
    argv += ["--out", str(out), "--dir", str(directory), "--steps", "12", "--every", "8", "--node-every", "2", *extra]
    log = tmp / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    if node_root:
        env["MSCALE_SNAPSHOT_NODE_ROOT"] = node_root
    code = run_group(argv, log, env=env)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
    return code, ranks, log.read_text()


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict]:
    """The uninterrupted 2-rank run, each rank's hashes at every step."""
    tmp = tmp_path_factory.mktemp("plain")
    (tmp / "node").mkdir()  # its node tier: set up before any test's own root (conftest.py)
    code, ranks, log = world(tmp, "plain", tmp / "plain", node_root=str(tmp / "node"))
    assert code == 0 and len(ranks) == 2, log[-3000:]
    return ranks


def killed(tmp_path: Path) -> None:
    """The group run until rank 1 SIGKILLs itself at step 11 (node tier: 8 and 10, disk: 8)."""
    code, _, log = world(tmp_path, "killed", tmp_path / "snaps", "--kill-at", "11", "--kill-rank", "1")
    assert code != 0, log[-3000:]  # rank 1 SIGKILLed itself, rank 0 lost its peer
    assert max(i.step for i in list_snapshots(tmp_path / "snaps")) == 8


def test_a_rank_killed_in_a_2_rank_group_resumes_every_rank_from_the_node_tier_at_one_step(tmp_path, plain) -> None:
    killed(tmp_path)
    code, again, log = world(tmp_path, "restarted", tmp_path / "snaps")
    assert code == 0 and len(again) == 2, log[-3000:]
    for r in again:  # every rank at step 10, the node tier's newest, bitwise the uninterrupted run's
        assert r["start"] == 11, r
        assert any("(node tier, step 10)" in m for m in r["resumed"]), r["resumed"]
        assert r["start_hash"] == plain[r["rank"]]["hashes"]["10"]
        assert r["start_optimizer_hash"] == plain[r["rank"]]["optimizer_hashes"]["10"]
        assert r["hashes"]["11"] == plain[r["rank"]]["hashes"]["11"]  # and the next step is the same


def test_under_torchrun_max_restarts_a_sigkilled_rank_s_group_restarts_from_the_node_tier(tmp_path, plain) -> None:
    """torchrun --max-restarts 1: rank 1 SIGKILLs itself at step 11 of the first attempt; torchrun
    stops rank 0 and restarts the group, which resumes every rank from the node tier's step 10
    (newer than the disk's 8), bitwise the uninterrupted run's, and ends with exit status 0."""
    out = tmp_path / "out"
    out.mkdir()
    argv = torchrun_argv(nnodes=1, nproc=2, endpoint=f"127.0.0.1:{free_port()}", restarts=1)
    argv += ["tests/support/world_job.py", "--torchrun", "--world", "2", "--out", str(out)]
    argv += ["--dir", str(tmp_path / "snaps"), "--steps", "12", "--every", "8", "--node-every", "2"]
    argv += ["--kill-at", "11", "--kill-rank", "1"]
    log = tmp_path / "torchrun.log"
    code = run_group(argv, log, env=torchrun_env(), timeout_s=400)
    assert code == 0, log.read_text()[-3000:]
    again = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
    assert [r["attempt"] for r in again] == [1, 1], again  # written by the restarted group
    assert max(i.step for i in list_snapshots(tmp_path / "snaps")) == 8
    for r in again:
        assert r["start"] == 11 and any("(node tier, step 10)" in m for m in r["resumed"]), r
        assert r["start_hash"] == plain[r["rank"]]["hashes"]["10"]
        assert r["start_optimizer_hash"] == plain[r["rank"]]["optimizer_hashes"]["10"]
        assert r["hashes"]["11"] == plain[r["rank"]]["hashes"]["11"]  # and the next step is the same


def test_a_corrupt_node_copy_on_one_rank_moves_every_rank_to_the_next_step(tmp_path, node_root, plain) -> None:
    killed(tmp_path)
    shard = sorted(node_job_dir(node_root, "world-job", tmp_path / "snaps").glob("rank_00001/step_00000010/mpu_*"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x04  # one bit of rank 1's copy of step 10
    shard.write_bytes(bytes(raw))
    code, again, log = world(tmp_path, "restarted", tmp_path / "snaps")
    assert code == 0 and len(again) == 2, log[-3000:]
    by_rank = {r["rank"]: r for r in again}
    assert any(shard.name in m and "trying the node tier's step 8" in m for m in by_rank[1]["refused"]), by_rank[1]
    for r in again:  # rank 0's copy of step 10 verified, but every rank goes to step 8 together
        assert r["start"] == 9, r
        assert any("(node tier, step 8)" in m for m in r["resumed"]), r["resumed"]
        assert r["start_hash"] == plain[r["rank"]]["hashes"]["8"]
        assert r["start_optimizer_hash"] == plain[r["rank"]]["optimizer_hashes"]["8"]
