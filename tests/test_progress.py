"""Forward progress (docs/healing.md, Forward progress): a fault costs at most a stated number of
optimizer calls per event, a check failed at the commit point costs that step (run again once
from its start, no rollback), a persistent fault climbs the fuse's levels and, past the last,
stops the job cleanly (mscale.ProgressBoundExceeded, a critical finding, a disk snapshot), never
a loop. The ledger on its own, then a tiny Hugging Face LLaVA with the fault from the test's own
forward hook on the vision tower's last MLP output (in front of the guard's check)."""

from __future__ import annotations

import logging
import math

import pytest
import structlog
import torch

import mscale
from mscale.daemon.config import ConfigError
from mscale.findings import Reason
from mscale.healing.progress import JOB, MPU_RUNGS, Progress
from mscale.healing.settings import HealingSection
from mscale.snapshot.format import list_snapshots

BOUND = HealingSection().progress_event_calls  # 24: the most calls one fault event may cost
RUNG = HealingSection().progress_rung_calls  # 3: lost calls at one level before the next


@pytest.fixture(autouse=True)
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


# --- the ledger ------------------------------------------------------------------------------


def test_the_defaults_are_the_documented_bound() -> None:
    cfg = HealingSection()
    assert (cfg.progress_step_reruns, cfg.progress_rung_calls, cfg.progress_event_calls) == (1, 3, 24)
    assert (cfg.progress_run_share, cfg.progress_clean_calls) == (0.25, 5)
    with pytest.raises(ConfigError, match="progress_event_calls"):
        HealingSection(progress_event_calls=11).check("healing")


def test_an_mpu_climbs_a_level_every_rung_calls_and_stops_past_l3_within_the_bound() -> None:
    ledger = Progress()
    rungs, stop = [], ""
    for _ in range(100):
        c = ledger.charge("001")
        ledger.call({"001"})
        rungs.append(c.rung)
        if c.stop:
            stop = c.stop
            break
    assert rungs == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]  # L1, L2, L3, then the stop
    assert "survived every level" in stop and len(rungs) == MPU_RUNGS * RUNG <= BOUND


def test_one_rollback_per_fault_event_and_never_past_the_bound() -> None:
    ledger = Progress()
    assert ledger.rollback_allowed(JOB, 10, 30)
    assert not ledger.rollback_allowed(JOB, BOUND, 30)  # more than the ladder leaves of the bound
    ledger.charge(JOB, 10, rollback=True)
    ledger.rolled_back(JOB, 30)
    assert not ledger.rollback_allowed(JOB, 1, 39)  # the same fault again: never another rollback
    c = ledger.charge(JOB)
    c = ledger.charge(JOB)  # the third faulty call: the job's batches are skipped now
    assert c.rung == 1 and c.climbed
    for _ in range(RUNG):
        c = ledger.charge(JOB)
    assert c.stop and ledger.culprits[JOB].lost == 10 + 2 + RUNG <= BOUND


def test_never_the_same_rollback_twice_even_in_a_later_event() -> None:
    ledger = Progress(clean_calls=2)
    assert ledger.rollback_allowed("001", 5, 10)
    ledger.charge("001", 5, rollback=True)
    ledger.rolled_back("001", 10)
    ledger.call({"001"})
    for _ in range(2):
        ledger.call(set())
    assert "001" not in ledger.culprits  # a new event may roll back, but not to step 10 again
    assert not ledger.rollback_allowed("001", 5, 10) and ledger.rollback_allowed("001", 5, 20)


def test_an_event_ends_after_clean_calls_and_the_run_share_bounds_repeated_events() -> None:
    ledger = Progress(clean_calls=5)
    ledger.charge("001")
    for _ in range(5):
        ledger.call(set())
    assert "001" not in ledger.culprits  # the event ended: the next fault starts afresh
    stop = ""
    for i in range(400):  # one lost call in every second: 50% of the run, one-call events
        c = ledger.charge(f"00{i % 3}") if i % 2 == 0 else None
        ledger.call({c.culprit} if c else set())
        if c is not None and c.stop:
            stop = c.stop
            break
    assert "of the run" in stop
    assert ledger.lost <= max(BOUND, 0.25 * ledger.calls) + 1


# --- a tiny LLaVA -----------------------------------------------------------------------------


def _job(tmp_path, *, verdicts: str, fault, directory: bool = False, compiled: bool = False) -> dict:
    """Train a tiny LLaVA until 60 steps, 120 calls or the clean stop; the fault (a function of
    the call number and the output) written by the test's own hook on the tower's last fc2."""
    from support.tiny_hf import Samples, tiny_llava

    model, make_batch = tiny_llava(seed=0)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = mscale.ResumableLoader(Samples(make_batch, 2000), batch_size=4, seed=0)
    findings: list = []

    class Keep:
        def on_finding(self, f) -> None:
            findings.append(f)

    outer = torch.compile(model, backend="eager") if compiled else model
    guard = mscale.attach(
        outer,
        opt,
        job_id="progress",
        connect=False,
        plugins=[Keep()],
        checksum=mscale.ChecksumConfig(verdicts=verdicts),
        snapshots=mscale.SnapshotConfig(directory=tmp_path / "snap" if directory else None),
        data=loader,
    )
    calls = {"n": 0}
    fc2 = model.model.vision_tower.encoder.layers[-1].mlp.fc2
    fc2.register_forward_hook(lambda m, a, out: fault(calls["n"], out), prepend=True)
    run: dict = {"steps": [], "batches": [], "stopped": None, "guard": guard, "findings": findings}
    batches = iter(loader)
    try:
        while guard.current_step < 60 and calls["n"] < 120:
            b = next(batches)
            run["batches"].append((guard.current_step, float(b["pixel_values"].sum())))
            outer(**b).loss.backward()
            calls["n"] += 1
            opt.step()
            opt.zero_grad()
            run["steps"].append(guard.current_step)
    except mscale.ProgressBoundExceeded as e:
        run["stopped"] = e
        run["steps"].append(guard.current_step)
        try:  # stopped for good: the next optimizer step raises again
            opt.step()
        except mscale.ProgressBoundExceeded as again:
            run["again"] = again
    finally:
        guard.detach()
    run["calls"] = calls["n"]
    run["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return run


def _noise(first: int, last: int):
    def fault(call: int, out: torch.Tensor):
        return out + torch.randn_like(out) * out.std() if first <= call < last else None

    return fault


def _nan(first: int):
    def fault(call: int, out: torch.Tensor):
        return out + torch.full_like(out, math.nan) if call >= first else None

    return fault


def _went_back(steps: list[int]) -> int:
    return max((a - b for a, b in zip(steps, steps[1:], strict=False)), default=0)


@pytest.mark.slow
def test_persistent_vision_noise_under_commit_verdicts_costs_each_failed_run_not_the_steps_since(tmp_path) -> None:
    """Noise of 1x the output's std on every forward of calls 10..39: each run that fails at the
    commit point is run again from its start on the same batch (no rollback: the step never goes
    back), a second failure skips the batch, the vision MPU climbs the fuse's levels; 60 steps
    are reached within 60 + the bound calls (today: rollbacks to the last in-memory snapshot,
    the step going back and the calls lost growing with the fault)."""
    run = _job(tmp_path, verdicts="commit", fault=_noise(10, 40))
    guard = run["guard"]
    assert run["stopped"] is None and guard.current_step == 60
    assert run["calls"] <= 60 + BOUND
    assert _went_back(run["steps"]) == 0  # no rollback to an older snapshot
    failed = [f for f in run["findings"] if f.reason is Reason.CHECKSUM_FAILURE]
    assert failed and {f.labels["mpu_id"] for f in failed} == {"001"}  # found, on the vision MPU
    rolled = guard.fuse.states["rollback"].rollbacks
    assert rolled and all(r.get("rewind") and r["to"] == r["step"] - 1 for r in rolled)
    # a step run again saw its own batch again (the data position rewound with it)
    for r in rolled:
        seen = [x for s, x in run["batches"] if s == r["step"]]
        assert len(seen) >= 2 and seen[0] == seen[1]
    assert guard.fuse.progress.ledger.lost == run["calls"] - 60 + len(guard.fuse.progress.reruns_skipped)
    assert run["finite"]


@pytest.mark.slow
@pytest.mark.parametrize("verdicts", ["in_step", "commit"])
def test_a_persistent_nan_that_follows_the_module_climbs_every_level_then_stops_cleanly(tmp_path, verdicts) -> None:
    """NaN in the vision tower's output on every call from call 12: the fuse swaps, degrades and
    distils the MPU (the fault follows it), one rollback at most, then the clean stop within the
    bound: mscale.ProgressBoundExceeded, a critical finding, the newest good snapshot on disk,
    no NaN in the weights, and the job stays stopped (today: hundreds of rollbacks, no end)."""
    run = _job(tmp_path, verdicts=verdicts, fault=_nan(12), directory=True)
    stop, findings = run["stopped"], run["findings"]
    assert stop is not None, f"no stop after {run['calls']} calls, steps {run['steps'][-5:]}"
    assert run["calls"] - 12 <= BOUND  # the calls since the fault began
    assert stop.culprit == "001" and stop.lost <= BOUND
    states = [f.labels["state"] for f in findings if f.reason is Reason.FUSE_STATE and f.labels["mpu_id"] == "001"]
    assert {"l1_swapped", "l2_degraded", "l3_distilling"} <= set(states)
    (critical,) = [f for f in findings if f.reason is Reason.PROGRESS_BOUND]
    assert critical.severity.value == "critical" and critical.labels["mpu_id"] == "001"
    assert stop.snapshot and stop.snapshot in critical.message
    held = list_snapshots(tmp_path / "snap")
    assert any(str(i.path) == stop.snapshot for i in held)
    assert run["again"] is not None and run["finite"]
    rolled = [r for r in run["guard"].fuse.states["rollback"].rollbacks if r["to"] is not None and not r.get("rewind")]
    assert len(rolled) <= 1  # never the same rollback twice


@pytest.mark.slow
def test_a_compiled_model_with_a_persistent_nan_stops_cleanly_within_the_bound(tmp_path) -> None:
    """The same under torch.compile (the eager backend: the guard's checks traced into the graph,
    commit verdicts, the only mode there): the clean stop within the bound, never a loop."""
    torch._dynamo.reset()
    try:
        run = _job(tmp_path, verdicts="auto", fault=_nan(12), compiled=True)
    finally:
        torch._dynamo.reset()
    stop = run["stopped"]
    assert stop is not None and run["calls"] - 12 <= BOUND and stop.lost <= BOUND
    assert run["guard"].checksum._graph_mpus  # the MPUs ran in the graph
    assert [f for f in run["findings"] if f.reason is Reason.PROGRESS_BOUND]
    assert run["finite"]


@pytest.mark.slow
@pytest.mark.parametrize("verdicts", ["in_step", "commit"])
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_two_ranks_a_persistent_nan_on_rank_1_stops_every_rank_at_the_same_step(tmp_path, wrap, verdicts) -> None:
    """2 gloo ranks under DDP (and FSDP2), NaN in rank 1's vision output on every forward from
    the 4th loop: the ranks agree on every drop and on the culprit, so both charge the same calls
    and stop at the same step (no collective left waiting), within the bound, each with its disk
    snapshot; the DDP replicas stay equal, every rank finite (today: rollbacks to the same
    snapshot until the loop's cap)."""
    from support.ddp_run import run_job

    snap = tmp_path / "snap"
    ranks = run_job(
        tmp_path,
        scenario="nan_output",
        snapshots=True,
        snapdir=snap,
        steps=40,
        fault_rank=1,
        fault_at=4,
        verdicts=verdicts,
        wrap=wrap,
    )
    stops = [r["stopped"] for r in ranks]
    assert all(stops), [r["final_step"] for r in ranks]
    assert stops[0]["step"] == stops[1]["step"] and stops[0]["lost"] == stops[1]["lost"] <= BOUND
    assert {s["culprit"] for s in stops} == {"001"}  # rank 1's vision MPU, on both ranks
    assert stops[0]["loops"] - 4 <= BOUND
    assert all(s["snapshot"] and (tmp_path / s["snapshot"]).exists() for s in stops)
    assert all(r["finite"] for r in ranks) and (wrap == "fsdp" or ranks[0]["hash"] == ranks[1]["hash"])
    assert ["fuse", "progress_bound"] in ranks[0]["findings"] and ["fuse", "progress_bound"] in ranks[1]["findings"]
