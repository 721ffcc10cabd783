"""Faults the rotating weight fingerprints cannot see, found when the next in-memory snapshot is
verified (mscale.hook.fuse.actions.restore_weights, mscale.snapshot.trust), and restored from
the newest snapshot that passes; the fault put in by the test's own code:

- an Adam exp_avg element scaled by 1e6 (a direct write before the optimizer step): the
  weight it blows up over the next steps is reported by name and the run ends bitwise as the
  fault-free run (the steps since the last sound snapshot re-run on the same batches);
- an exp_avg element set to Inf in the live state and in the newest snapshot's copy: the
  weights go NaN, the rollback skips the snapshot that holds the poisoned state;
- an embedding row no batch reads, set to 1e30 in a window whose fingerprint group is not due.

The moment bound itself is checked on a real AdamW's state: clean moments pass, a scaled one
fails, element by element (a snapshot trusted) and on the largest magnitudes (each new snapshot).
"""

from __future__ import annotations

import logging

import pytest
import structlog
import torch

from mscale.findings import Finding
from mscale.healing.settings import HealingSection
from mscale.snapshot import trust

FC1 = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
EMBED = "model.language_model.embed_tokens.weight"
STEPS = 16
MEMORY_EVERY = 4


@pytest.fixture(autouse=True)
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


def of(findings: list[Finding], reason: str, **labels: str) -> list[Finding]:
    return [f for f in findings if f.reason.value == reason and all(f.labels.get(k) == v for k, v in labels.items())]


def _loop(fault=None):
    """The tiny LLaVA under the README's line, default healing, a snapshot every MEMORY_EVERY
    steps; the batch a function of the guard's step (a rollback re-draws the same ones).
    fault(step, model, opt, guard) runs before each forward."""
    from support.tiny_hf import guarded

    model, make_batch, opt, guard, findings = guarded("poisoned", healing=HealingSection(), memory_every=MEMORY_EVERY)
    calls = 0
    try:
        while guard.current_step < STEPS and calls < 3 * STEPS:
            if fault is not None:
                fault(guard.current_step, model, opt, guard)
            batch = make_batch(guard.current_step, torch.Generator().manual_seed(guard.current_step))
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
            calls += 1
    finally:
        guard.detach()
    return model, findings


@pytest.fixture(scope="module")
def clean() -> torch.nn.Module:
    model, findings = _loop()
    assert not [f for f in findings if f.severity.value == "critical"], findings
    return model


def _differ(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sb = b.state_dict()
    return [k for k, v in a.state_dict().items() if not torch.equal(v, sb[k])]


def test_the_moment_bound_passes_real_adam_state_and_fails_a_scaled_moment() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 32))
    opt = torch.optim.AdamW([w], lr=1e-3)
    for i in range(30):  # gradients of changing scale and sign: the moments of a real run
        (w * torch.randn_like(w) * (1 + 10 * (i % 3))).sum().backward()
        opt.step()
        opt.zero_grad()
    bound = trust.moment_bound(opt)
    assert bound is not None and 52 * trust.MARGIN < bound < 54 * trust.MARGIN  # betas 0.9, 0.999

    class Snap:
        def __init__(self, state: dict) -> None:
            self.tensors = {"f": {f"optim/w/{k}": v.clone() for k, v in state.items()}}

    state = opt.state[w]
    assert trust.state_bad(Snap(state), bound) == set() == trust.suspect(Snap(state), {}, bound, None)
    for key, factor, per_tensor in (
        ("exp_avg", 1e3, None),  # on the largest magnitudes, found where this m becomes the largest
        ("exp_avg", 1e6, True),
        ("exp_avg_sq", 1e-8, False),  # element by element only: the largest v is another element's
        ("exp_avg", float("inf"), True),
    ):
        bad = {k: v.clone() for k, v in state.items()}
        bad[key].view(-1)[7] *= factor
        assert trust.state_bad(Snap(bad), bound) == {"w"}, key
        # the per-step test on the largest magnitudes: what it finds, the exact test finds too
        found = trust.suspect(Snap(bad), {}, bound, None)
        assert found <= {"w"} and (per_tensor is None or found == ({"w"} if per_tensor else set())), (key, factor)


def test_an_absurd_exp_avg_is_found_at_the_next_snapshot_and_the_run_ends_as_the_clean_one(clean) -> None:
    done = []

    def scale_exp_avg(step, model, opt, guard):
        if step == 9 and not done:
            done.append(step)
            with torch.no_grad():
                opt.state[dict(model.named_parameters())[FC1]]["exp_avg"].view(-1)[5] *= 1e6

    model, findings = _loop(scale_exp_avg)
    assert done
    hit = of(findings, "weight_corruption", tensor=FC1)
    assert hit and 9 <= int(hit[0].labels["step"]) <= 9 + MEMORY_EVERY + 2, hit
    assert "snapshot of step" in hit[0].message
    assert of(findings, "heal_action", action="restore_weights", result="applied")
    assert _differ(clean, model) == []


def test_a_rollback_skips_the_snapshot_that_holds_a_poisoned_optimizer_state(clean) -> None:
    """The exp_avg element is Inf in the live state and in the newest snapshot's copy of it (the
    test writes both: the state as a copy taken after the poisoning holds it), its weight still
    sane: the next update makes the weight NaN, and a rollback to that snapshot would again."""
    done: list[int] = []
    at = 2 * MEMORY_EVERY + 1  # the snapshot of step 2 * MEMORY_EVERY is the newest

    def poison(step, model, opt, guard):
        if step != at or done:
            return
        fuse = next(p for p in guard.plugins if hasattr(p, "states"))
        engine = fuse.snapshot_engine
        engine.wait_copy()
        snap = engine.latest()
        assert snap.step == at - 1
        done.append(step)
        with torch.no_grad():
            opt.state[dict(model.named_parameters())[FC1]]["exp_avg"].view(-1)[5] = float("inf")
            (copy,) = [d[f"optim/{FC1}/exp_avg"] for d in snap.tensors.values() if f"optim/{FC1}/exp_avg" in d]
            copy.view(-1)[5] = float("inf")

    model, findings = _loop(poison)
    assert done
    assert not of(findings, "progress_bound"), [f.message for f in of(findings, "progress_bound")]
    restored = [int(r.labels["step"]) for r in of(findings, "rollback")]
    assert restored and all(s < at - 1 for s in restored), restored
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert _differ(clean, model) == []


def test_an_embedding_row_no_batch_reads_is_found_when_its_fingerprint_group_is_not_due(clean) -> None:
    done = []

    def unused_row(step, model, opt, guard):
        if done or step < 9:
            return
        fuse = next(p for p in guard.plugins if hasattr(p, "states"))
        watch = fuse.states["restore_weights"].watch
        if EMBED in watch.names[watch.due]:
            return  # the fingerprints would see this window's write: wait for another
        done.append(step)
        with torch.no_grad():
            dict(model.named_parameters())[EMBED][120, 3] = 1e30  # captions use ids below 100: no batch reads it

    model, findings = _loop(unused_row)
    assert done
    assert of(findings, "weight_corruption", tensor=EMBED), [f.message for f in findings]
    assert of(findings, "heal_action", action="restore_weights", result="applied")
    assert float(model.model.language_model.embed_tokens.weight.abs().max()) < 1e3
    assert _differ(clean, model) == []
