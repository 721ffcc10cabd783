"""Replica repair (mscale.hook.checks.replicas): per-MPU weight fingerprints compared across ranks,
a diverged rank's MPU copied back from a healthy rank in the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mscale.hook.checks.replicas import ReplicaCheck, diverged, fingerprint
from support.ddp_run import run_job
from support.link_agent import Agent, wait_for


def test_a_single_changed_bit_changes_the_fingerprint() -> None:
    torch.manual_seed(0)
    params = [torch.randn(64, 32), torch.randn(32).to(torch.bfloat16), torch.randn(7, dtype=torch.float64)]
    base = fingerprint(params)
    assert fingerprint([p.clone() for p in params]) == base
    for p in params:
        for bit in (0, 5, p.element_size() * 8 - 2):
            bad = [q.clone() for q in params]
            target = next(i for i, q in enumerate(params) if q is p)
            ints = bad[target].view({2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]).view(-1)
            ints[3] ^= 1 << bit
            assert fingerprint(bad) != base, (p.dtype, bit)


def test_the_majority_names_the_diverged_rank_and_a_tie_trusts_the_lower_rank() -> None:
    assert diverged([[1, 5], [1, 5], [9, 5], [1, 5]]) == {0: ([2], 0)}
    assert diverged([[7, 5], [1, 5], [1, 5], [1, 6]]) == {0: ([0], 1), 1: ([3], 0)}
    assert diverged([[1, 2], [1, 2]]) == {}
    assert diverged([[1], [3]]) == {0: ([1], 0)}  # two replicas: no majority


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="every: expected steps >= 0"):
        ReplicaCheck(-1)


@pytest.mark.slow
def test_a_corrupted_weight_on_rank_2_of_4_is_found_and_repaired_in_the_job(tmp_path: Path) -> None:
    """One weight element of rank 2's vision MPU corrupted before step 3; the check runs every 2
    steps (at the ends of steps 1, 3, 5, 7): found at step 3, within K steps, repaired from rank
    0, every rank bitwise equal afterwards, training goes on; the event names rank 2 and MPU 001."""
    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock)
    try:
        ranks = run_job(tmp_path, world=4, scenario="corrupt", fault_rank=2, replica_every=2, socket=sock)
        for r in ranks:
            assert r["repairs"] == [{"step": 3, "mpu_id": "001", "ranks": [2], "from_rank": 0, "ok": True}]
            assert r["replica_checks"] == 4 and r["final_step"] == 8 and r["finite"]
        ends = [[e["hash"] for e in r["ends"]] for r in ranks]
        assert ends[0] == ends[1] == ends[3]
        assert ends[2][3] != ends[0][3]  # diverged at step 3 (recorded before the check ran)
        assert ends[2][:3] == ends[0][:3] and ends[2][4:] == ends[0][4:]  # equal before, and after the repair
        assert len({e for e in ends[0][3:]}) == 5  # training went on: the weights kept changing
        assert ["replicas", "replica_repaired"] in ranks[2]["findings"]
        assert all(["replicas", "replica_repaired"] not in ranks[i]["findings"] for i in (0, 1, 3))

        def repaired() -> list[dict]:
            return [f.labels for _, f in agent.state.events.since(0) if f.reason.value == "replica_repaired"]

        (labels,) = wait_for(repaired, 30, "the repair event at the agent")
        assert (labels["rank"], labels["mpu_id"], labels["from_rank"]) == ("2", "001", "0")
    finally:
        agent.stop()
