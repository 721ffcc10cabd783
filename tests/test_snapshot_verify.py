"""Each in-memory snapshot is verified on the snapshot copier's thread, after its copy
(mscale.snapshot.verify), and restored only once its verification passed: a snapshot whose copy
holds a corruption (written by the test's own optimizer step hook right before the capture) is
never restored, a rollback that comes while a verification is in flight waits for it, and one
whose verification cannot finish in time goes to the snapshot before. The small job of the
snapshot tests (tests/support/snapshot_inproc.py: AdamW, a snapshot every 10 steps)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_snapshot import assert_same_state

from mscale.findings import Reason
from mscale.snapshot import trust
from support.snapshot_inproc import Job

WAIT_S = 60.0  # the longest any test wait takes (none is a timing: each waits for an event)


def _weight(job: Job) -> tuple[str, torch.Tensor]:
    return next((n, p) for n, p in job.model.named_parameters() if p.dim() == 2)


def _corrupt_at(job: Job, step: int, where: str) -> None:
    """An optimizer step post hook of the test's own: after step `step`'s update, before the
    engine captures it, one weight element set to 1e30 (`weight`) or its exp_avg element to
    Inf (`state`), in the live state, so that the snapshot's copy holds it."""
    name, p = _weight(job)
    done: list[int] = []

    def hook(opt, args, kwargs) -> None:
        if job.engine.step == step - 1 and not done:
            done.append(step)
            with torch.no_grad():
                if where == "weight":
                    p.view(-1)[3] = 1e30
                else:
                    opt.state[p]["exp_avg"].view(-1)[3] = float("inf")

    job.opt.register_step_post_hook(hook)


class Gate:
    """Holds every verification from now on on the copier's thread (in `trust.suspect`, after
    the copy) until `release`; `entered` is set once one is held there. The job's earlier ones
    are waited for first."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, job: Job) -> None:
        assert all(s.verdict.wait(WAIT_S) for s in job.engine.store.snapshots())
        self.entered, self.released, self.threads = threading.Event(), threading.Event(), []
        inner = trust.suspect

        def held(*args, **kwargs):
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.released.wait(WAIT_S)
            return inner(*args, **kwargs)

        monkeypatch.setattr(trust, "suspect", held)

    def release(self) -> None:
        self.released.set()


@pytest.mark.parametrize("where", ["weight", "state"])
def test_a_snapshot_whose_copy_holds_a_corruption_is_never_restored(where):
    job = Job()
    job.run(1, 10)
    at10 = job.state()
    _corrupt_at(job, 20, where)
    job.run(11, 20)  # the snapshot of step 20 holds the corruption
    assert job.engine.memory_steps in ([10, 20], [10])  # dropped once found: never restored
    assert job.engine.held_steps == [10]  # (its verification in flight or done: waited for)
    name, _ = _weight(job)
    (found,) = [(step, v) for _, step, v in job.engine.verifier.since(0) if not v.passed()]
    assert found[0] == 20 and found[1].bad == {name}
    assert job.engine.rollback() == 10
    assert_same_state(job.state(), at10)
    assert all(bool(torch.isfinite(p).all()) for p in job.model.parameters())
    assert job.engine.memory_steps == [10]
    job.run(11, 11)  # the next step end reports it
    refused = [f for f in job.engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
    assert refused and refused[0].labels["step"] == "20" and name in refused[0].message
    job.close()


def _rollback_while_held(job: Job, gate: Gate) -> int:
    """Rolls back on another thread while the newest snapshot's verification is held on the
    copier's thread; releases it once the rollback waits for it. Returns the step restored."""
    snap = job.engine.latest()
    assert gate.entered.wait(WAIT_S) and not snap.verdict.done()
    waiting, inner = threading.Event(), snap.verdict.wait
    snap.verdict.wait = lambda timeout: (waiting.set(), inner(timeout))[1]  # type: ignore[method-assign]
    out: list[int] = []
    rollback = threading.Thread(target=lambda: out.append(job.engine.rollback()))
    rollback.start()
    assert waiting.wait(WAIT_S) and not snap.verdict.done()  # the rollback waits for it
    gate.release()
    rollback.join(WAIT_S)
    assert not rollback.is_alive() and out
    return out[0]


def test_a_rollback_during_the_verification_waits_for_it_and_restores_the_snapshot_that_passed(monkeypatch):
    job = Job()
    job.run(1, 19)
    gate = Gate(monkeypatch, job)
    job.run(20, 20)
    at20 = job.state()
    job.run(21, 23)
    assert _rollback_while_held(job, gate) == 20
    assert_same_state(job.state(), at20)
    # off the training thread: on the copier's
    assert gate.threads and all(t.startswith("mscale-snapshot-late") for t in gate.threads), gate.threads
    job.close()


def test_a_rollback_during_the_verification_of_a_corrupted_copy_goes_to_the_snapshot_before(monkeypatch):
    job = Job()
    job.run(1, 10)
    at10 = job.state()
    _corrupt_at(job, 20, "weight")
    job.run(11, 19)
    gate = Gate(monkeypatch, job)
    job.run(20, 20)
    assert _rollback_while_held(job, gate) == 10
    assert_same_state(job.state(), at10)
    job.close()


def test_a_verification_that_does_not_finish_in_time_is_passed_over_for_the_snapshot_before(monkeypatch):
    job = Job()
    job.run(1, 10)
    at10 = job.state()
    job.run(11, 19)
    gate = Gate(monkeypatch, job)
    job.run(20, 20)
    assert gate.entered.wait(WAIT_S)  # held until after the rollback: it cannot finish in time
    job.engine.verifier.timeout_s = 0.05
    try:
        assert job.engine.held_steps == [10]
        assert job.engine.rollback() == 10
    finally:
        gate.release()
    assert_same_state(job.state(), at10)
    job.close()
