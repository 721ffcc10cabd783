"""The in-memory snapshot's copy runs beside the next step's forward and backward: the next
optimizer step waits for what is left of it, the snapshot still holds the exact pre-step state,
and the emergency write takes only a snapshot whose copy has landed.

The copier's background thread runs late copies in order, so a job queued on it first (a gate
the test opens) keeps a snapshot's copy in flight for as long as the test needs."""

from __future__ import annotations

import threading
import time

import torch
from test_snapshot import assert_same_state

from mscale.snapshot.format import list_snapshots
from mscale.snapshot.tensors import load_snapshot
from support.snapshot_inproc import Job


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.005)


def _hold_copies(job: Job) -> threading.Event:
    """Keeps the copies queued after this call in flight until the returned event is set."""
    gate = threading.Event()
    job.engine.copier._background.submit(gate.wait, 60)
    return gate


def test_the_optimizer_step_waits_for_the_copy_in_flight_and_the_snapshot_is_the_pre_step_state():
    job = Job(memory_every=10)
    job.run(1, 9)
    gate = _hold_copies(job)
    try:
        assert job.step(10)
        snap = job.engine.latest()
        assert snap is not None and snap.step == 10
        assert not snap.is_ready()  # the parameters' copy is still queued: training goes on
        at10 = job.state()
        copier = job.engine.copier
        waits = copier.waits
        stepped = threading.Thread(target=job.step, args=(11,))
        stepped.start()  # forward and backward run; the optimizer step must wait for the copy
        _wait_for(lambda: copier.waiting)
        for k, v in job.model.state_dict().items():
            assert torch.equal(v, at10["params"][k]), f"{k} changed before the snapshot copied it"
    finally:
        gate.set()
    stepped.join(60)
    assert not stepped.is_alive()
    assert copier.waits == waits + 1 and snap.is_ready()
    assert any(not torch.equal(v, at10["params"][k]) for k, v in job.model.state_dict().items())
    assert job.engine.rollback() == 10
    assert_same_state(job.state(), at10)
    job.close()


def test_a_step_right_after_each_snapshot_still_restores_bitwise():
    job = Job(memory_every=2, memory_keep=1)
    done = 0
    for target in (2, 4, 6):
        job.run(done + 1, target)  # the snapshot of `target`, then at once the next optimizer step
        at = job.state()
        assert job.step(target + 1)
        assert job.engine.rollback() == target
        assert_same_state(job.state(), at)
        done = target
    job.close()


def test_the_emergency_write_takes_the_newest_snapshot_whose_copy_landed(tmp_path):
    job = Job(tmp_path, memory_every=5, disk_every=0)
    job.run(1, 5)
    job.engine.latest().wait_ready(30)
    gate = _hold_copies(job)
    try:
        job.run(6, 10)
        pending = job.engine.latest()
        assert pending.step == 10 and not pending.is_ready()
        # the copy in flight is never waited for (on a lost GPU it never lands)
        path = job.engine.emergency(why="test").result(30)
        assert path == tmp_path / "step_00000005"
        assert [i.step for i in list_snapshots(tmp_path)] == [5]
        assert not pending.is_ready()
    finally:
        gate.set()
    pending.wait_ready(30)
    assert job.engine.emergency(why="test").result(30) == tmp_path / "step_00000010"
    assert load_snapshot(tmp_path / "step_00000010")[1]["step"] == 10
    job.close()


def test_wait_copy_lets_other_writers_wait_for_the_copy_in_flight():
    job = Job(memory_every=10)
    job.run(1, 9)
    gate = _hold_copies(job)
    assert job.step(10)
    snap = job.engine.latest()
    at10 = job.state()
    waited = threading.Thread(target=job.engine.wait_copy)
    waited.start()
    _wait_for(lambda: job.engine.copier.waiting)
    assert not snap.is_ready()
    gate.set()
    waited.join(60)
    assert not waited.is_alive() and snap.is_ready()
    with torch.no_grad():  # a write outside optimizer.step(), after wait_copy()
        for p in job.model.parameters():
            p.mul_(0.5)
    assert job.engine.rollback() == 10
    assert_same_state(job.state(), at10)
    job.close()
