"""The guard on a model sharded with FSDP2 `fully_shard` (torch 2.13 runs it on CPU with gloo):
per-MPU gradient norms over all shards, the step agreement, and snapshots of each rank's shard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO
from support.ddp_run import run_job


def _tiny():
    from mscale.sim.tinymm import TinyConfig, TinyMultimodal

    return TinyMultimodal(TinyConfig())


@pytest.mark.slow
def test_fsdp2_norms_cover_every_shard_and_a_nan_on_one_rank_drops_the_step_everywhere(tmp_path: Path) -> None:
    ranks = run_job(tmp_path, wrap="fsdp", scenario="nan")
    for r in ranks:
        assert r["sharded"] and r["finite"] and r["final_step"] == 8
        assert not r["replicas"]  # shards are not replicas: no fingerprint comparison
        for step in r["norms"]:
            for name, (guard_norm, whole) in step.items():
                if guard_norm == guard_norm:  # NaN at the faulty step on every rank
                    assert guard_norm == pytest.approx(whole, rel=1e-5), name
        assert [e["step"] for e in r["ends"] if e["skip"]] == [3]
        assert r["ends"][3]["hash"] == r["ends"][2]["hash"] != r["ends"][4]["hash"]  # this rank's shard kept
    for a, b in zip(ranks[0]["norms"], ranks[1]["norms"], strict=True):
        for name in a:
            if a[name][0] == a[name][0]:  # the same whole-gradient norm on every rank
                assert a[name][0] == pytest.approx(b[name][0], rel=1e-9)
    assert ranks[0]["hash"] != ranks[1]["hash"]  # each rank holds its own shard


@pytest.mark.slow
def test_fsdp2_snapshots_hold_each_ranks_shard_and_a_rollback_restores_it_bitwise(tmp_path: Path) -> None:
    """With snapshots: a NaN on rank 1 at step 3 rolls both ranks back to step 2 (each restoring
    its own shard of the weights and of the optimizer state) and the replay ends bitwise where
    a run without the fault ends, rank by rank. The disk snapshots hold each rank's shard."""
    snaps = tmp_path / "snaps"
    (tmp_path / "faulty").mkdir()
    (tmp_path / "clean").mkdir()
    faulty = run_job(tmp_path / "faulty", wrap="fsdp", scenario="nan", snapshots=True, snapdir=snaps, disk_every=4)
    clean = run_job(tmp_path / "clean", wrap="fsdp", scenario="plain", snapshots=True)
    for f, c in zip(faulty, clean, strict=True):
        assert f["rollbacks"] == [{"step": 3, "to": 2}] and c["rollbacks"] == []
        assert f["sharded"] and f["finite"] and f["final_step"] == c["final_step"] == 8
        assert f["hash"] == c["hash"]  # the restore of the shard was bitwise, optimizer state included
    assert faulty[0]["hash"] != faulty[1]["hash"]
    from safetensors import safe_open

    shapes = []
    for rank in (0, 1):
        (step_dir,) = sorted((snaps / f"rank_{rank:05d}").glob("step_*"))[-1:]
        f = next(step_dir.glob("mpu_001_*_state.safetensors"))
        with safe_open(str(f), framework="pt") as st:
            shapes.append({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    full = {"model/" + k: tuple(v.shape) for k, v in _tiny().vision_tower.state_dict().items()}
    key = next(k for k in shapes[0] if k.endswith("patch_embed.weight"))
    assert shapes[0][key][0] + shapes[1][key][0] == full[key.replace("model/vision_tower.", "model/")][0]
    # a shard is not a whole model: the DCP export refuses it and says why
    done = subprocess.run(
        [sys.executable, "-m", "mscale", "snapshot", "export", "--format", "dcp", str(snaps), str(tmp_path / "dcp")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "one rank's shard" in done.stderr and not (tmp_path / "dcp").exists()
