"""ABFT and replay checksums on the tiny multimodal model trained on CPU, with injected corruption."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mscale.findings import Reason
from mscale.hook.checks.checksum import DEFAULT_RTOL, ChecksumConfig
from mscale.hook.core.attach import attach
from mscale.sim.inject import corrupt, inject
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

CFG = TinyConfig()


class Findings:
    def __init__(self) -> None:
        self.items = []

    def on_finding(self, f) -> None:
        self.items.append(f)

    def of(self, *reasons: Reason, mpu: str | None = None, step: int | None = None):
        return [
            f
            for f in self.items
            if f.reason in reasons
            and (mpu is None or f.labels.get("mpu") == mpu)
            and (step is None or f.labels.get("step") == str(step))
        ]


def job(seed: int = 0, cfg: TinyConfig = CFG, batch: int = 8, autocast: bool = False, **kw):
    torch.manual_seed(seed)
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = Findings()
    # every layer every step: these tests are about what a check sees, not the rotation
    # (tests/test_checksum_budget.py)
    kw.setdefault("checksum", ChecksumConfig(replay_every=0, full=True))
    guard = attach(model, opt, job_id="t", connect=False, plugins=[rec], cmsa=False, **kw)
    data = SyntheticCaptions(cfg, size=100_000, seed=seed)
    state = {"i": 0}

    def train(n: int) -> None:
        for _ in range(n):
            b = torch.utils.data.default_collate([data[state["i"] * batch + j] for j in range(batch)])
            state["i"] += 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(b["images"], b["tokens"])["loss"]
            loss.float().backward()
            opt.step()
            opt.zero_grad()

    return guard, train, rec


FAIL = (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)


@pytest.mark.parametrize("mpu", ["vision", "aligner", "text"])
@pytest.mark.parametrize("kind", ["exponent_flip", "mantissa_flip", "noise", "nan"])
def test_abft_detects_corruption_in_the_step_it_happens(kind: str, mpu: str) -> None:
    guard, train, rec = job()
    train(2)
    assert rec.of(*FAIL) == []
    # mantissa: the top mantissa bit of the largest element (a flip in a tiny element is
    # below the GEMM's own rounding, see probes/checksum.py); noise at 10% of the std
    inj = inject(
        guard,
        kind=kind,
        mpu=mpu,
        steps=1,
        seed=3,
        noise_scale=0.1,
        element="max" if kind == "mantissa_flip" else "random",
    )
    train(1)
    assert len(inj.hits) == 1 and inj.hits[0].step == 2
    hit = [f for f in rec.of(*FAIL, mpu=mpu, step=2) if f.labels["method"] in ("abft", "nonfinite")]
    assert hit, f"{kind} in {mpu} not detected at step 2"
    assert guard.mpu(mpu).checksum_failures_total >= 1
    if kind != "nan":
        # upstream MPUs are untouched, and finite corruption does not make them fail
        order = ["vision", "aligner", "text"]
        for other in order[: order.index(mpu)]:
            assert rec.of(*FAIL, mpu=other) == []


def test_three_consecutive_failures_make_an_l1_trigger() -> None:
    guard, train, rec = job()
    train(1)
    inject(guard, kind="exponent_flip", mpu="vision", steps=3)
    train(2)
    assert rec.of(Reason.CHECKSUM_L1_TRIGGER) == []
    train(1)
    (l1,) = rec.of(Reason.CHECKSUM_L1_TRIGGER)
    assert l1.labels["mpu_id"] == "001" and l1.labels["step"] == "3" and l1.labels["consecutive"] == "3"
    assert guard.mpu("vision").consecutive_failures == 3
    train(1)  # the corruption has stopped: the next clean check resets the run
    assert guard.mpu("vision").consecutive_failures == 0


def test_gpu_targeting_follows_the_binding() -> None:
    guard, train, rec = job()
    train(1)
    inj = inject(guard, kind="noise", noise_scale=0.1, gpu=1, steps=1000)  # simulated GPU 1: the aligner
    train(2)
    assert {h.mpu_id for h in inj.hits} == {"002"}
    assert len(rec.of(*FAIL, mpu="aligner")) >= 2
    guard.rebind("aligner", 5)  # an L1 swap to a healthy (simulated) GPU
    n_hits, n_fail = len(inj.hits), guard.mpu("aligner").checksum_failures_total
    train(3)
    assert len(inj.hits) == n_hits and guard.mpu("aligner").checksum_failures_total == n_fail
    assert guard.mpu("aligner").consecutive_failures == 0
    guard.rebind("text", 1)  # whatever is bound to the faulty GPU is hit
    train(1)
    assert inj.hits[-1].mpu_id == "003"


@pytest.mark.slow  # 1,000 training steps: about 7 s
def test_no_false_positive_over_1000_clean_fp32_steps() -> None:
    cfg = TinyConfig(image_size=8, vision_hidden=16, text_hidden=16, vision_layers=1, text_layers=1, seq_len=4)
    guard, train, rec = job(cfg=cfg, batch=4, checksum=ChecksumConfig(replay_every=10))
    train(1000)
    assert rec.of(*FAIL, Reason.CHECKSUM_L1_TRIGGER) == []
    assert all(m.checksum_checks_total == 1000 for m in guard.mpus)


@pytest.mark.slow  # bf16 tolerance over many shapes: about 5 s
def test_bf16_tolerance() -> None:
    """bf16 (CPU autocast): the tolerance from the output's rounding (mscale.hook.checks.rounding)
    holds over clean steps; exponent flips, NaN and a top-mantissa flip of the largest element
    are caught by ABFT. Under the worst-case bound instead (rounding_sigmas=0: rtol 1e-2 x S) a
    mantissa flip sits inside the tolerance and is caught by replay, which recomputes exactly."""
    assert DEFAULT_RTOL[torch.bfloat16] == 1e-2
    guard, train, rec = job(autocast=True, checksum=ChecksumConfig(replay_every=0, full=True))
    train(200)
    assert rec.of(*FAIL) == []
    for kind, element in (("exponent_flip", "random"), ("nan", "random"), ("mantissa_flip", "max")):
        inj = inject(guard, kind=kind, mpu="aligner", steps=1, element=element)
        train(1)
        step = inj.hits[0].step
        assert [f.labels["method"] for f in rec.of(*FAIL, mpu="aligner", step=step)][:1] == ["abft"], kind
        inj.remove()
        train(1)
    guard2, train2, rec2 = job(autocast=True, checksum=ChecksumConfig(replay_every=1, rounding_sigmas=0))
    train2(3)
    assert rec2.of(*FAIL) == []
    # a transient fault: another element in the replay than in the step (element="max"
    # would flip the same one twice, a persistent fault replay cannot see). The aligner:
    # its GELU passes a negative element's change on, where a ReLU could mask it
    inject(guard2, kind="mantissa_flip", mpu="aligner", steps=1, seed=1)
    train2(1)
    assert [f.labels["method"] for f in rec2.of(*FAIL, mpu="aligner", step=3)] == ["replay"]


class Dropper(nn.Module):
    """A model whose MPU draws random numbers in its forward (dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))
        self.language_model = nn.Linear(8, 1)

    def forward(self, x):
        return {"loss": self.language_model(self.vision_tower(x)).pow(2).mean()}


def _dropout_run(replay_every: int) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    torch.manual_seed(0)
    model = Dropper()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Findings()
    guard = attach(
        model,
        opt,
        job_id="d",
        connect=False,
        plugins=[rec],
        cmsa=False,
        checksum=ChecksumConfig(replay_every=replay_every),
    )
    for _ in range(6):
        model(torch.randn(4, 8))["loss"].backward()
        opt.step()
        opt.zero_grad()
    guard.detach()
    return [p.detach().clone() for p in model.parameters()], torch.rand(3), len(rec.of(*FAIL))


def test_replay_leaves_the_training_rng_stream_alone() -> None:
    params_r, after_r, failures_r = _dropout_run(replay_every=1)
    params_n, after_n, failures_n = _dropout_run(replay_every=0)
    assert failures_r == 0 == failures_n  # the replay drew the same dropout masks
    assert all(torch.equal(a, b) for a, b in zip(params_r, params_n, strict=True))  # bitwise the same training
    assert torch.equal(after_r, after_n)


def test_output_site_corruption_caught_by_replay_and_nonfinite() -> None:
    guard, train, rec = job(checksum=ChecksumConfig(replay_every=1))
    train(1)
    inject(guard, kind="mantissa_flip", mpu="vision", site="output", steps=1, seed=1)
    train(1)
    assert [f.labels["method"] for f in rec.of(*FAIL, mpu="vision", step=1)] == ["replay"]
    inject(guard, kind="nan", mpu="aligner", site="output", steps=1)
    train(1)
    assert "nonfinite" in [f.labels["method"] for f in rec.of(*FAIL, mpu="aligner", step=2)]


def test_corrupt_kinds() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.full((4,), 0.5)
    bad, idx, before, after = corrupt(y, "exponent_flip", g)
    assert before == 0.5 and after == 0.5 * 2.0**128 and torch.equal(y, torch.full((4,), 0.5))
    bad, idx, before, after = corrupt(torch.ones(4), "mantissa_flip", g)
    assert after == 1.5
    bad, idx, before, after = corrupt(torch.ones(4, dtype=torch.bfloat16), "mantissa_flip", g)
    assert after == 1.5
    bad, _, _, _ = corrupt(y, "nan", g)
    assert int(bad.isnan().sum()) == 1
    with pytest.raises(ValueError, match="kind"):
        inject(type("G", (), {"mpus": [], "current_step": 0})(), kind="cosmic", mpu="x")


def _l1_run(failing_steps: int, **kw):
    """The tiny model with the vision tower's first linear computing a wrong output (this test's
    own faulty forward, as a failing GEMM would) for the first `failing_steps` steps; attach's
    keywords `kw`. The guard and the `consecutive` label of each of the detector's L1 triggers."""
    torch.manual_seed(0)
    model = TinyMultimodal(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = {"n": 0}

    linear = model.vision_tower.layers[0].linear1
    clean = linear.forward

    def faulty(x):
        y = clean(x)
        return y * 4.0 if model.training and steps["n"] < failing_steps else y

    linear.forward = faulty
    rec = Findings()
    guard = attach(model, opt, job_id="t", connect=False, plugins=[rec], cmsa=False, **kw)
    data = SyntheticCaptions(CFG, size=1000, seed=0)
    for i in range(failing_steps):
        b = torch.utils.data.default_collate([data[i * 4 + j] for j in range(4)])
        model(b["images"], b["tokens"])["loss"].backward()
        opt.step()
        opt.zero_grad()
        steps["n"] += 1
    guard.detach()
    return guard, [int(f.labels["consecutive"]) for f in rec.of(Reason.CHECKSUM_L1_TRIGGER)]


def test_the_detectors_l1_trigger_is_the_healing_sections_threshold() -> None:
    from mscale.healing.settings import HealingSection

    checks = ChecksumConfig(replay_every=0, full=True)
    guard, triggers = _l1_run(4, checksum=checks, healing=HealingSection(checksum_failures_l1=2))
    assert triggers == [2, 4]  # not the old detector-only default of 3
    assert guard.healing.checksum_failures_l1 == 2


def test_the_old_checksum_key_is_a_deprecated_alias_that_must_agree() -> None:
    import dataclasses
    import warnings

    from mscale.healing.settings import HealingSection

    old = ChecksumConfig(replay_every=0, full=True, failures_l1=2)
    with pytest.warns(FutureWarning, match=r"ChecksumConfig.failures_l1 is deprecated.*healing.checksum_failures_l1"):
        guard, triggers = _l1_run(2, checksum=old)
    assert triggers == [2]  # alone, it sets the one value: the detector's and the fuse's
    assert guard.healing.checksum_failures_l1 == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both keys saying the same: no warning
        _l1_run(0, checksum=old, healing=HealingSection(checksum_failures_l1=2))
    with pytest.raises(ValueError, match=r"ChecksumConfig.failures_l1 \(2\) and healing.checksum_failures_l1 \(3\)"):
        _l1_run(0, checksum=old, healing=HealingSection())
    with pytest.raises(ValueError, match="failures_l1: expected >= 1"):
        dataclasses.replace(old, failures_l1=0)
