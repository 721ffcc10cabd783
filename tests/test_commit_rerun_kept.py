"""A step whose run again fails at the commit point keeps its update, less the failing MPU's
gradient (docs/healing.md, Forward progress): under commit verdicts a persistent finite fault
costs each failing step one call, not its update, as in-step verdicts keep a failed forward's.
One process, the tiny model, the fault from the test's own forward hook on the vision tower's
patch embedding (noise of the output's own std on every forward from step FAULT_AT on)."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch

import mscale
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

FAULT_AT = 3


@pytest.fixture
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.usefixtures("_quiet")
def test_a_step_failing_again_after_its_re_run_keeps_its_update_but_the_failing_mpus_gradient() -> None:
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = mscale.ResumableLoader(SyntheticCaptions(cfg, size=64, seed=0), batch_size=2, seed=0)
    guard = mscale.attach(
        model,
        opt,
        job_id="kept",
        connect=False,
        checksum=mscale.ChecksumConfig(full=True, verdicts="commit"),
        snapshots=mscale.SnapshotConfig(memory_every=1),
        data=loader,
    )
    on = torch.zeros(())

    def noise(module, args, out):  # the test's own fault, in front of the guard's check
        return out + on * out.detach().std() * torch.randn_like(out)

    model.vision_tower.patch_embed.register_forward_hook(noise, prepend=True)
    before: dict[str, list[torch.Tensor]] = {}
    consumed: list[tuple[int, list[int]]] = []
    batches = iter(loader)
    try:
        for _ in range(12):
            step = guard.current_step
            if step > FAULT_AT:
                break
            on.fill_(1.0 if step >= FAULT_AT else 0.0)
            if step == FAULT_AT and not before:
                before = {"vision": _params(model.vision_tower), "text": _params(model.language_model)}
            b = next(batches)
            consumed.append((step, b["index"].tolist()))
            model(b["images"], b["tokens"])["loss"].backward()
            opt.step()
            opt.zero_grad()
    finally:
        guard.detach()
    runs = [ids for s, ids in consumed if s == FAULT_AT]
    assert len(runs) == 2 and runs[0] == runs[1]  # failed, run again on its own batch
    # the second run failed too: its update kept for the rest of the model, not for the vision MPU
    assert _same(_params(model.vision_tower), before["vision"])
    assert not _same(_params(model.language_model), before["text"])
    assert guard.fuse.progress.ledger.lost == 1  # the first run alone is lost
    assert guard.fuse.progress.reruns_kept == [FAULT_AT] and guard.fuse.progress.reruns_skipped == []
    assert all(torch.isfinite(p).all() for p in model.parameters())
