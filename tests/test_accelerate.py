"""`mscale.accelerate.attach` under `accelerate launch`, on 1 and 2 CPU processes (gloo, DDP), with
Accelerate's own loop: `prepare`, `accumulate` (2 micro-batches a step), `backward` and
mixed_precision="bf16". The job (tests/support/accelerate_job.py) trains a tiny Hugging Face
LLaVA built from its config; faults are the job's own hooks. Per world size: one launch runs the
clean, fault, NaN, reference and killed runs in turn (the killed one ends the process), a second
launch restarts the killed one from its disk snapshots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, free_port

pytest.importorskip("accelerate")

STEPS, ACCUM, KILL_AT = 8, 2, 5
QUIET = {"snapshot_written", "snapshot_tier"}  # what a clean run may say (the node tier's announcement)


def _launch(out: Path, world: int, cases: str, log: Path) -> int:
    accelerate = Path(sys.executable).with_name("accelerate")
    procs = ["--cpu", "--num_processes", "1"] if world == 1 else ["--multi_gpu", "--num_processes", str(world)]
    cmd = [
        str(accelerate),
        "launch",
        *procs,
        "--num_machines",
        "1",
        "--mixed_precision",
        "bf16",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "tests/support/accelerate_job.py",
        "--out",
        str(out),
        "--cases",
        cases,
        "--steps",
        str(STEPS),
        "--accum",
        str(ACCUM),
        "--kill-at",
        str(KILL_AT),
    ]
    env = {**os.environ, "HF_HOME": str(out / "hf"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=420)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks too
            proc.wait(timeout=10)
            raise AssertionError("accelerate launch timed out:\n" + log.read_text()[-3000:]) from None


@pytest.fixture(
    scope="module",
    params=[pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)],
    ids=["1proc", "2proc"],
)
def runs(request, tmp_path_factory) -> dict:
    world = request.param
    out = tmp_path_factory.mktemp(f"accelerate{world}")
    first = _launch(out, world, "clean,fault,nan,ref,kill", out / "first.log")
    assert first != 0, "the killed run should have ended the first launch"
    assert (out / "snap-kill").is_dir(), (out / "first.log").read_text()[-3000:]
    second = _launch(out, world, "restart", out / "restart.log")
    assert second == 0, (out / "restart.log").read_text()[-3000:]
    results = {}
    for case in ("clean", "fault", "nan", "ref", "restart"):
        files = [out / f"{case}-rank_{r}.json" for r in range(world)]
        assert all(f.exists() for f in files), f"{case}: " + (out / "first.log").read_text()[-3000:]
        results[case] = [json.loads(f.read_text()) for f in files]
    return {"world": world, **results}


def reasons(rank: dict) -> list[str]:
    return [f["reason"] for f in rank["findings"]]


def found(rank: dict, reason: str, **labels: str) -> list[dict]:
    return [
        f for f in rank["findings"] if f["reason"] == reason and all(f["labels"].get(k) == v for k, v in labels.items())
    ]


@pytest.mark.timeout(900)
def test_clean_run_is_quiet_and_steps_are_the_optimizers_real_steps(runs) -> None:
    for rank in runs["clean"]:
        assert rank["world"] == runs["world"] and rank["mixed_precision"] == "bf16"
        assert set(reasons(rank)) <= QUIET, rank["findings"]
        # one guard step per optimizer step, each ending where accelerator.sync_gradients is true
        assert rank["ends"] == [[s, True] for s in range(STEPS)]
        assert rank["forwards"] == STEPS * ACCUM and rank["finite"]
    assert len({r["digest"] for r in runs["clean"]}) == 1  # the replicas agree


@pytest.mark.timeout(900)
def test_fault_from_the_jobs_own_hook_is_caught_and_healed(runs) -> None:
    faulty = runs["fault"][0]
    caught = found(faulty, "checksum_failure", mpu_id="001")
    assert caught and caught[0]["labels"]["step"] == "2", faulty["findings"]
    swaps = found(faulty, "heal_action", action="l1_swap", result="applied")
    assert len(swaps) == 1, faulty["findings"]
    swapped_at = int(swaps[0]["labels"]["step"])
    # healed: the vision MPU left the faulty GPU, and its checks there were clean to the end
    assert faulty["gpus"]["vision"] != faulty["start_gpu"]
    assert all(int(f["labels"]["step"]) <= swapped_at for f in caught)
    assert [e[0] for e in faulty["ends"]][-1] == STEPS - 1
    for rank in runs["fault"]:
        assert rank["finite"]
    assert len({r["digest"] for r in runs["fault"]}) == 1  # the other rank stayed in step


@pytest.mark.timeout(900)
def test_nan_step_is_rolled_back(runs) -> None:
    first = runs["nan"][0]
    assert found(first, "loss_nonfinite", step="3"), first["findings"]
    assert found(first, "heal_action", action="rollback", result="applied")
    for rank in runs["nan"]:
        # every rank restores the in-memory snapshot of step 2 and re-runs step 3 (a fresh batch)
        assert [f["labels"]["step"] for f in rank["findings"] if f["reason"] == "rollback"] == ["2"], rank["findings"]
        assert [e[0] for e in rank["ends"]] == [0, 1, 2, 3, *range(3, STEPS)]
        assert rank["finite"]
    assert len({r["digest"] for r in runs["nan"]}) == 1


@pytest.mark.timeout(900)
def test_nan_step_steps_over_the_nan_micro_batch_alone(runs) -> None:
    """Step 3's re-run draws again what its first run drew, less the micro-batch whose loss was
    NaN (rank 0's second) and with the next one in its place; another rank's micro-batches,
    every loss finite, re-run as they were."""
    for rank, r in enumerate(runs["nan"]):
        at3 = [tuple(sorted(p.items())) for step, p in r["drawn"] if step == 3]
        first, again = at3[:ACCUM], at3[ACCUM : 2 * ACCUM]
        assert len(at3) == 2 * ACCUM, r["drawn"]
        if rank == 0:
            assert again[0] == first[0] and again[1] not in first, (first, again)
        else:
            assert again == first, (first, again)


@pytest.mark.timeout(900)
def test_killed_run_restarts_from_its_disk_snapshot_bitwise(runs) -> None:
    for ref, restarted in zip(runs["ref"], runs["restart"], strict=True):
        resumed = found(restarted, "snapshot_resumed")
        assert len(resumed) == 1 and 0 <= int(resumed[0]["labels"]["step"]) < KILL_AT, restarted["findings"]
        start = int(resumed[0]["labels"]["step"]) + 1
        assert [e[0] for e in restarted["ends"]] == list(range(start, STEPS))
        assert restarted["digest"] == ref["digest"]  # as if it had never been killed


@pytest.fixture
def accelerator():
    """An Accelerator in this process (one process, CPU), its global state reset afterwards so the
    Trainer tests that follow build theirs afresh."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_attach_refuses_what_accelerate_did_not_prepare(accelerator) -> None:
    import torch

    import mscale
    from support.tiny_hf import tiny_llava

    model, _ = tiny_llava(seed=0)
    raw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(TypeError, match="optimizer: expected what accelerator.prepare returned"):
        mscale.accelerate.attach(accelerator, model, raw, job_id="x", connect=False)
    with pytest.raises(TypeError, match="accelerator: expected an accelerate.Accelerator"):
        mscale.accelerate.attach(object(), model, raw, job_id="x", connect=False)
    model, opt = accelerator.prepare(model, raw)
    loader = mscale.ResumableLoader(list(range(8)), batch_size=2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="split as rank 0 of 2, but this is process 0 of 1"):
        mscale.accelerate.attach(accelerator, model, opt, job_id="x", snapshots=True, data=loader, connect=False)
    assert not model._forward_hooks and not raw._optimizer_step_pre_hooks  # nothing hooked


def test_guard_steps_on_the_sync_micro_batch_only(accelerator) -> None:
    """In process, one Accelerator: 3 optimizer steps of 2 micro-batches under `accumulate`; the
    guard's step ends 3 times, each on a micro-batch where sync_gradients is true, and the LR
    scheduler inside the AcceleratedScheduler is the one the snapshots hold."""
    import torch

    import mscale
    from support.tiny_hf import tiny_llava

    model, make_batch = tiny_llava(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, popt, psched = accelerator.prepare(model, opt, sched)
    ends = []

    class Ends:
        def on_step_end(self, step, loss) -> None:
            ends.append((step, accelerator.sync_gradients))

    guard = mscale.accelerate.attach(
        accelerator, model, popt, job_id="acc", snapshots=True, scheduler=psched, connect=False, plugins=[Ends()]
    )
    assert guard.optimizer is opt and guard.snapshots.scheduler.prepared is psched
    for i in range(3 * ACCUM):
        with accelerator.accumulate(model):
            accelerator.backward(model(**make_batch(i, torch.Generator().manual_seed(i))).loss)
            popt.step()
            psched.step()
            popt.zero_grad()
    guard.detach()
    assert ends == [(0, True), (1, True), (2, True)] and guard.current_step == 3
    assert sched.last_epoch == 3  # stepped with the optimizer only
