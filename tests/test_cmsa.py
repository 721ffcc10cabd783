"""CMSA: per-MPU clipping clip_i = base * mult_i * (1 + alpha * GVC_i), alpha fitted at cold start."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mscale.hook.checks.cmsa import GVC_EVERY, Cmsa, CmsaConfig, GradStatistics, grad_stats
from mscale.hook.core.attach import attach
from mscale.hook.core.mpu import discover
from mscale.hook.core.protect import SnapshotConfig
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal


def two_mpus():
    model = nn.Module()
    model.vision_tower = nn.Linear(4, 3)
    model.language_model = nn.Linear(3, 2)
    return model, discover(model)


def guarded_tiny(cmsa: CmsaConfig, **attach_kw: object):
    """A guarded TinyMultimodal with `cmsa`, and a function that trains its step i."""
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = attach(model, opt, job_id="c", connect=False, cmsa=cmsa, **attach_kw)
    data = SyntheticCaptions(cfg)

    def step(i: int) -> None:
        b = torch.utils.data.default_collate([data[i * 4 + j] for j in range(4)])
        model(b["images"], b["tokens"])["loss"].backward()
        opt.step()
        opt.zero_grad()

    return guard, step


def set_grads(model, vision: torch.Tensor, text: torch.Tensor) -> None:
    for p in model.vision_tower.parameters():
        p.grad = vision[: p.numel()].reshape(p.shape).clone()
    for p in model.language_model.parameters():
        p.grad = text[: p.numel()].reshape(p.shape).clone()


def test_grad_stats_match_the_definition() -> None:
    torch.manual_seed(0)
    model, mpus = two_mpus()
    set_grads(model, torch.randn(20) + 0.3, torch.randn(20) * 5)
    total, per = grad_stats(mpus, model.parameters())
    for m in mpus:
        g = torch.cat([p.grad.flatten() for p in m.parameters()]).double()
        norm, gvc = per[m.mpu_id]
        assert norm == pytest.approx(g.norm().item(), rel=1e-6)
        # GVC = std / mean(|g|), population std
        assert gvc == pytest.approx((g.std(unbiased=False) / g.abs().mean()).item(), rel=1e-6)
    every = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    assert total == pytest.approx(every.norm().item(), rel=1e-6)


def test_grad_stats_without_gvc_gives_the_same_norms() -> None:
    torch.manual_seed(0)
    model, mpus = two_mpus()
    set_grads(model, torch.randn(20) + 0.3, torch.randn(20) * 5)
    total, per = grad_stats(mpus, model.parameters())
    total_only, norms_only = grad_stats(mpus, model.parameters(), gvc=False)
    assert total_only == total
    assert {k: v[0] for k, v in norms_only.items()} == {k: v[0] for k, v in per.items()}
    assert all(v[1] is None for v in norms_only.values())


def test_norms_offered_this_step_are_reused_only_while_their_gradient_is_unchanged() -> None:
    """GradStatistics.offer: a norm the gradient check already took is not taken again, as long
    as it is the same gradient tensor, unchanged; a gradient written in place since, or replaced,
    is read again. (A planted wrong norm shows which one was used.)"""
    torch.manual_seed(0)
    model, mpus = two_mpus()
    set_grads(model, torch.randn(20) + 0.3, torch.randn(20) * 5)
    true = GradStatistics().measure(mpus, list(model.parameters()), step=0, scheduled=True)
    w = model.vision_tower.weight
    stats = GradStatistics()
    stats.offer(w, torch.tensor(1000.0))
    planted = stats.measure(mpus, list(model.parameters()), step=1, scheduled=True)
    assert planted > 999.0 and mpus[0].grad_norm > 999.0  # used: the pass skipped that gradient
    assert GradStatistics().measure(mpus, list(model.parameters()), step=1, scheduled=True) == true
    assert stats.measure(mpus, list(model.parameters()), step=2, scheduled=True) == true  # used once
    stats.offer(w, torch.tensor(1000.0))
    w.grad.mul_(1.0)  # written in place: a new version
    assert stats.measure(mpus, list(model.parameters()), step=3, scheduled=True) == true
    stats.offer(w, torch.tensor(1000.0))
    w.grad = w.grad.clone()  # replaced
    assert stats.measure(mpus, list(model.parameters()), step=4, scheduled=True) == true


def test_norms_reused_from_the_gradient_check_change_nothing_bitwise() -> None:
    """A guarded run whose gradient check takes every norm (one group: the statistics reuse them
    all) and one without the check (the statistics take every norm themselves): the same norms
    at every step, the same weights at the end, bit for bit."""
    from mscale.healing.settings import HealingSection

    def run(groups: int) -> tuple[list[float], list[torch.Tensor]]:
        guard, step = guarded_tiny(CmsaConfig(), healing=HealingSection(gradient_groups=groups))
        norms = []
        for i in range(12):
            step(i)
            norms += [m.grad_norm for m in guard.mpus]
        return norms, [p.detach().clone() for p in guard.model.parameters()]

    shared, fresh = run(1), run(0)
    assert shared[0] == fresh[0] and all(math.isfinite(v) and v > 0 for v in shared[0])
    assert all(torch.equal(a, b) for a, b in zip(shared[1], fresh[1], strict=True))


def test_gvc_every_step_of_the_cold_start_then_one_step_in_gvc_every() -> None:
    """The guard re-estimates GVC at each cold-start step (the fit needs each one) and then one
    step in GVC_EVERY, keeping the last estimate in between."""
    guard, step = guarded_tiny(CmsaConfig(warmup_steps=6))
    seen: list[float] = []
    for i in range(20):
        step(i)
        seen.append(guard.mpu("vision").gvc)
    assert all(math.isfinite(g) and g > 0 for g in seen)
    changed = [i for i in range(1, 20) if seen[i] != seen[i - 1]]
    assert changed == [i for i in range(1, 20) if i < 6 or i % GVC_EVERY == 0]


def test_the_gvc_in_force_at_a_re_run_step_is_the_one_it_first_ran_with() -> None:
    """After a rollback a step between estimates uses the estimate made before it (not a later
    one from the abandoned steps), so the re-run clips as the first run did; a non-finite
    estimate is not kept in force."""
    torch.manual_seed(0)
    model, mpus = two_mpus()
    stats = GradStatistics()
    grads = {step: (torch.randn(20) * (1 + step), torch.randn(20) + step) for step in range(10)}

    def measure(step: int, scheduled: bool) -> float:
        set_grads(model, *grads[step])
        stats.measure(mpus, list(model.parameters()), step, scheduled)
        return mpus[0].gvc

    at0 = measure(0, True)
    assert measure(1, False) == at0  # between estimates: the one in force
    at4 = measure(4, True)
    assert at4 != at0
    assert measure(2, False) == at0  # re-run after a rollback to step 1: step 0's, not step 4's
    grads[8] = (torch.full((20,), math.inf), grads[8][1])
    assert math.isnan(measure(8, True))
    assert math.isfinite(measure(9, False))  # the non-finite estimate is redone


def test_cold_start_then_fit_then_clip() -> None:
    model, mpus = two_mpus()
    cmsa = Cmsa(mpus, CmsaConfig(base=1.0, warmup_steps=10, probe_alpha=0.1, alpha_max=1.0))
    big = torch.full((20,), 3.0)
    for step in range(10):
        set_grads(model, big, big)
        for m in mpus:
            m.grad_norm, m.gvc = grad_stats(mpus, model.parameters())[1][m.mpu_id]
            m.gvc = 0.5 + 0.1 * step  # GVC rising with...
        loss = 5.0 - 0.01 * step * step  # ...bigger loss improvements: noisy gradients went with progress
        clipped = cmsa.apply(step, loss)
        if step < 5:
            assert clipped == {} and cmsa.alpha is None  # unclipped
            assert all(torch.equal(p.grad, big[: p.numel()].reshape(p.shape)) for p in model.parameters())
        else:
            assert cmsa.alpha == 0.1 and all(clipped.values())
    set_grads(model, big, big)
    for m in mpus:
        m.grad_norm = grad_stats(mpus, model.parameters())[1][m.mpu_id][0]
        m.gvc = 2.0
    cmsa.apply(10, 2.0)
    assert cmsa.rho == pytest.approx(1.0) and cmsa.alpha == pytest.approx(1.0)
    for m in mpus:
        clip = 1.0 * (1 + 1.0 * 2.0)
        assert cmsa.clip[m.mpu_id] == clip
        norm = torch.cat([p.grad.flatten() for p in m.parameters()]).norm().item()
        assert norm == pytest.approx(clip, rel=1e-5)  # scaled down to the threshold
    assert cmsa.clip_ratio("001") == 1.0  # clipped at every step since clipping began


def test_fit_negative_correlation_keeps_alpha_small() -> None:
    model, mpus = two_mpus()
    cmsa = Cmsa(mpus, CmsaConfig(warmup_steps=6))
    for step in range(7):
        for m in mpus:
            m.grad_norm, m.gvc = 0.0, 1.0 + step
        cmsa.apply(step, 1.0 + 0.1 * step * step)  # noisier gradients went with a worsening loss
    assert cmsa.rho == pytest.approx(-1.0) and cmsa.alpha == pytest.approx(0.0)


def test_raise_threshold_for_the_l2_fuse() -> None:
    model, mpus = two_mpus()
    cmsa = Cmsa(mpus, CmsaConfig(warmup_steps=4))
    for m in mpus:
        m.gvc = 1.0
    before = cmsa.threshold(mpus[1])
    assert cmsa.raise_threshold("text", 4.0) == 4.0
    assert cmsa.threshold(mpus[1]) == pytest.approx(4 * before) and cmsa.threshold(mpus[0]) == pytest.approx(before)
    cmsa.reset_threshold(mpus[1])
    assert cmsa.threshold(mpus[1]) == pytest.approx(before)
    with pytest.raises(ValueError, match="factor"):
        cmsa.raise_threshold("text", 0)
    with pytest.raises(KeyError, match="no MPU 'audio'"):
        cmsa.raise_threshold("audio", 2)


def test_cmsa_in_training_reports_clip_ratio() -> None:
    guard, step = guarded_tiny(CmsaConfig(base=0.05))
    for i in range(30):
        step(i)
    assert guard.cmsa.alpha is not None and guard.cmsa.steps == 25
    report = guard._report()
    ratios = {k: v.clip_ratio for k, v in report.mpus.items()}
    assert ratios["003"] > 0.5  # the text model's gradients are far above a 0.05 base
    assert all(0.0 <= r <= 1.0 for r in ratios.values())
    assert not math.isnan(guard.mpu("text").gvc)


def test_snapshots_hold_cmsa_state_and_a_rollback_restores_it() -> None:
    """The fitted alpha, the cold start's progress and the kept GVC estimates are in every
    snapshot (extra "cmsa"): a rollback into the cold start takes CMSA back there, and a
    snapshot from before they were held still restores, leaving CMSA as it is."""
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snapshots = SnapshotConfig(memory_every=1, memory_keep=8)
    guard = attach(
        model, opt, job_id="c", connect=False, cmsa=CmsaConfig(base=0.05, warmup_steps=4), snapshots=snapshots
    )
    data = SyntheticCaptions(cfg)
    held = {}
    for i in range(8):
        b = torch.utils.data.default_collate([data[i * 4 + j] for j in range(4)])
        model(b["images"], b["tokens"])["loss"].backward()
        opt.step()
        opt.zero_grad()
        held[i] = (copy.deepcopy(guard.cmsa.state_dict()), copy.deepcopy(guard._grad_stats.state_dict()))
    assert held[2][0]["rho"] is None and held[7][0]["rho"] is not None  # fitted at step 4
    fitted = held[7]

    del guard.snapshots.latest(6).objects["extra"]["cmsa"]  # as a snapshot made before it was held
    guard.snapshots.rollback(6)
    assert (guard.cmsa.state_dict(), guard._grad_stats.state_dict()) == fitted  # left as it was
    guard.snapshots.rollback(2)
    assert (guard.cmsa.state_dict(), guard._grad_stats.state_dict()) == held[2]
    assert guard.cmsa.rho is None and guard.cmsa.alpha == 0.1  # probing again, as at step 2
    guard.detach()


def test_cmsa_state_of_other_mpus_is_refused_and_changes_nothing() -> None:
    _, mpus = two_mpus()
    cmsa = Cmsa(mpus, CmsaConfig(warmup_steps=4))
    state = cmsa.state_dict()
    state["clipped"] = {"009": 3}
    before = cmsa.state_dict()
    with pytest.raises(ValueError, match=r"MPUs \['009'\] are not this guard's"):
        cmsa.load_state_dict(state)
    assert cmsa.state_dict() == before
