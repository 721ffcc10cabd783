"""The weight gradients checked before the reduction (mscale.hook.checks.gradcheck): a gradient
corrupted on one rank by the test's own tensor hook is caught in its step, before any rank's
update, blamed on the rank, MPU and tensor; the job rolls back and re-runs the step, and both
ranks end bitwise equal to the fault-free run. A clean run raises nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog
import torch

import mscale
from mscale.healing.settings import HealingSection
from mscale.hook.checks.gradcheck import GradCheck
from support.ddp_run import run_job

FC1 = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"


@pytest.fixture(autouse=True)
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="groups: expected an int >= 0"):
        GradCheck(-1)
    with pytest.raises(ValueError, match="factor > 1"):
        GradCheck(8, factor=0.5)
    with pytest.raises(TypeError, match="healing: expected"):
        mscale.attach(torch.nn.Linear(2, 2), None, job_id="x", connect=False, healing={"gradient_groups": 2})


def _llava(*, fault_at: int | None, steps: int = 12):
    """The tiny LLaVA, the README's line (snapshots every step), gradients checked in 2 groups;
    fault_at: from that step on, in the first step whose check covers FC1, one element of FC1's
    gradient raised by 1e6 times its norm (a tensor hook: before the accumulation)."""
    from support.tiny_hf import guarded

    model, make_batch, opt, guard, findings = guarded("gradients", healing=HealingSection(gradient_groups=2))
    weight = dict(model.named_parameters())[FC1]
    index = next(i for i, (_, _, p) in enumerate(guard.gradients.params) if p is weight)
    hit: list[int] = []

    def corrupt(g: torch.Tensor) -> torch.Tensor:
        if fault_at is None or hit or guard.current_step < fault_at or index not in guard.gradients.due:
            return g
        hit.append(guard.current_step)
        g = g.clone()
        g.view(-1)[7] += 1e6 * (float(g.norm()) + 1.0)
        return g

    weight.register_hook(corrupt)
    runs = 0
    try:
        while guard.current_step < steps and runs < 3 * steps:
            runs += 1
            batch = make_batch(guard.current_step, torch.Generator().manual_seed(guard.current_step))
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
    finally:
        guard.detach()
    return model, findings, hit, runs


def test_a_corrupted_gradient_is_caught_in_its_step_and_the_step_re_run_bitwise() -> None:
    clean, quiet, _, clean_runs = _llava(fault_at=None)
    assert not [f for f in quiet if f.reason.value == "gradient_corruption"] and clean_runs == 12
    hit, findings, at, runs = _llava(fault_at=5)
    assert len(at) == 1 and 5 <= at[0] <= 6
    (f,) = [f for f in findings if f.reason.value == "gradient_corruption"]
    assert (f.labels["step"], f.labels["mpu"], f.labels["tensor"], f.labels["rank"]) == (str(at[0]), "vision", FC1, "0")
    rolled = [f for f in findings if f.reason.value == "heal_action" and f.labels.get("action") == "rollback"]
    assert [f.labels.get("result") for f in rolled] == ["applied"]  # one event: the drop and the restore
    assert runs == 12 + 1  # the step re-run once, on the same batch
    sa, sb = clean.state_dict(), hit.state_dict()
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []


def test_under_ddp_a_gradient_corrupted_on_one_rank_is_caught_before_the_update_and_healed_bitwise(
    tmp_path: Path,
) -> None:
    """2 gloo ranks under DDP, snapshots every step, gradients checked in 2 groups: rank 1's
    gradient of one vision weight corrupted before the reduction. Rank 1 blames itself, the MPU
    and the tensor; both ranks drop that step's update (the agreement), roll back one step and
    re-run it; both end bitwise equal to the fault-free run's weights."""
    opts = dict(world=2, snapshots=True, grad_groups=2, steps=10)
    (tmp_path / "clean").mkdir()
    (tmp_path / "hit").mkdir()
    clean = run_job(tmp_path / "clean", scenario="plain", **opts)
    hit = run_job(tmp_path / "hit", scenario="gradient", fault_rank=1, fault_at=5, **opts)
    assert all(not r["grad_findings"] for r in clean)
    (step,) = hit[1]["grad_hit"]
    (f,) = hit[1]["grad_findings"]
    assert (f["step"], f["rank"], f["mpu"]) == (str(step), "1", "vision")
    assert f["tensor"] == "module.vision_tower.layers.0.linear1.weight"
    assert not hit[0]["grad_findings"]
    for r in hit:
        assert [e["step"] for e in r["ends"] if e["skip"]] == [step]  # dropped on both ranks
        assert [(x["step"], x["to"]) for x in r["rollbacks"]] == [(step, step - 1)]
        assert r["final_step"] == 10
    assert hit[0]["hash"] == hit[1]["hash"] == clean[0]["hash"] == clean[1]["hash"]
