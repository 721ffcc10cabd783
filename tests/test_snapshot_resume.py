"""Restores are bitwise: an uninterrupted run, the same run killed (SIGKILL) after step 120
and resumed from disk, and the same run rolled back in process from step 130 to the step-120
snapshot end with identical parameters and optimizer state, having used the identical
sequence of samples. And kill -9 at random points during disk writes never leaves a torn
snapshot: the newest complete one always verifies and loads."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mscale.sim.tinymm import TinyConfig
from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.engine import SnapshotEngine
from mscale.snapshot.format import list_snapshots, verify_snapshot
from support.snapshot_job import build
from support.zygote import Zygote

pytestmark = pytest.mark.slow  # real jobs killed and resumed: about 25 s


def effective_sequence(seen: Path) -> dict[int, list[int]]:
    """The batch each step finally used: the last draw logged for it."""
    out: dict[int, list[int]] = {}
    for line in seen.read_text().splitlines():
        step, idx = line.split(" ")
        out[int(step)] = [int(i) for i in idx.split(",")]
    return out


def draws(seen: Path) -> list[tuple[int, list[int]]]:
    return [
        (int(s), [int(i) for i in idx.split(",")])
        for s, idx in (line.split(" ") for line in seen.read_text().splitlines())
    ]


def test_uninterrupted_killed_and_resumed_and_rolled_back_runs_are_bitwise_identical(tmp_path):
    import json

    runs = {name: tmp_path / name for name in ("plain", "killed", "rollback")}
    for d in runs.values():
        d.mkdir()

    def args(d: Path, *extra: str) -> list[str]:
        return (
            "--dir",
            str(d / "snaps"),
            "--steps",
            "200",
            "--out",
            str(d / "final.safetensors"),
            "--seen",
            str(d / "seen.log"),
            "--result",
            str(d / "result.json"),
            *extra,
        )

    z = Zygote(tmp_path / "jobs.log")
    try:
        plain = z.run(*args(runs["plain"]))
        rollback = z.run(*args(runs["rollback"], "--fault-at", "130"))
        # killed: SIGKILL once step 120's snapshot is durable, while it trains on
        killed = z.run(*args(runs["killed"], "--durable-at", "120"))
        z.expect("DURABLE 120", killed)
        os.kill(killed, signal.SIGKILL)
        assert z.wait(killed) == -signal.SIGKILL
        resumed = z.run(*args(runs["killed"]))
        for pid in (plain, rollback, resumed):
            assert z.wait(pid) == 0, (tmp_path / "jobs.log").read_text()[-3000:]
    finally:
        z.close()

    results = {n: json.loads((d / "result.json").read_text()) for n, d in runs.items()}
    assert results["killed"]["resumed"] == 120
    assert results["rollback"]["rollbacks"] == [[130, 120]]
    assert results["plain"]["rollbacks"] == [] and results["plain"]["resumed"] is None

    finals = {n: load_file(d / "final.safetensors") for n, d in runs.items()}
    ref = finals["plain"]
    assert any(k.endswith("/exp_avg_sq") for k in ref) and len(ref) > 100
    for name in ("killed", "rollback"):
        assert finals[name].keys() == ref.keys()
        different = [k for k in ref if not torch.equal(ref[k], finals[name][k])]
        assert not different, f"{name}: {len(different)} tensors differ, e.g. {different[:3]}"
        # the grad scaler and the LR schedule end where the uninterrupted run's did
        assert results[name]["scale"] == results["plain"]["scale"] and results[name]["lr"] == results["plain"]["lr"]

    seqs = {n: effective_sequence(d / "seen.log") for n, d in runs.items()}
    assert sorted(seqs["plain"]) == list(range(1, 201))
    assert all(len(b) == 8 for b in seqs["plain"].values())
    # three epochs of 64 batches: each epoch covers the data set once, in a new order
    assert sorted(i for s in range(1, 65) for i in seqs["plain"][s]) == list(range(512))
    assert seqs["plain"][1] != seqs["plain"][65]
    assert seqs["killed"] == seqs["plain"] and seqs["rollback"] == seqs["plain"]
    # the rolled-back run saw 121..130 twice, the same samples each time
    rb = draws(runs["rollback"] / "seen.log")
    steps = [s for s, _ in rb]
    assert steps == list(range(1, 131)) + list(range(121, 201))
    assert rb[120:130] == rb[130:140]


def test_kill_9_during_disk_writes_never_leaves_a_torn_snapshot(tmp_path):
    """A job snapshots to disk every step (a ~4 MiB state) and is SIGKILLed at a random moment,
    then restarted (it resumes), 20 times, more until 3 kills landed mid-write: every step_
    directory verifies, and the newest loads."""
    seed = int(os.environ.get("MSCALE_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    d = tmp_path / "snaps"
    cfg = TinyConfig(vision_hidden=96, text_hidden=96)
    mid_write = 0
    resumed_from: list[str] = []
    z = Zygote(tmp_path / "jobs.log")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(40):  # 20 kills, more (up to 40) until 3 have landed during a write
            if i >= 20 and mid_write >= 3:
                break
            pid = z.run(
                "--dir",
                str(d),
                "--steps",
                "1000000",
                "--memory-every",
                "1",
                "--disk-every",
                "1",
                "--disk-keep",
                "3",
                "--hidden",
                "96",
                "--log-level",
                "warning",
            )
            resumed_from.append(z.expect("STARTED", pid)[1])
            # Wait until this incarnation has made progress (a snapshot newer than the one it
            # resumed from is on disk), so each kill lands in a running write loop however
            # loaded the machine is; then pick the kill point at random.
            before = max((s.step for s in list_snapshots(d)), default=-1) if d.exists() else -1
            deadline = time.monotonic() + 120
            while not (d.exists() and max((s.step for s in list_snapshots(d) if s.complete), default=-1) > before):
                assert time.monotonic() < deadline, f"seed {seed}, run {i}: no new snapshot within 120 s"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))  # the random kill point (not synchronisation)
            os.kill(pid, signal.SIGKILL)
            assert z.wait(pid) == -signal.SIGKILL
            mid_write += any(p.name.startswith(".tmp-") for p in d.iterdir()) if d.exists() else 0
            snaps = list_snapshots(d)
            for info in snaps:  # no step_ directory is ever torn
                assert info.complete, f"seed {seed}, kill {i}: {info.path} has no valid manifest"
                verify_snapshot(info.path)
            assert snaps, f"seed {seed}: kill {i} left no snapshot at all"
            model, opt, sched, scaler, loader, mpus = build(cfg=cfg)
            engine = SnapshotEngine(
                model,
                opt,
                mpus=mpus,
                scaler=scaler,
                scheduler=sched,
                data=loader,
                config=SnapshotConfig(directory=d, disk_every=0),
                job_id="snapshot-test",  # the job's: a run resumes only its own snapshots
            )
            assert engine.resume() == max(s.step for s in snaps)
            engine.close()
    finally:
        torch.set_num_threads(threads)
        z.close()
    assert mid_write >= 3, f"seed {seed}: only {mid_write} kills landed during a write"
    assert len(set(resumed_from) - {"None"}) >= 10  # the restarts resumed from successive snapshots
