"""The fuse under FSDP2: every level of it on one rank keeps every rank's collectives in step.

Two gloo ranks train the tiny Hugging Face LLaVA `fully_shard`ed on each CLIP and Llama layer,
attached with the README's line (tests/support/fsdp_fuse_job.py). This test's own forward hook
puts noise of the output's standard deviation on rank 1's last vision `fc2` output on every
step from step 3, and one failing step per level takes the vision MPU through L1 (swap), L2
(reduced resolution, bf16) and L3 (distillation) on rank 1 alone. A forward of that MPU re-run
on rank 1 alone would all-gather alone (gloo: "Received data size doesn't match expected size"):
the step is re-run by every rank instead."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support import free_port
from support.ddp_run import run_group

pytest.importorskip("transformers")

STEPS = 12
FAULT_FROM = 3


def run(tmp_path: Path, **opts: object) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "tests/support/fsdp_fuse_job.py", "--port", str(free_port()), "--out", str(out)]
    argv += ["--steps", str(STEPS), "--fault-from", str(FAULT_FROM)]
    for k, v in opts.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    log = tmp_path / "job.log"
    code = run_group(argv, log, timeout_s=300)
    assert code == 0, log.read_text()[-3000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_every_fuse_level_on_one_fsdp2_rank_keeps_the_collectives_in_step(tmp_path: Path) -> None:
    calm, faulty = run(tmp_path)
    applied = [a for a, result, _ in faulty["heal"] if result == "applied"]
    for action in ("l1_swap", "l2_degrade", "l3_distill"):
        assert action in applied, faulty["heal"]
    assert faulty["vision_level"] == "l3_distilling" and calm["vision_level"] == "healthy"
    assert faulty["hits"] > 0 and calm["hits"] == 0  # the fault was on rank 1 alone
    swap = next(detail for a, _, detail in faulty["heal"] if a == "l1_swap")
    assert "sharded (FSDP2): its shards stay on cpu" in swap  # nothing moved off the group's device
    degrade = next(detail for a, _, detail in faulty["heal"] if a == "l2_degrade")
    assert "images at 16x16 of 32x32" in degrade and "forward in bf16" in degrade
    for r in (calm, faulty):
        assert r["final_step"] == STEPS  # both ranks reached the target step, in the same calls
        assert r["finite"]
        assert r["reruns"] == 0  # no forward of an MPU re-run on one rank alone
    assert calm["calls"] == faulty["calls"] < STEPS + 3 * (FAULT_FROM + 1)  # a re-run per level at most
    # every all-gather, reduce-scatter and all-reduce issued by one rank was issued by the other
    assert calm["collectives"] == faulty["collectives"]
    assert calm["collectives"]["all_gather_single"] > 0 and calm["collectives"]["reduce_scatter_single"] > 0


def test_l2_finds_its_reduction_behind_the_fallback_it_installs_first() -> None:
    """L2 puts the fallback's forward wrapper (bf16 here; the CPU's device boundary on a GPU) on
    the tower before its reduction, whose family is read from the forward's parameters: the
    wrapper's `*args, **kwargs` must not hide the class's `interpolate_pos_encoding`."""
    import torch

    from mscale.hook.fuse.actions.degrade import bf16_fallback
    from mscale.hook.fuse.degrade import reduction_for
    from support.tiny_hf import tiny_llava

    model, make_batch = tiny_llava(seed=0, image=32)
    tower = model.model.vision_tower
    fallback = bf16_fallback(tower)
    reduction = reduction_for(tower, 0.5)
    assert reduction is not None and reduction.kind == "vit"
    loss = model(**make_batch(0, torch.Generator().manual_seed(0))).loss
    assert reduction.calls == 1 and not reduction.failures and torch.isfinite(loss)
    reduction.undo()
    fallback.undo()
    assert "forward" not in tower.__dict__
