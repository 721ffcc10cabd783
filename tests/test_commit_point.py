"""The commit point (mscale.hook.core.commit): under commit verdicts every check's verdict is read back
once per step, at the optimizer step, in one read that carries the step agreement's all-reduce;
a failure found there drops the step's update on every rank and re-runs the step on the same
batch. Real gloo ranks (tests/support/ddp_job.py), the tiny model under DDP, the fault from the
job's own forward hook; a single-process run for the fuse's levels on a persistent fault."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch

import mscale
from mscale.sim.inject import inject
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal
from support.ddp_run import run_job

STEPS, FAULT_AT = 6, 3


@pytest.fixture(scope="module")
def commit_jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """(clean, hit): the commit scenario without a fault, and with rank 1's fault at FAULT_AT."""
    opts = dict(world=2, scenario="commit", snapshots=True, steps=STEPS)
    clean = run_job(tmp_path_factory.mktemp("clean"), fault_at=99, **opts)
    hit = run_job(tmp_path_factory.mktemp("hit"), fault_rank=1, fault_at=FAULT_AT, **opts)
    return clean, hit


def test_two_ranks_read_back_once_a_step_at_the_commit_point_with_the_agreement(commit_jobs) -> None:
    """Every tensor read-back counted on both ranks: none in forward and backward, exactly one
    from the optimizer step pre-hook to the end of the agreement, in every step, the faulty one
    and its re-run included (the checksums', the inputs', the losses' and the gradient check's
    values and the agreement's all-reduce, all in the one read)."""
    for job, reruns in zip(commit_jobs, (0, 1), strict=True):
        for r in job:
            runs = STEPS + reruns
            assert len(r["reads"]) == runs
            assert [(x["forward"], x["commit"]) for x in r["reads"]] == [(0, 1)] * runs
            assert r["commit_reads"] == runs  # the checksum detector's own count of verdict reads
            assert r["agreements"] == runs


def test_a_fault_found_at_the_commit_point_re_runs_the_step_on_the_same_batch_on_every_rank(commit_jobs) -> None:
    """Rank 1's vision GEMM output corrupted once at step 3: rank 1 finds it at the commit point,
    both ranks drop the update and run step 3 again from its start (the step mark: data and RNG
    rewound, weights kept, no rollback) on the same samples; no step is skipped, the ranks stay
    bitwise equal to each other and to the fault-free run."""
    clean, hit = commit_jobs
    assert hit[1]["output_hit"] == [FAULT_AT] and hit[0]["output_hit"] == []
    assert ["checksum", "checksum_failure"] in hit[1]["findings"]
    assert ["checksum", "checksum_failure"] not in hit[0]["findings"]
    assert ["agree", "step_dropped_agreed"] in hit[0]["findings"]
    for r, ref in zip(hit, clean, strict=True):
        steps = [e["step"] for e in r["ends"]]
        assert steps == [0, 1, 2, 3, 3, 4, 5]  # step 3 run twice, none skipped
        assert [e["step"] for e in r["ends"] if e["skip"]] == [FAULT_AT]
        assert r["ends"][3]["hash"] == r["ends"][2]["hash"]  # the first run's update dropped
        assert r["rollbacks"] == [{"step": FAULT_AT, "to": FAULT_AT - 1, "rewind": True}]
        assert r["final_step"] == STEPS
        (first, again) = [ids for step, ids in r["consumed"] if step == FAULT_AT]
        assert first == again  # the batch re-consumed
        assert [ids for _, ids in r["consumed"]] == [ids for _, ids in ref["consumed"][:3]] + [first] + [
            ids for _, ids in ref["consumed"][3:]
        ]
        heal = [h for h in r["heal"] if h[0] == "rollback"]
        assert heal == [["rollback", "applied"]]  # one event per rollback, the drop in its detail
    assert [e["hash"] for e in hit[0]["ends"]] == [e["hash"] for e in hit[1]["ends"]]
    assert hit[0]["hash"] == hit[1]["hash"] == clean[0]["hash"] == clean[1]["hash"]


@pytest.fixture
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


def _commit_job(job_id: str, plugins=()) -> tuple:
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = mscale.ResumableLoader(SyntheticCaptions(cfg, size=64, seed=0), batch_size=2, seed=0)
    guard = mscale.attach(
        model,
        opt,
        job_id=job_id,
        connect=False,
        plugins=list(plugins),
        checksum=mscale.ChecksumConfig(full=True, verdicts="commit"),
        snapshots=mscale.SnapshotConfig(memory_every=1),
        data=loader,
    )
    return model, opt, loader, guard


@pytest.mark.usefixtures("_quiet")
def test_a_persistent_fault_at_the_commit_point_escalates_and_the_step_runs_on_the_standby() -> None:
    """One process: the vision MPU's GPU corrupts every forward from step 3 on (an exponent flip
    in its first GEMM). Each failed run is charged to the MPU: step 3 fails, runs again once on
    its batch and fails again, so its batch is skipped; step 4's run is the third failure, the L1
    trigger: the MPU moves to a standby GPU and step 4's second run passes there. No rollback."""
    ends: list[tuple[int, bool]] = []

    class Ends:
        def on_step_end(self, step: int, loss) -> None:
            ends.append((step, bool(guard.step_state.skip_reason)))

    model, opt, loader, guard = _commit_job("commit", [Ends()])
    vision = guard.mpu("vision")
    gpu = vision.gpu
    consumed: list[tuple[int, list[int]]] = []
    batches = iter(loader)
    injector = None
    try:
        for _ in range(20):
            if guard.current_step >= 6:
                break
            if guard.current_step == FAULT_AT and injector is None:
                injector = inject(guard, kind="exponent_flip", gpu=gpu, steps=100, element="max")
            b = next(batches)
            consumed.append((guard.current_step, b["index"].tolist()))
            model(b["images"], b["tokens"])["loss"].backward()
            opt.step()
            opt.zero_grad()
    finally:
        guard.detach()
    assert ends == [(0, False), (1, False), (2, False), (3, True), (3, True), (4, True), (4, False), (5, False)]
    for step in (FAULT_AT, FAULT_AT + 1):
        runs = [ids for s, ids in consumed if s == step]
        assert len(runs) == 2 and runs[0] == runs[1]  # run again on its own batch
    assert consumed[5][1] != consumed[3][1]  # step 3's batch skipped: step 4 has the next one
    assert vision.gpu != gpu and vision.fuse_level == "l1_swapped"
    rolled = guard.fuse.states["rollback"].rollbacks
    assert [(x["step"], x["to"], x.get("rewind")) for x in rolled] == [(3, 2, True), (4, 3, True)]
    assert guard.fuse.progress.reruns_skipped == [FAULT_AT]


@pytest.mark.usefixtures("_quiet")
def test_a_step_failing_at_the_commit_point_is_re_run_once_then_kept_without_the_mpus_gradient() -> None:
    """A finite fault on every run of step 3 only: the step is run again once
    (progress_step_reruns), then its update is kept but the vision MPU's gradient (the failed run
    again is not lost: tests/test_commit_rerun_kept.py) and training goes on with the next batch."""
    model, opt, loader, guard = _commit_job("limit")
    consumed: list[tuple[int, list[int]]] = []
    batches = iter(loader)
    injector = None
    try:
        for _ in range(30):
            if guard.current_step >= 5:
                break
            if guard.current_step == FAULT_AT and injector is None:
                injector = inject(guard, kind="mantissa_flip", mpu="vision", steps=1, element="max")
            b = next(batches)
            consumed.append((guard.current_step, b["index"].tolist()))
            model(b["images"], b["tokens"])["loss"].backward()
            opt.step()
            opt.zero_grad()
    finally:
        guard.detach()
    runs = [ids for step, ids in consumed if step == FAULT_AT]
    assert len(runs) == 2 and runs[0] == runs[1]
    after = [ids for step, ids in consumed if step == FAULT_AT + 1]
    assert len(after) == 1 and after[0] != runs[0]  # the next batch: training went on
    assert [s for s, _ in consumed] == [0, 1, 2, FAULT_AT, FAULT_AT, 4]
    assert guard.fuse.progress.ledger.lost == 1  # the first failed run, nothing undone
    assert guard.fuse.progress.reruns_kept == [FAULT_AT]
