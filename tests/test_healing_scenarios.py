"""The fuse end to end: the tiny multimodal model trained on CPU with faults injected, each run
compared with the same run without faults. Each test asserts the events, the metrics (rendered
by the healing exporter from the fuse's books) and the training outcome."""

from __future__ import annotations

import logging
import math

import pytest
import structlog
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from mscale.daemon.exporters.healing import families
from mscale.demo.scenario import Fault, RunConfig, relative_gap, run

STEPS = 100


@pytest.fixture(autouse=True)
def quiet_logs():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="module")
def reference():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    return run(RunConfig(steps=STEPS))


def metrics(result) -> dict[tuple, float]:
    """The healing metrics as Prometheus would scrape them: {(name, sorted labels): value}."""

    class C:
        def collect(self):
            return families(result.fuse.books)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def heal(result, action, result_label="applied"):
    return [(int(f.labels["step"]), f) for f in result.actions(action, result_label)]


def states(result, mpu_id="001"):
    return [
        (int(f.labels["step"]), f.labels["state"])
        for f in result.events("fuse_state")
        if f.labels.get("mpu_id") == mpu_id
    ]


def test_reference_run_learns_without_actions(reference):
    losses = [loss for _, loss in reference.losses]
    assert losses[-1] < losses[0] * 0.8  # it learns
    assert not reference.events("heal_action") and reference.steps_lost == 0


def test_an_mpu_no_fuse_holds_reports_healthy():
    from torch import nn

    from mscale.hook.core.mpu import Mpu

    # what a guard without the fuse plugin registers with the agent
    assert Mpu("001", "vision", nn.Linear(2, 2), "", 0).describe().fuse_level == "healthy"


def test_vision_corruption_for_20_steps_heals_at_l1_without_losing_a_step(reference):
    r = run(RunConfig(steps=STEPS, faults=(Fault(30, "corrupt", {"gpu": 0, "mode": "noise", "steps": 20}),)))
    assert r.guard.plugin_errors == 0  # no action raised inside a guard hook
    ((swap_step, swap),) = heal(r, "l1_swap")
    assert swap_step == 32  # the third consecutive failing step (checksum_failures_l1 = 3)
    assert swap.labels["mpu_id"] == "001" and swap.labels["gpu"] == "0" and swap.labels["to_gpu"] == "3"
    assert r.guard.mpu("vision").gpu == 3
    # the swapped step's output was re-run on the standby: no failure from step 32's re-run on
    fails = [int(f.labels["step"]) for f in r.events("checksum_failure")]
    assert fails == [30, 31, 32]
    inj = r.chaos.injectors or []
    assert all(h.step <= 32 for i in inj for h in i.hits)
    assert states(r)[:2] == [(30, "suspect"), (32, "l1_swapped")]
    # the state machine's own history counts training steps too (not the fuse's dedup keys)
    history = r.fuse.engine.mpu("tinymm", "001").history
    assert [(t.step, t.after.value) for t in history][:2] == [(30, "suspect"), (32, "l1_swapped")]
    assert "recovered" in [s for _, s in states(r)]  # clean stretch after the swap
    assert r.steps_lost == 0 and not r.events("rollback")
    assert relative_gap(r.eval_loss, reference.eval_loss) < 0.02
    m = metrics(r)
    assert (
        m[
            (
                "mscale_heal_actions_total",
                (("action", "l1_swap"), ("level", "L1"), ("mpu_id", "001"), ("result", "applied")),
            )
        ]
        == 1
    )
    assert m[("mpu_drift_count_total", (("job_id", "tinymm"), ("mpu_id", "001")))] == 1


def test_corruption_persisting_on_the_standby_escalates_to_l2(reference):
    faults = (
        Fault(30, "corrupt", {"gpu": 0, "mode": "noise", "steps": 20}),
        Fault(30, "corrupt", {"gpu": 3, "mode": "noise", "steps": 4}),
    )  # the standby is faulty too
    r = run(RunConfig(steps=STEPS, faults=faults))
    assert r.guard.plugin_errors == 0  # no action raised inside a guard hook
    assert [s for _, s in states(r)][:3] == ["suspect", "l1_swapped", "l2_degraded"]
    ((l2_step, l2),) = heal(r, "l2_degrade")
    assert l2_step == 34 and l2.labels["level"] == "L2"
    assert "fallback" not in l2.labels  # on CPU with l2_precision_fallback off (the default): none
    assert not heal(r, "l3_distill")  # the degraded run came clean: no L3
    ((rec_step, _),) = heal(r, "recover")  # after a clean stretch the degradation is undone
    assert rec_step > l2_step and "001" not in r.fuse.states["l2_degrade"].mpus
    assert r.guard.cmsa.multiplier["001"] == 1.0  # the raised clip threshold reset
    lv = dict(r.levels)
    assert lv[l2_step + 1]["vision"] == "l2_degraded"
    assert r.steps_lost == 0 and math.isfinite(r.eval_loss)
    m = metrics(r)
    assert (
        m[
            (
                "mscale_heal_actions_total",
                (("action", "l2_degrade"), ("level", "L2"), ("mpu_id", "001"), ("result", "applied")),
            )
        ]
        == 1
    )
    assert m[("mscale_fuse_level", (("job_id", "tinymm"), ("mpu_id", "001")))] == 0  # recovered by the end


def test_l2_reduces_the_vision_input_resolution_and_raises_the_clip():
    from mscale.demo.scenario import Run
    from mscale.sim.tinymm import TinyConfig

    # 32x32 images, an 8x8 patch grid (the default 4x4 is below what L2 shrinks: no reduction)
    r = Run(RunConfig(steps=10, model_config=TinyConfig(image_size=32)))
    try:
        vision = r.guard.mpu("vision")
        patches = []
        h = vision.module.patch_embed.register_forward_pre_hook(lambda mod, args: patches.append(args[0].shape[1]))
        r.one_step()
        degraded = r.fuse.states["l2_degrade"]
        degraded.degrade(r.guard, vision)
        assert r.guard.cmsa.multiplier["001"] == 2.0  # the clip threshold raised
        r.one_step()
        degraded.undo(r.fuse, vision)
        r.one_step()
        h.remove()
        assert patches == [64, 16, 64]  # half resolution: a quarter of the patches, then restored
        assert r.guard.cmsa.multiplier["001"] == 1.0
        assert all(math.isfinite(loss) for _, loss in r.losses)
    finally:
        r.close()


def test_l2_precision_fallback_runs_the_degraded_mpu_in_bf16_until_recovery():
    from mscale.healing.settings import HealingSection

    # (step, dtype the vision tower's first Linear computed in): autocast casts its inputs inside
    # the op, so the hook's args stay fp32 and the output's dtype shows the GEMM's precision
    seen: list[tuple[int, torch.dtype]] = []

    def watch(r) -> None:
        if not getattr(r, "_watched", False):  # hooked once, on the first step
            r._watched = True
            patch = r.guard.mpu("vision").module.patch_embed
            patch.register_forward_hook(lambda mod, args, out: seen.append((r.guard.current_step, out.dtype)))

    faults = (
        Fault(30, "corrupt", {"gpu": 0, "mode": "noise", "steps": 20}),
        Fault(30, "corrupt", {"gpu": 3, "mode": "noise", "steps": 4}),
    )  # as in the L2 scenario
    healing = HealingSection(recovery_clean_steps=20, lr_cool_steps=10, l2_precision_fallback=True)
    r = run(RunConfig(steps=70, faults=faults, healing=healing, before_step=watch))
    assert r.guard.plugin_errors == 0  # no action raised inside a guard hook
    ((l2_step, l2),) = heal(r, "l2_degrade")
    assert l2.labels["fallback"] == "bf16" and "bf16" in l2.message
    ((rec_step, _),) = heal(r, "recover")
    assert l2_step < rec_step < 70
    by_step = {}
    for step, dtype in seen:
        by_step.setdefault(step, set()).add(dtype)
    assert all(by_step[s] == {torch.bfloat16} for s in range(l2_step + 1, rec_step)), by_step
    assert all(by_step[s] == {torch.float32} for s in range(rec_step + 1, 70))  # fp32 again after recovery
    assert all(by_step[s] == {torch.float32} for s in range(0, 30))
    assert "forward" not in r.guard.mpu("vision").module.__dict__  # the wrapper is gone
    assert all(math.isfinite(loss) for _, loss in r.losses) and not r.nonfinite_weights
    assert r.steps_lost == 0 and math.isfinite(r.eval_loss)


def test_run_degraded_on_cpu_autocasts_only_when_asked_and_undo_restores_the_forward():
    from torch import nn

    from mscale.hook.fuse.actions.degrade import run_degraded

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    inner: list[tuple[torch.dtype, bool]] = []
    m[0].register_forward_hook(lambda mod, args, out: inner.append((out.dtype, torch.is_autocast_enabled("cpu"))))
    ref = m(x)
    assert run_degraded(m) is None and m(x).dtype == torch.float32  # off by default: no fallback on CPU
    fb = run_degraded(m, precision=True)
    assert fb.kind == "bf16" and "forward" in m.__dict__
    out = m(x)
    assert out.dtype == torch.float32  # cast back to the input dtype
    assert torch.allclose(out, ref, rtol=0.05, atol=0.05) and not torch.equal(out, ref)
    fb.undo()
    assert "forward" not in m.__dict__ and torch.equal(m(x), ref)  # the class forward again, bit-exact
    assert inner == [(torch.float32, False), (torch.float32, False), (torch.bfloat16, True), (torch.float32, False)]


def test_corruption_persisting_in_l2_engages_l3_then_removes_it_after_recovery(reference):
    r = run(RunConfig(steps=STEPS, faults=(Fault(20, "corrupt", {"mpu": "vision", "mode": "noise", "steps": 25}),)))
    assert r.guard.plugin_errors == 0  # no action raised inside a guard hook
    seq = [s for _, s in states(r)]
    assert seq == ["suspect", "l1_swapped", "l2_degraded", "l3_distilling", "recovered", "healthy"]
    ((l3_step, _),) = heal(r, "l3_distill")
    ((rec_step, _),) = heal(r, "recover")
    assert l3_step == 26 and rec_step > 45
    booked = r.fuse.states["l3_distill"].shares
    assert booked and {s for s, *_ in booked} == set(range(l3_step, rec_step + 1))  # incl. the recovery step
    assert [s for s, *_, calibrating in booked if calibrating] == [l3_step]  # the first step sets the weight
    # every later step uses the weight set from the step before: the share is measured, not solved
    shares = [(s, share) for s, _, share, _, calibrating in booked if not calibrating]
    lo, hi = 0.15, 0.30
    assert all(lo <= share <= hi for _, share in shares), shares
    assert not r.fuse.states["l3_distill"].mpus  # removed on recovery
    assert r.steps_lost == 0 and math.isfinite(r.eval_loss) and not r.nonfinite_weights
    m = metrics(r)
    assert (
        m[
            (
                "mscale_heal_actions_total",
                (("action", "l3_distill"), ("level", "L3"), ("mpu_id", "001"), ("result", "applied")),
            )
        ]
        == 1
    )
    assert m[("mscale_fuse_state", (("job_id", "tinymm"), ("mpu_id", "001"), ("state", "healthy")))] == 1


def test_a_25x_loss_spike_cools_the_lr_without_a_rollback(reference):
    r = run(RunConfig(steps=STEPS, faults=(Fault(60, "loss_spike", {"factor": 25.0}),)))
    assert r.guard.plugin_errors == 0  # no action raised inside a guard hook
    spike = [loss for s, loss in r.losses if s == 60][0]
    assert spike > 10 * [loss for s, loss in reference.losses if s == 60][0]
    ((cool_step, cool),) = heal(r, "lr_cool")
    assert cool_step == 60
    lrs = dict(r.lrs)
    base = lrs[59]
    window = range(60, 60 + r.fuse.cfg.lr_cool_steps)
    assert all(lrs[s] == pytest.approx(base * 0.1) for s in window)
    assert lrs[window[-1] + 1] == base  # restored after the window
    assert heal(r, "lr_cool", "ended")
    assert (
        not r.events("rollback")
        and not [f for f in r.events("heal_action") if f.labels.get("action") == "rollback"]
        and r.steps_lost == 0
    )
    assert relative_gap(r.eval_loss, reference.eval_loss) < 0.02
    m = metrics(r)
    assert (
        m[
            (
                "mscale_heal_actions_total",
                (("action", "lr_cool"), ("level", "none"), ("mpu_id", ""), ("result", "applied")),
            )
        ]
        == 1
    )


def test_nan_loss_rolls_back_skips_the_batch_and_never_reaches_the_weights(reference):
    r = run(RunConfig(steps=STEPS, faults=(Fault(62, "nan_loss", {}),)))
    assert r.guard.plugin_errors == 0  # no action raised inside a guard hook
    assert [loss for s, loss in r.losses if s == 62 and math.isnan(loss)]
    ((drop_step, restored),) = heal(r, "rollback")  # one event per rollback: the drop and the restore
    assert restored.labels["result"] == "applied"
    assert drop_step == 62 and "update of step 62 dropped, restored step 60" in restored.message
    (rb,) = r.events("rollback")  # the snapshot engine's own event
    assert not r.nonfinite_weights
    bad = [b for s, b in r.batches if s == 62][0]
    later = [b for s, b in r.batches[r.batches.index((62, bad)) + 1 :]]
    assert bad not in later  # the offending batch was skipped
    assert [s for s, _ in r.batches].count(61) == 2  # step 61 redone from the snapshot of step 60
    assert r.steps == STEPS and r.steps_lost == 2
    assert relative_gap(r.eval_loss, reference.eval_loss) < 0.02
    m = metrics(r)
    assert (
        m[
            (
                "mscale_heal_actions_total",
                (("action", "rollback"), ("level", "none"), ("mpu_id", ""), ("result", "applied")),
            )
        ]
        == 1
    )
    # the gradient-norm detectors report the same fault in the same step: acted on once, and
    # booked once (one heal event per action, no "duplicate" event per repeated finding)
    duplicate = ("result", "duplicate")
    assert not [k for k in m if k[0] == "mscale_heal_actions_total" and duplicate in k[1]]
