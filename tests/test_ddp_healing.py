"""The fuse under DDP (2 gloo ranks, tests/support/heal_job.py): a persistent fault follows rank
1's vision tower (the test's own forward hook on its last linear, from step 4 on). Rank 1's fuse
applies L1, L2 and L3 as with one rank; every rank drops only the vision tower's averaged
gradient while it fails, so the other MPUs train on, the loss falls on both ranks during the
fault, and the replicas stay bitwise equal after every step. Rank 0's findings name rank 1."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from statistics import mean

from support import REPO, free_port
from support.ddp_run import run_group

STEPS, FAULT_FROM = 30, 4


def run(tmp: Path) -> list[dict]:
    out = tmp / "out"
    out.mkdir()
    argv = [sys.executable, "tests/support/heal_job.py", "--port", str(free_port()), "--out", str(out)]
    argv += ["--steps", str(STEPS), "--fault-from", str(FAULT_FROM)]
    log = tmp / "job.log"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    code = run_group(argv, log, env=env)
    assert code == 0, log.read_text()[-3000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]


def test_a_fault_following_rank_1s_vision_tower_is_healed_on_rank_1_while_both_ranks_train(tmp_path: Path) -> None:
    r0, r1 = run(tmp_path)
    applied = [a for a, result, _ in r1["actions"] if result == "applied"]
    assert applied[:4] == ["mark_suspect", "l1_swap", "l2_degrade", "l3_distill"]
    assert not [a for a in r0["actions"] if a[1] == "applied"]  # rank 0's MPUs are healthy
    assert r1["ends"][-1]["level"] == "l3_distilling" and r0["ends"][-1]["level"] == "healthy"
    # replicas bitwise equal after every step
    assert [e["hash"] for e in r0["ends"]] == [e["hash"] for e in r1["ends"]]
    assert len({e["hash"] for e in r0["ends"]}) == STEPS  # and every step changed them: none dropped
    # the loss still falls on both ranks during the fault (rank 1's from L3 on includes its term)
    for r in (r0, r1):
        losses = [e["loss"] for e in r["ends"]]
        assert mean(losses[-5:]) < mean(losses[12:17]) - 0.2, losses
    # each rank's finding names rank 1 as the one at fault, and the MPU
    for r in (r0, r1):
        assert r["n_dropped"] == STEPS - FAULT_FROM
        first = r["dropped"][0]
        assert first["ranks_at_fault"] == "1" and first["mpu_id"] == "001" and first["step"] == str(FAULT_FROM)
