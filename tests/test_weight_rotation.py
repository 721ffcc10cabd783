"""Weight fingerprints within the budget (mscale.hook.checks.weights, mscale.hook.checks.replicas): the trained
weights rotate over `healing.weight_groups` groups of about equal bytes, one group checked per
window between steps; under DDP the replicas compare every weight every
`healing.replica_check_steps` steps, so a weight written on one rank is found within that bound,
named by MPU and tensor, and repaired from a healthy rank."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog
import torch

from mscale.healing.settings import HealingSection
from mscale.hook.checks.weights import split_by_bytes
from support.ddp_run import run_job

FC1 = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"


@pytest.fixture(autouse=True)
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


def test_groups_hold_every_tensor_once_with_about_equal_bytes() -> None:
    ts = [torch.zeros(n) for n in (1000, 10, 400, 400, 300, 5, 200, 1)]
    groups = split_by_bytes(ts, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(ts)))
    loads = [sum(ts[i].numel() for i in g) for g in groups]
    assert max(loads) == 1000 and min(loads) >= 600  # the largest alone, the rest spread
    assert split_by_bytes(ts[:2], 8) == [[0], [1]]  # no more groups than tensors
    with pytest.raises(ValueError, match="groups: expected an int >= 1"):
        from mscale.hook.checks.weights import WeightWatch

        WeightWatch(object(), groups=0)


def _llava(groups: int, *, write: bool, steps: int = 14):
    """The tiny LLaVA in a plain loop with the README's line (in-memory snapshots every step);
    write: FC1's element 5 multiplied by 1024 between two steps, in the first window from step 6
    on whose checked group holds FC1 (the watch says which group it checks next)."""
    from support.tiny_hf import guarded

    model, make_batch, opt, guard, findings = guarded("rotation", healing=HealingSection(weight_groups=groups))
    watch = guard.fuse.states["restore_weights"].watch
    due: list[str] = []
    written = None
    try:
        while guard.current_step < steps:
            due.append(watch.due)
            if write and written is None and guard.current_step >= 6 and FC1 in watch.names[watch.due]:
                guard.snapshots.wait_copy()  # the newest snapshot's copy landed: an in-place repair
                with torch.no_grad():
                    dict(model.named_parameters())[FC1].view(-1)[5] *= 1024
                written = guard.current_step
            batch = make_batch(guard.current_step, torch.Generator().manual_seed(guard.current_step))
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
    finally:
        guard.detach()
    return model, findings, due, written, watch


def test_each_window_checks_one_group_in_turn_and_a_write_in_its_window_is_found_and_repaired() -> None:
    clean, quiet, due, _, watch = _llava(4, write=False)
    assert len(watch.trained_keys) == 4
    assert due[:8] == watch.trained_keys * 2  # every trained weight once in 4 windows
    assert not quiet
    hit, findings, _, written, _ = _llava(4, write=True)
    assert written is not None and 6 <= written < 6 + 4  # within the rotation's bound
    (f,) = [f for f in findings if f.reason.value == "weight_corruption"]
    assert (f.labels["step"], f.labels["mpu"], f.labels["tensor"]) == (str(written), "vision", FC1)
    (fixed,) = [f for f in findings if f.reason.value == "heal_action" and f.labels.get("action") == "restore_weights"]
    assert fixed.labels["repair"] == "in_place"
    sa, sb = clean.state_dict(), hit.state_dict()
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []  # bitwise the fault-free run


def test_under_ddp_a_weight_written_on_one_rank_is_found_within_the_replica_bound_and_repaired(
    tmp_path: Path,
) -> None:
    """Rank 1's vision weight written before step 3's forward; the replicas compare every
    `replica_check_steps` (8) steps, at the end of step 7: found there, named by rank, MPU and
    tensor, copied back from rank 0; both ranks bitwise equal afterwards."""
    every = HealingSection().replica_check_steps
    assert every == 8
    ranks = run_job(tmp_path, world=2, scenario="corrupt", fault_rank=1, fault_at=3, replica_every=every, steps=10)
    for r in ranks:
        assert r["repairs"] == [{"step": 7, "mpu_id": "001", "ranks": [1], "from_rank": 0, "ok": True}]
    ends = [[e["hash"] for e in r["ends"]] for r in ranks]
    assert ends[0][:3] == ends[1][:3]
    assert all(ends[0][s] != ends[1][s] for s in range(3, 8))  # diverged from step 3 (recorded before the check)
    assert ends[0][8:] == ends[1][8:] and len(ends[0]) == 10  # equal from the repair on
    labels = [lab for reason, lab in ranks[1]["replica_findings"] if reason == "replica_diverged"]
    assert labels and labels[0]["mpu_id"] == "001" and labels[0]["rank"] == "1"
    assert labels[0]["tensor"] == "module.vision_tower.pos"
    assert not ranks[0]["replica_findings"]
