"""The guard on a model sharded with FSDP2 `fully_shard` (torch 2.13 runs it on CPU with gloo):
per-MPU gradient norms over all shards, the step agreement, and snapshots refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.ddp_run import run_job


@pytest.mark.slow
def test_fsdp2_norms_cover_every_shard_and_a_nan_on_one_rank_drops_the_step_everywhere(tmp_path: Path) -> None:
    ranks = run_job(tmp_path, wrap="fsdp", scenario="nan")
    for r in ranks:
        assert r["sharded"] and r["finite"] and r["final_step"] == 8
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
def test_fsdp2_with_snapshots_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (r,) = run_job(tmp_path, wrap="fsdp", snapshots=True, fails=True)
    assert "parameters are sharded (FSDP2 DTensors)" in r["log"]
    assert "Attach without snapshots=" in r["log"] and "torch.distributed.checkpoint" in r["log"]
