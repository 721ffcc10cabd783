"""Several ranks (gloo on 127.0.0.1, DDP): one rank's batch turns NaN, every rank rolls back
to the same step and the job completes; a restart resumes every rank from the same step, the
newest one every rank holds valid."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mscale.snapshot.format import list_snapshots, verify_snapshot
from support import free_port
from support.zygote import Zygote

pytestmark = pytest.mark.slow  # 2- and 4-rank gloo jobs: about 20 s


def run_ranks(z: Zygote, tmp_path, name: str, world: int, *extra: str, snaps: str = "snaps") -> list[dict]:
    port = free_port()
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    pids = [
        z.run(
            "--dir",
            str(tmp_path / snaps),
            "--world",
            str(world),
            "--rank",
            str(r),
            "--port",
            str(port),
            "--result",
            str(out / f"rank{r}.json"),
            "--out",
            str(out / f"rank{r}.safetensors"),
            "--log-level",
            "warning",
            *extra,
        )
        for r in range(world)
    ]
    codes = [z.wait(pid) for pid in pids]
    assert codes == [0] * world, (tmp_path / "jobs.log").read_text()[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def finals(tmp_path, name: str, world: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(tmp_path / name / f"rank{r}.safetensors") for r in range(world)]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [2, 4])
def test_nan_on_one_rank_rolls_every_rank_back_to_the_same_step(tmp_path, world):
    z = Zygote(tmp_path / "jobs.log")
    try:
        faulty = world - 1
        results = run_ranks(
            z,
            tmp_path,
            "fault",
            world,
            "--steps",
            "40",
            "--disk-every",
            "20",
            "--fault-at",
            "25",
            "--fault-rank",
            str(faulty),
        )
        assert [r["rollbacks"] for r in results] == [[[25, 20]]] * world  # all ranks, same step
        assert [r["final_step"] for r in results] == [40] * world
        ranks = finals(tmp_path, "fault", world)
        assert all(same(ranks[0], other) for other in ranks[1:])  # DDP replicas still agree
        for r in range(world):  # each rank wrote its own snapshots, in its own directory
            steps = [i.step for i in list_snapshots(tmp_path / "snaps" / f"rank_{r:05d}")]
            assert steps == [20, 40]
        if world != 2:
            return
        # the rollback is invisible in the result: same parameters as a run without the fault
        run_ranks(z, tmp_path, "clean", world, "--steps", "40", "--disk-every", "0", snaps="clean-snaps")
        assert same(finals(tmp_path, "clean", world)[0], ranks[0])
        # restart: rank 1's newest snapshot is corrupted, so every rank resumes from step 20
        victim = tmp_path / "snaps" / "rank_00001" / "step_00000040" / "mpu_001_vision_state.safetensors"
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
        verify_snapshot(tmp_path / "snaps" / "rank_00000" / "step_00000040")  # rank 0's is fine...
        again = run_ranks(z, tmp_path, "resume", world, "--steps", "50", "--disk-every", "0")
        assert [r["resumed"] for r in again] == [20, 20]  # ...but no rank resumes from 40
        assert [r["final_step"] for r in again] == [50, 50]
        refused = [f for f in again[1]["findings"] if f["reason"] == "snapshot_refused"]
        assert refused and refused[0]["labels"]["file"] == victim.name
    finally:
        z.close()


def test_guard_plugin_rolls_every_rank_back_together(tmp_path):
    """Through the hook library: rank 1's NaN loss is its guard's LOSS_NONFINITE finding; the
    SnapshotPlugins of both ranks agree at step end and both roll back to guard step 20."""
    z = Zygote(tmp_path / "jobs.log")
    try:
        results = run_ranks(
            z,
            tmp_path,
            "guard",
            2,
            "--guard",
            "--steps",
            "40",
            "--disk-every",
            "0",
            "--fault-at",
            "25",
            "--fault-rank",
            "1",
        )
    finally:
        z.close()
    assert [r["rollbacks"] for r in results] == [[[25, 20]]] * 2
    ranks = finals(tmp_path, "guard", 2)
    assert same(ranks[0], ranks[1])
    assert all(torch.isfinite(t).all() for t in ranks[0].values())
