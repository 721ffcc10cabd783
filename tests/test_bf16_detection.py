"""ABFT under bf16 autocast (issue 22 item 7): the tolerance from the output's own rounding
(mscale.hook.checks.rounding) finds, in a tiny Hugging Face LLaVA's last vision fc2, noise of 1x the
output's std, one element x16 and the whole output x2, each in at least 18 of 20 faulty steps,
with no false alarm on clean bf16 steps. The faults are put in by the test's own forward hook,
ahead of the guard's."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

import mscale  # noqa: E402
from mscale.findings import Reason  # noqa: E402
from mscale.hook.checks import rounding  # noqa: E402
from mscale.hook.checks.checksum_config import BF16_ROUNDING  # noqa: E402
from support.tiny_hf import tiny_llava  # noqa: E402

FAIL = (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)
LAYER = "encoder.layers.1.mlp.fc2"  # the vision tower's last fc2


def _faults(kind: str, g: torch.Generator):
    def fault(out: torch.Tensor) -> torch.Tensor:
        if kind == "noise":  # 1x the output's std
            return out + out.float().std().to(out.dtype) * torch.randn(out.shape, generator=g).to(out.dtype)
        if kind == "x16":  # one element, at random
            flat = out.clone().reshape(-1)
            i = int(torch.randint(0, flat.numel(), (1,), generator=g))
            flat[i] = flat[i] * 16
            return flat.view_as(out)
        return out * 2

    return fault


def _run(seed: int, steps: list[str | None]) -> tuple[list[bool], list]:
    """Train a tiny LLaVA under bf16 autocast for len(steps) steps, every layer checked every
    step (the table is about what a check sees, not the rotation; mscale.hook.checks.coverage), with
    `steps[i]` the fault in step i (None: clean). Returns, per step, whether ABFT failed on the
    faulty layer in it, and every failure finding."""
    model, make_batch = tiny_llava(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(
        model, opt, job_id="bf16", connect=False, cmsa=False, checksum=mscale.ChecksumConfig(full=True, replay_every=0)
    )
    fc2 = dict(guard.mpu("vision").module.named_modules())[LAYER]
    g = torch.Generator().manual_seed(100 + seed)  # the faults' own random numbers, not training's
    now: dict[str, object] = {"fault": None}
    fc2.register_forward_hook(lambda m, a, out: now["fault"](out) if now["fault"] else None, prepend=True)
    for i, kind in enumerate(steps):
        now["fault"] = _faults(kind, g) if kind else None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**make_batch(i, torch.Generator().manual_seed(1000 * seed + i)))
        out.loss.float().backward()
        opt.step()
        opt.zero_grad()
    failures = [f for f in guard.findings if f.reason in FAIL]
    guard.detach()
    by_step = {f.labels["step"] for f in failures if f.labels.get("method") == "abft" and LAYER in f.message}
    return [str(i) in by_step for i in range(len(steps))], failures


@pytest.mark.parametrize("kind", ["noise", "x16", "x2"])
def test_bf16_faults_in_the_vision_fc2_are_caught_in_at_least_18_of_20_steps(kind: str) -> None:
    # a faulty step, then a clean one: the count of failed steps in a row never reaches L1, so
    # the fuse leaves the MPU where it is and each faulty step is checked alike
    steps = [kind if i % 2 else None for i in range(40)]
    caught, failures = _run(0, steps)
    faulty = [c for c, k in zip(caught, steps, strict=True) if k]
    assert sum(faulty) >= 18, f"{kind}: caught in {sum(faulty)}/20 faulty steps"
    clean = [f for f in failures if steps[int(f.labels["step"])] is None]
    assert clean == [], [f.message for f in clean]  # the steps between: no false alarm


def test_clean_bf16_steps_give_no_false_alarm() -> None:
    caught, failures = _run(1, [None] * 100)
    assert failures == [], [f.message for f in failures]


@pytest.mark.slow  # 3 x 300 clean bf16 steps, every layer of every MPU checked each step
@pytest.mark.timeout(1800)  # about a minute each on a quiet 2-core machine, 5x that under load
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_three_by_300_clean_bf16_steps_give_no_false_alarm(seed: int) -> None:
    caught, failures = _run(seed, [None] * 300)
    assert failures == [], [f.message for f in failures]


def _check(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, signs: rounding.Signs
) -> tuple[float, float]:
    r = signs.of(y.shape[1], y.device)
    sums = (
        rounding.weighted_colsums(w, r, transposed=False),
        w.float().abs().sum(0),
        b.float() @ r,
        b.float().abs().sum(),
    )
    resid, tol = rounding.residual_and_tolerance(x, y, sums, signs, sigmas=6.0, rtol32=2e-6).tolist()
    return resid, tol


@pytest.mark.parametrize("n", [1024, 1023])  # the sum of the row signs: 0, and -1 (the bias counts once)
def test_outputs_alike_across_tokens_round_alike_and_the_row_signs_cancel_them(n: int) -> None:
    """Rows of x alike (attention averaging over many tokens): every output of a column rounds
    the same way, so their errors add coherently, N times one rounding where a random walk gives
    sqrt(N). Balanced signs per row cancel that; weights per column alone (s all ones) do not."""
    g = torch.Generator().manual_seed(0)
    k, m = 64, 64
    base = torch.randn(1, k, generator=g)
    x = (base + 1e-3 * torch.randn(n, k, generator=g)).bfloat16()
    w = (torch.randn(m, k, generator=g) / 8).bfloat16()
    b = torch.randn(m, generator=g).bfloat16()
    y = torch.nn.functional.linear(x, w, b)  # one rounding to bf16 per output
    signs = rounding.Signs()
    resid, tol = _check(y, x, w, b, signs)
    assert abs(resid) <= tol
    # the same outputs summed with ones per row: the coherent rounding is far outside the bound
    r = signs.of(m, y.device).double()
    exact = (x.double() @ w.double().t() + b.double()).sum(0) @ r
    coherent = float(y.double().sum(0) @ r - exact)
    assert abs(coherent) > 6 * BF16_ROUNDING * float(y.float().norm())
    # and a fault of the output's own size is still seen
    noisy = y + y.float().std().to(y.dtype) * torch.randn(y.shape, generator=g).to(y.dtype)
    resid, tol = _check(noisy, x, w, b, signs)
    assert abs(resid) > tol


def test_signs_are_balanced_and_fixed() -> None:
    a, b = rounding.Signs(), rounding.Signs()
    for n in (1, 7, 68, 1024):
        v = a.of(n, torch.device("cpu"))
        assert set(v.tolist()) <= {-1.0, 1.0} and float(v.sum()) == -(n % 2)
        assert torch.equal(v, b.of(n, torch.device("cpu")))
    assert not math.isclose(float(a.of(64, torch.device("cpu"))[:32].sum()), 32.0)  # not sorted
