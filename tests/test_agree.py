"""Agreed decisions across ranks (mscale.hook.core.agree) on real gloo process groups: the tiny model
under DistributedDataParallel, each rank a real process (tests/support/ddp_job.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mscale
from mscale.hook.core.agree import Agreement
from mscale.hook.core.ranks import identify
from mscale.sim.tinymm import TinyConfig, TinyMultimodal
from support.ddp_run import run_job, skipped_steps
from support.link_agent import Agent, wait_for


@pytest.mark.slow
def test_a_nan_pixel_on_rank_1_rolls_every_rank_back_together(tmp_path: Path) -> None:
    """The issue's scenario: one NaN pixel in rank 1's batch at step 3, the fuse and in-memory
    snapshots attached. Both ranks drop step 3 and restore step 2 (the collective rollback),
    weights stay finite and bitwise equal across ranks, and the findings carry the right rank."""
    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock)
    try:
        ranks = run_job(tmp_path, scenario="nan", snapshots=True, socket=sock)
        for r in ranks:
            assert r["world"] == 2 and r["guard_rank"] == r["rank"]
            assert r["rollbacks"] == [{"step": 3, "to": 2}]
            assert skipped_steps(r) == [3] and r["final_step"] == 8 and r["finite"]
            assert r["agreements"] == 9  # one agreement per optimizer step: 8, plus step 3 run twice
        assert ranks[0]["hash"] == ranks[1]["hash"]
        assert [e["hash"] for e in ranks[0]["ends"]] == [e["hash"] for e in ranks[1]["ends"]]
        # only rank 1 saw the NaN itself; rank 0 dropped the step on rank 1's word
        assert ["guard", "input_nonfinite"] in ranks[1]["findings"]  # the data's fault, not an MPU's
        assert ["guard", "input_nonfinite"] not in ranks[0]["findings"]
        assert ["checksum", "nonfinite_output"] not in ranks[0]["findings"] + ranks[1]["findings"]
        assert ["agree", "step_dropped_agreed"] in ranks[0]["findings"]

        def by_rank(reason: str) -> set[str]:
            return {f.labels.get("rank", "?") for _, f in agent.state.events.since(0) if f.reason.value == reason}

        wait_for(lambda: by_rank("loss_nonfinite") == {"0", "1"}, 30, "both ranks' loss_nonfinite at the agent")
        assert by_rank("input_nonfinite") == {"1"}
        assert by_rank("step_dropped_agreed") == {"0"}
        job = agent.state.jobs["ddp-job"]
        assert sorted(job.rank_states) == [0, 1] and job.step == 7
    finally:
        agent.stop()


@pytest.mark.slow
def test_a_checksum_failure_on_one_rank_drops_that_mpus_gradient_on_every_rank(tmp_path: Path) -> None:
    """DDP has averaged rank 1's corrupted vision gradient into every rank's: the three-line
    attach (no snapshots) drops the vision tower's gradient at step 3 on both ranks and keeps
    the rest of the update, so no step is dropped, and the replicas stay bitwise equal."""
    ranks = run_job(tmp_path, scenario="checksum")
    for r in ranks:
        assert r["replicas"] and skipped_steps(r) == []
        assert r["ends"][3]["hash"] != r["ends"][2]["hash"]  # the other MPUs trained at step 3
        assert r["rollbacks"] == [] and r["finite"] and r["final_step"] == 8
        assert ["agree", "mpu_gradient_dropped_agreed"] in r["findings"]
    assert ["checksum", "checksum_failure"] in ranks[1]["findings"]
    assert ["checksum", "checksum_failure"] not in ranks[0]["findings"]
    assert [e["hash"] for e in ranks[0]["ends"]] == [e["hash"] for e in ranks[1]["ends"]]
    # CMSA and the loss detector under DDP: each MPU's norm is the averaged gradient's, alike on both ranks
    # (the vision tower's at step 3 is 0 on every rank: its gradient was dropped before CMSA)
    for r in ranks:
        for i, step in enumerate(r["norms"]):
            for name, (guard_norm, whole) in step.items():
                assert guard_norm == (0.0 if (i, name) == (3, "vision") else pytest.approx(whole, rel=1e-5)), name
    assert ranks[0]["norms"] == ranks[1]["norms"]


@pytest.mark.slow
def test_a_rollback_asked_of_one_rank_rolls_every_rank_back(tmp_path: Path) -> None:
    """A rollback command that reached rank 1 alone (before step 3): its count in the agreement
    makes rank 0 restore the same step too, with no collective of its own, and the replicas
    stay bitwise equal through the replay."""
    ranks = run_job(tmp_path, scenario="rollback_cmd", snapshots=True)
    for r in ranks:
        assert r["rollbacks"] == [{"step": 3, "to": 2}] and r["final_step"] == 8 and r["finite"]
        assert [e["step"] for e in r["ends"]] == [0, 1, 2, 3, 3, 4, 5, 6, 7]  # step 3 run again
    assert [e["hash"] for e in ranks[0]["ends"]] == [e["hash"] for e in ranks[1]["ends"]]


@pytest.mark.slow
def test_four_ranks_roll_back_together(tmp_path: Path) -> None:
    ranks = run_job(tmp_path, world=4, scenario="nan", snapshots=True, fault_rank=2, steps=6)
    assert {r["hash"] for r in ranks} == {ranks[0]["hash"]}
    for r in ranks:
        assert r["rollbacks"] == [{"step": 3, "to": 2}] and skipped_steps(r) == [3] and r["finite"]


def test_without_a_process_group_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert identify() == (0, 0, 1)
    model = TinyMultimodal(TinyConfig())
    guard = mscale.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job_id="one", connect=False)
    try:
        assert not any(isinstance(p, Agreement) for p in guard.plugins)
        assert (guard.rank, guard.local_rank, guard.world_size) == (0, 0, 1)
    finally:
        guard.detach()
    a = Agreement()
    assert a.world_size == 1
    a.on_step_decide(0)  # no process group: no collective, nothing recorded
    assert a.collectives == 0 and not a.history


def test_rank_identity_from_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert identify() == (5, 1, 8)
    monkeypatch.delenv("LOCAL_RANK")
    assert identify() == (5, 5, 8)  # unset: one node
    monkeypatch.setenv("RANK", "five")
    with pytest.raises(ValueError, match="RANK='five'"):
        identify()
    monkeypatch.setenv("RANK", "-1")
    with pytest.raises(ValueError, match="RANK=-1"):
        identify()
