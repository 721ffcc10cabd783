"""Loss and gradient-norm statistics on synthetic curves."""

from __future__ import annotations

import math
import random

import pytest

from mscale.findings import Reason, Severity
from mscale.hook.loss import LossConfig, LossDetector


def curve(n: int, seed: int = 0, start: float = 4.0, end: float = 2.0, noise: float = 0.02) -> list[float]:
    """A training loss: exponential-ish decay with multiplicative noise."""
    rng = random.Random(seed)
    return [(end + (start - end) * math.exp(-i / (n / 4))) * (1 + rng.gauss(0, noise)) for i in range(n)]


def run(values, det: LossDetector | None = None, series: str = "loss"):
    det = det or LossDetector()
    out = []
    for step, v in enumerate(values):
        if series == "loss":
            out += det.observe(step, v)
        else:
            out += det.observe(step, None, grad_norm=v, mpu_grad_norms={"002": v})
    return out


def test_clean_curve_no_action() -> None:
    findings = run(curve(1000))
    assert [f for f in findings if f.severity is Severity.CRITICAL] == []
    # 3 sigma on a noisy curve warns rarely (that is what a warning threshold is for)
    assert len(findings) <= 10


def test_25x_spike_is_an_action_and_a_jump() -> None:
    values = curve(300)
    values[200] *= 25
    findings = run(values)
    at = [f for f in findings if f.labels["step"] == "200"]
    assert {f.reason for f in at} == {Reason.LOSS_JUMP}  # the jump outranks the spike level
    assert at[0].severity is Severity.CRITICAL
    # a 25x spike without the jump test is a 6-sigma action
    det = LossDetector(LossConfig(jump_ratio=1000))
    at = [f for f in run(values, det) if f.labels["step"] == "200"]
    assert [f.reason for f in at] == [Reason.LOSS_SPIKE_ACTION] and "sigma" in at[0].message


def test_one_spike_does_not_blind_the_detector_to_the_next() -> None:
    values = curve(300)
    values[150] *= 25
    values[152] *= 25
    steps = {f.labels["step"] for f in run(values) if f.severity is Severity.CRITICAL}
    assert {"150", "152"} <= steps
    assert "151" not in steps and "153" not in steps  # back to normal right after


def test_warn_between_5_and_10_sigma_above_the_baseline() -> None:
    values = [2.0 * (1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(100)]  # flat: the scale is its floor
    det = LossDetector()
    run(values, det)
    s = det.series["loss"]
    assert s.location_scale()[2] == det.config.scale_floor
    assert det.observe(100, s.bound(4.9)) == []
    (f,) = det.observe(101, s.bound(5.5))
    assert f.reason is Reason.LOSS_SPIKE_WARN and f.severity is Severity.WARNING and f.labels["level"] == "warn"
    (f,) = det.observe(102, s.bound(10.5))
    assert f.reason is Reason.LOSS_SPIKE_ACTION
    assert det.observe(103, s.bound(-50)) == []  # a drop is not a spike


def test_the_baseline_follows_a_trend_and_warm_up_is_quiet() -> None:
    """Early training: the loss falls 20x in 30 steps, gradient norms rise 8x and fall back;
    nothing alarms, and after it a 10x gradient-norm jump is still caught."""
    loss = [5.0 * math.exp(-i / 10) + 0.2 for i in range(120)]
    grad = [1.0 + 7.0 * math.sin(math.pi * min(i, 40) / 40) for i in range(120)]
    det = LossDetector()
    found = [f for i, (a, g) in enumerate(zip(loss, grad, strict=True)) for f in det.observe(i, a, g)]
    assert found == []
    (f,) = det.observe(120, loss[-1], grad[-1] * 10)
    assert f.reason in (Reason.GRAD_NORM_SPIKE, Reason.GRAD_NORM_JUMP) and f.labels["step"] == "120"


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite(bad: float) -> None:
    values = curve(50)
    values[30] = bad
    findings = run(values)
    (f,) = [f for f in findings if f.labels["step"] == "30"]
    assert f.reason is Reason.LOSS_NONFINITE and f.severity is Severity.CRITICAL
    # the bad value never enters the window
    assert not any(f.labels["step"] in ("31", "32") for f in findings if f.severity is Severity.CRITICAL)


def test_slow_drift_does_not_alarm() -> None:
    rng = random.Random(1)
    # loss creeping up 0.05% a step (a slowly diverging run) under 2% noise
    values = [2.0 * (1.0005**i) * (1 + rng.gauss(0, 0.02)) for i in range(2000)]
    findings = run(values)
    assert [f for f in findings if f.severity is Severity.CRITICAL] == []
    assert values[-1] > 2.4 * values[0] / 1.05  # it did drift by more than 2x over the run
    # and a noiseless ramp neither
    assert run([1.0 + i * 1e-3 for i in range(1000)]) == []


def test_grad_norms_global_and_per_mpu() -> None:
    values = curve(200, start=1.0, end=0.5, noise=0.05)
    values[120] *= 25
    values[150] = math.nan
    findings = run(values, series="grad")
    at = [f for f in findings if f.labels["step"] == "120"]
    assert {(f.reason, f.labels["series"], f.labels.get("mpu_id")) for f in at} == {
        (Reason.GRAD_NORM_JUMP, "grad_norm", None),
        (Reason.GRAD_NORM_JUMP, "mpu_grad_norm", "002"),
    }
    det = LossDetector(LossConfig(jump_ratio=1000))
    at = [f for f in run(values, det, series="grad") if f.labels["step"] == "120"]
    assert {f.reason for f in at} == {Reason.GRAD_NORM_SPIKE} and all(f.severity is Severity.CRITICAL for f in at)
    nan = [f for f in findings if f.labels["step"] == "150"]
    assert {f.reason for f in nan} == {Reason.GRAD_NORM_NONFINITE}


def test_config_checked() -> None:
    with pytest.raises(ValueError, match="warn_sigma"):
        LossConfig(warn_sigma=7, action_sigma=6)
    with pytest.raises(ValueError, match="jump_ratio"):
        LossConfig(jump_ratio=1)
    with pytest.raises(ValueError, match="min_history"):
        LossConfig(window=5, min_history=10)


def test_recorded_tinymm_curve() -> None:
    """The loss of a real run of the tiny model (recorded here, 300 steps): no action on the
    clean curve, and the same curve with a 25x spike spliced in is caught at that step."""
    import torch

    from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        cfg = TinyConfig(image_size=8, vision_hidden=16, text_hidden=16, vision_layers=1, text_layers=1, seq_len=4)
        model = TinyMultimodal(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = SyntheticCaptions(cfg, size=10_000)
        recorded = []
        for i in range(300):
            b = torch.utils.data.default_collate([data[i * 4 + j] for j in range(4)])
            loss = model(b["images"], b["tokens"])["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()
            recorded.append(loss.item())
    finally:
        torch.set_num_threads(n)
    assert recorded[-1] < recorded[0]  # it trained
    assert [f for f in run(recorded) if f.severity is Severity.CRITICAL] == []
    spiked = list(recorded)
    spiked[250] *= 25
    assert {f.labels["step"] for f in run(spiked) if f.severity is Severity.CRITICAL} == {"250"}
