"""A weight written outside the fingerprint rotation's window whose output stays finite (a
compiled model's, or a write too small to overflow) is found when its group is next recorded:
its largest magnitude grew beyond any optimizer step (mscale.hook.checks.weights `_peaks`), and
the fuse checks its MPU's weights against the snapshots and repairs them (docs/healing.md,
Weight corruption). One process, the tiny model, the test's own direct write into a vision
weight, at a step whose checked group does not hold it."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch

import mscale
from mscale.findings import Reason
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

NAME = "vision_tower.patch_embed.weight"
WRITTEN = 1e9  # finite through the tiny model's forward; no optimizer step gets near it


@pytest.fixture
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


@pytest.mark.usefixtures("_quiet")
def test_a_weight_written_outside_its_groups_window_is_found_and_repaired() -> None:
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = mscale.ResumableLoader(SyntheticCaptions(cfg, size=256, seed=0), batch_size=2, seed=0)
    found: list = []

    class Findings:
        def on_finding(self, f) -> None:
            found.append(f)

    guard = mscale.attach(
        model,
        opt,
        job_id="peaks",
        connect=False,
        plugins=[Findings()],
        snapshots=mscale.SnapshotConfig(memory_every=4),
        data=loader,
    )
    watch = guard.fuse.states["restore_weights"].watch
    weight = model.vision_tower.patch_embed.weight
    written_at = None
    batches = iter(loader)
    try:
        for _ in range(40):
            step = guard.current_step
            if step >= 24:
                break
            if written_at is None and step >= 6 and NAME not in watch.names[watch.due]:
                with torch.no_grad():
                    weight.view(-1)[0] = WRITTEN  # the next check compares another group
                written_at = step
            b = next(batches)
            model(b["images"], b["tokens"])["loss"].backward()
            opt.step()
            opt.zero_grad()
    finally:
        guard.detach()
    assert written_at is not None
    hit = [f for f in found if f.reason is Reason.WEIGHT_CORRUPTION and f.labels.get("tensor") == NAME]
    assert hit and hit[0].labels["mpu_id"] == guard.mpu("vision").mpu_id
    assert float(weight.detach().abs().max()) < 10.0  # repaired from a snapshot before the write
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
