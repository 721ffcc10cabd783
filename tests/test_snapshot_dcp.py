"""`mscale snapshot export --format dcp`: a snapshot written as a torch.distributed.checkpoint
that dcp.load reads back bitwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from support import REPO
from support.snapshot_inproc import Job


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> tuple[Path, dict, dict]:
    d = tmp_path_factory.mktemp("dcp") / "snaps"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    job = Job(d, memory_every=5, disk_every=5)
    job.run(1, 5)
    job.engine.flush()
    weights = {k: v.detach().clone() for k, v in job.model.state_dict().items()}
    names = {id(p): n for n, p in job.model.named_parameters()}
    optim = {names[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in job.opt.state.items()}
    job.close()
    torch.set_num_threads(threads)
    return d, weights, optim


def export(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mscale", "snapshot", "export", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_exported_checkpoint_loads_bitwise_with_dcp(snapshot, tmp_path: Path) -> None:
    d, weights, optim = snapshot
    out = tmp_path / "dcp"
    done = export("--format", "dcp", str(d), str(out))
    assert done.returncode == 0, done.stderr
    assert "step 5" in done.stdout and (out / ".metadata").is_file()
    fresh = {k: torch.zeros_like(v) for k, v in weights.items()}
    dcp.load({"model": fresh}, checkpoint_id=str(out))  # in place, single process
    assert fresh.keys() == weights.keys()
    for k in weights:
        assert torch.equal(fresh[k], weights[k]), k
    name, state = next(iter(optim.items()))
    exp_avg = torch.zeros_like(state["exp_avg"])
    dcp.load({"optim": {"state": {name: {"exp_avg": exp_avg}}}}, checkpoint_id=str(out))
    assert torch.equal(exp_avg, state["exp_avg"])
    meta = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
    assert "train.step" in meta and sum(k.startswith("optim.state.") for k in meta) >= len(optim)


@pytest.mark.slow  # two exports as a user runs them: a torch import each
def test_export_refuses_a_non_empty_target_and_a_corrupted_snapshot(snapshot, tmp_path: Path) -> None:
    d, _, _ = snapshot
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("mine")
    done = export("--format", "dcp", str(d), str(busy))
    assert done.returncode == 1 and "not an empty directory" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in busy.iterdir()) == ["x"]
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-r", str(d), str(bad)], check=True, timeout=60)
    victim = next((bad / "step_00000005").glob("mpu_*_state.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = tmp_path / "out"
    done = export("--format", "dcp", "--step", "5", str(bad), str(out))
    assert done.returncode == 1 and victim.name in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
