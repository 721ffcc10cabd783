"""`mscale demo --nodes 2 --ranks 2`: two agents, one DDP job across them, an Xid on node B."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO


def demo(*argv: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """The demo as a user runs it; on a timeout its whole process group (agents, ranks) is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mscale", "demo", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        raise AssertionError("the demo timed out") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_the_two_node_demo_heals_node_b_and_keeps_the_replicas_equal(tmp_path: Path) -> None:
    done = demo("--nodes", "2", "--ranks", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "only rank 3 moved its MPUs" in done.stdout and "replicas bitwise equal: yes" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["xid"] == {"node": "node-b", "gpu": 1, "code": 79} and summary["replicas_equal"]
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert [ranks[r]["node"] for r in range(4)] == ["node-a", "node-a", "node-b", "node-b"]
    assert ranks[3]["gpus"] == {"vision": 2, "aligner": 2, "text": 2} and ranks[3]["fuse"] == ["l1_swapped"]
    assert {"emergency_snapshot:applied", "l1_swap:applied"} <= set(ranks[3]["actions"])
    assert all(ranks[r]["actions"] == [] and ranks[r]["fuse"] == ["healthy"] for r in range(2))  # node A
    assert ranks[2]["actions"] == ["emergency_snapshot:applied"] and ranks[2]["fuse"] == ["healthy"]


def test_bad_node_and_rank_counts_are_refused() -> None:
    for argv in (("--nodes", "5"), ("--ranks", "0"), ("--nodes", "1", "--ranks", "1", "--steps", "10")):
        done = demo(*argv, "--out", "/nonexistent/never")
        assert done.returncode == 2 and "mscale demo:" in done.stderr, argv
