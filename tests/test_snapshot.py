"""Snapshot engine in one process: what a snapshot holds, rollback, the disk format, refusal
of corrupted or unsafe snapshots, disk full, emergency writes, and the Guard plugin."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mscale.findings import Reason
from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.engine import RollbackUnavailable, SnapshotEngine
from mscale.snapshot.format import (
    MANIFEST,
    NONMPU_FILE,
    NONMPU_OPTIM_FILE,
    TRAIN_STATE,
    SnapshotInvalid,
    list_snapshots,
    verify_snapshot,
)
from mscale.snapshot.plugin import SnapshotPlugin
from mscale.snapshot.tensors import load_snapshot
from support import require
from support.digest import blake3_tree
from support.snapshot_inproc import Job, two_disk_snapshots
from support.snapshot_job import build

MPU_FILES = [
    f"mpu_{m}_{kind}.safetensors" for m in ("001_vision", "002_aligner", "003_text") for kind in ("state", "optim")
]


def assert_same_state(a, b):
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for k in a["optim"]:
        assert torch.equal(a["optim"][k], b["optim"][k]), k
    assert a["lr"] == b["lr"] and a["scale"] == b["scale"] and a["tracker"] == b["tracker"]
    assert a["data"] == b["data"]
    assert (
        torch.equal(a["rng"][0], b["rng"][0])
        and a["rng"][1] == b["rng"][1]
        and np.array_equal(a["rng"][2], b["rng"][2])
    )


def assert_resumed_past_the_corrupted(fresh, corrupted, step: int, state: dict, why: str) -> None:
    """`fresh` refused the snapshot holding `corrupted` (a finding naming the file and `why`)
    and resumed the older one, of `step`, exactly `state`."""
    assert fresh.engine.resume() == step
    assert_same_state(fresh.state(), state)
    refused = [x for x in fresh.engine.findings if x.reason.value == "snapshot_refused"]
    assert [r.labels["file"] for r in refused] == [corrupted.name] and why in refused[0].message
    fresh.close()


def test_rollback_restores_every_part_of_the_state():
    job = Job()
    job.run(1, 20)
    at20 = job.state()
    job.run(21, 27)
    assert job.engine.memory_steps == [10, 20]
    assert job.state()["lr"] != at20["lr"]
    assert job.engine.rollback() == 20
    assert_same_state(job.state(), at20)
    assert job.engine.step == 20
    assert job.engine.recovery_seconds["memory"] > 0
    rb = [f for f in job.engine.findings if f.reason is Reason.ROLLBACK][-1]
    assert rb.labels["tag"] == "memory" and rb.labels["step"] == "20" and float(rb.labels["recovery_seconds"]) > 0
    # the snapshot survives its use: a second rollback lands on the same state
    job.run(21, 23)
    assert job.engine.rollback() == 20
    assert_same_state(job.state(), at20)
    job.close()


def test_rollback_replays_the_same_batches_and_can_skip_the_faulty_one():
    job = Job()
    job.run(1, 24)
    first = dict(job.seen)
    assert not job.step(25, fault=True)  # NaN loss: the update is never applied
    faulty = job.seen[25]
    assert job.engine.rollback(skip_batch=True) == 20
    job.run(21, 26)
    assert all(job.seen[s] == first[s] for s in range(21, 25))  # same samples, same order
    assert job.seen[25] != faulty  # the batch that caused the fault was stepped over
    # ... and it is exactly the batch that would have come after it
    order = job.loader.order(0)
    start = order.index(faulty[0])
    assert job.seen[25] == order[start + 8 : start + 16]
    job.close()


def test_rollback_to_a_named_step_drops_newer_snapshots_and_refuses_unknown_ones():
    job = Job(memory_keep=3)
    job.run(1, 30)
    assert job.engine.memory_steps == [10, 20, 30]
    with pytest.raises(RollbackUnavailable, match="step 15"):
        job.engine.rollback(15)
    assert job.engine.rollback(10) == 10
    assert job.engine.memory_steps == [10]  # 20 and 30 were the abandoned timeline
    job.close()


def test_rollback_without_snapshot_is_refused_and_changes_nothing():
    job = Job()
    job.run(1, 5)
    before = job.state()
    with pytest.raises(RollbackUnavailable):
        job.engine.rollback()
    assert_same_state(job.state(), before)
    job.close()


def test_disk_layout_manifest_and_binding(tmp_path):
    job = Job(tmp_path, memory_every=5, disk_every=10, disk_keep=2)
    for start in range(1, 40, 10):  # each write lands before the next is due: none superseded
        job.run(start, start + 9)
        job.engine.flush()
    infos = list_snapshots(tmp_path, include_incomplete=True)
    assert [i.step for i in infos] == [30, 40] and all(i.complete for i in infos)  # keep last 2
    snap = tmp_path / "step_00000040"
    names = sorted(p.name for p in snap.iterdir())
    assert names == sorted(MPU_FILES + [NONMPU_FILE, NONMPU_OPTIM_FILE, TRAIN_STATE, "resource_binding.json", MANIFEST])
    manifest = json.loads((snap / MANIFEST).read_text())
    assert (
        manifest["step"] == 40 and manifest["versions"]["torch"] == torch.__version__ and manifest["versions"]["mscale"]
    )
    for name in names:
        if name == MANIFEST:
            continue
        data = (snap / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), "blake3_tree": blake3_tree(data)}
    binding = json.loads((snap / "resource_binding.json").read_text())
    assert {k: v["name"] for k, v in binding["mpus"].items()} == {"001": "vision", "002": "aligner", "003": "text"}
    assert binding["mpus"]["001"]["device"] == "cpu"
    # per MPU: its own parameters, and in a second file their Adam moments; nothing else
    text = load_file(snap / "mpu_003_text_state.safetensors")
    text_optim = load_file(snap / "mpu_003_text_optim.safetensors")
    assert "model/language_model.lm_head.weight" in text and all(k.startswith("model/language_model.") for k in text)
    assert {
        "optim/language_model.lm_head.weight/exp_avg",
        "optim/language_model.lm_head.weight/exp_avg_sq",
    } <= text_optim.keys()
    assert all(k.startswith("optim/language_model.") for k in text_optim)
    assert len(text_optim) == 3 * sum(1 for _ in job.model.language_model.parameters())  # exp_avg, exp_avg_sq, step
    assert torch.equal(text["model/language_model.lm_head.weight"], job.model.language_model.lm_head.weight.detach())
    objects = torch.load(snap / TRAIN_STATE, weights_only=True)
    assert objects["step"] == 40 and objects["data"]["index"] == 40 * 8 % 256
    assert set(objects["rng"]) == {"python", "torch", "numpy"}
    job.close()


def test_resume_from_disk_restores_the_state_written(tmp_path):
    job = Job(tmp_path, memory_every=5, disk_every=10)
    job.run(1, 30)
    job.engine.flush()
    at30 = job.state()
    job.run(31, 33)
    job.close()
    fresh = Job(tmp_path)
    assert fresh.engine.resume() == 30
    assert_same_state(fresh.state(), at30)
    assert fresh.engine.recovery_seconds["disk"] > 0
    # until the first in-memory snapshot, a rollback goes back to the disk snapshot resumed from
    assert fresh.engine.memory_steps == [] and fresh.engine.held_steps == [30]
    fresh.run(31, 33)
    assert fresh.engine.rollback() == 30
    assert_same_state(fresh.state(), at30)
    assert [f.labels["tag"] for f in fresh.engine.findings if f.reason is Reason.ROLLBACK] == ["disk"]
    fresh.run(31, 40)
    assert fresh.engine.held_steps == [40]
    fresh.close()
    empty = Job(tmp_path / "none")
    assert empty.engine.resume() is None
    empty.close()


def test_parameters_outside_every_mpu_have_their_own_file(tmp_path):
    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.ones(4))
            self.register_buffer("calls", torch.zeros(()))

    model = Wrapped()
    opt = torch.optim.Adam(model.parameters())
    model.inner(torch.ones(2, 4)).mul(model.scale).sum().backward()
    opt.step()
    engine = SnapshotEngine(
        model, opt, config=SnapshotConfig(directory=tmp_path, disk_every=1), mpus={"text": ("007", model.inner)}
    )
    engine.step_end(1)
    engine.flush()
    assert set(load_file(tmp_path / "step_00000001" / NONMPU_FILE)) == {"model/scale", "model/calls"}
    rest = load_file(tmp_path / "step_00000001" / NONMPU_OPTIM_FILE)
    assert set(rest) == {"optim/scale/exp_avg", "optim/scale/exp_avg_sq", "optim/scale/step"}
    assert "model/inner.weight" in load_file(tmp_path / "step_00000001" / "mpu_007_text_state.safetensors")
    want = model.scale.detach().clone()
    with torch.no_grad():
        model.scale.zero_()
    engine.rollback()
    assert torch.equal(model.scale, want)
    engine.close()


def _corrupt_flip(snap: Path) -> str:
    f = snap / "mpu_003_text_state.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    return f.name


def _corrupt_truncate(snap: Path) -> str:
    f = snap / "mpu_001_vision_state.safetensors"
    os.truncate(f, f.stat().st_size // 3)
    return f.name


def _corrupt_remove(snap: Path) -> str:
    (snap / TRAIN_STATE).unlink()
    return TRAIN_STATE


def _corrupt_manifest(snap: Path) -> str:
    (snap / MANIFEST).write_text('{"format": "mscale-snapshot/1", "files": ')
    return MANIFEST


@pytest.mark.parametrize("corrupt", [_corrupt_flip, _corrupt_truncate, _corrupt_remove, _corrupt_manifest])
def test_corrupted_snapshot_is_refused_naming_the_file_and_the_older_one_used(tmp_path, corrupt):
    at10 = two_disk_snapshots(tmp_path)
    bad = corrupt(tmp_path / "step_00000020")
    with pytest.raises(SnapshotInvalid) as e:
        verify_snapshot(tmp_path / "step_00000020")
    assert e.value.file == bad and bad in str(e.value)
    fresh = Job(tmp_path)
    assert fresh.engine.resume() == 10
    assert_same_state(fresh.state(), at10)
    refused = [f for f in fresh.engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
    assert len(refused) == 1 and refused[0].labels["file"] == bad and bad in refused[0].message
    fresh.close()


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch evil-code-ran",))


def test_loading_never_runs_pickled_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = Job(tmp_path / "snaps", memory_every=10, disk_every=10)
    job.run(1, 20)
    job.close()
    snap = tmp_path / "snaps" / "step_00000020"
    # An attacker who can write the snapshot can also rewrite its manifest: the hash passes.
    payload = pickle.dumps({"format": "mscale-snapshot/1", "step": 20, "x": _Evil()}, protocol=2)
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:  # the torch.save container, with the evil pickle
        z.writestr("train_state/data.pkl", payload)
        z.writestr("train_state/version", "3\n")
    (snap / TRAIN_STATE).write_bytes(buf.getvalue())
    manifest = json.loads((snap / MANIFEST).read_text())
    manifest["files"][TRAIN_STATE] = {"size": len(buf.getvalue()), "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    (snap / MANIFEST).write_text(json.dumps(manifest))
    for check in (verify_snapshot, load_snapshot):  # consistent with its manifest, but refused unrun
        with pytest.raises(SnapshotInvalid) as e:
            check(snap)
        assert e.value.file == TRAIN_STATE
    fresh = Job(tmp_path / "snaps")
    assert fresh.engine.resume() == 10
    assert not (tmp_path / "evil-code-ran").exists()
    fresh.close()


@pytest.mark.root
def test_disk_full_is_a_finding_training_and_memory_snapshots_go_on(tmp_path):
    require(os.geteuid() == 0, "mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    require(r.returncode == 0, f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        job = Job(mnt / "snaps", memory_every=5, disk_every=10)
        job.run(1, 25)  # a snapshot (~0.5 MiB) does not fit in 256 KiB: both writes fail
        job.engine.flush()
        failed = [f for f in job.engine.findings if f.reason is Reason.SNAPSHOT_FAILED]
        assert len(failed) == 2 and all(f.labels["errno"] == "ENOSPC" for f in failed)
        assert failed[0].severity.value == "critical" and "training continues" in failed[0].message
        assert job.engine.memory_steps == [20, 25]
        assert list((mnt / "snaps").iterdir()) == []  # nothing torn left behind
        assert job.engine.rollback() == 25
        # space comes back: the next scheduled write succeeds
        subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)
        job.run(26, 30)
        job.engine.flush()
        assert [i.step for i in list_snapshots(mnt / "snaps")] == [30]
        verify_snapshot(mnt / "snaps" / "step_00000030")
        job.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)


def test_emergency_writes_the_latest_memory_snapshot_on_command_and_on_sigusr1(tmp_path):
    job = Job(tmp_path, memory_every=5, disk_every=0)  # no scheduled disk writes
    job.run(1, 7)
    assert list_snapshots(tmp_path) == []
    path = job.engine.emergency(why="test").result(30)
    assert path == tmp_path / "step_00000005"  # the last snapshot taken, not the live state
    assert load_snapshot(path)[1]["step"] == 5
    job.run(8, 10)
    job.engine.latest().wait_ready(30)  # a copy still in flight is not chosen (test_snapshot_overlap)
    old = signal.getsignal(signal.SIGUSR1)
    job.engine.install_signal_handler()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: (tmp_path / "step_00000010" / MANIFEST).exists())
        verify_snapshot(tmp_path / "step_00000010")
    finally:
        job.close()
    assert signal.getsignal(signal.SIGUSR1) == old  # close() puts the previous handler back


def test_emergency_without_memory_snapshot_is_a_finding(tmp_path):
    job = Job(tmp_path, memory_every=5, disk_every=0)
    fut = job.engine.emergency()
    with pytest.raises(Exception, match="no in-memory snapshot"):
        fut.result(30)
    assert any(f.reason is Reason.SNAPSHOT_FAILED for f in job.engine.findings)
    job.close()


def test_same_step_written_again_replaces_the_old_directory(tmp_path):
    job = Job(tmp_path, memory_every=10, disk_every=10)
    job.run(1, 14)
    assert not job.step(15, fault=True)
    job.engine.rollback(skip_batch=True)
    job.run(11, 20)
    job.engine.flush()
    first = load_snapshot(tmp_path / "step_00000020")[1]["data"]
    job.engine.rollback(skip_batch=True)  # skip the batch of step 20 this time
    job.run(11, 20)
    job.engine.flush()
    second = load_snapshot(tmp_path / "step_00000020")[1]["data"]
    assert first != second and [i.step for i in list_snapshots(tmp_path, include_incomplete=True)] == [10, 20]
    job.close()


def test_guard_plugin_drives_the_engine_and_rolls_back_on_a_nonfinite_loss(tmp_path):
    from mscale.hook import attach

    model, opt, sched, scaler, loader, mpus = build(dataset_size=256)
    plugin = SnapshotPlugin(
        config=SnapshotConfig(directory=tmp_path, memory_every=5, disk_every=5),
        data=loader,
        scheduler=sched,
        rollback_on={Reason.LOSS_NONFINITE},
    )
    guard = attach(model, opt, job_id="plugin-test", connect=False, cmsa=False, plugins=[plugin])
    engine = plugin.engine
    assert {m: e["name"] for m, e in engine._binding()["mpus"].items()} == {m.mpu_id: m.name for m in guard.mpus}

    def one_step(nan=False):
        batch = loader.next_batch()
        images = batch["images"] * (float("nan") if nan else 1.0)
        loss = model(images, batch["tokens"])["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

    for _ in range(10):
        one_step()
    assert guard.current_step == 10 and engine.memory_steps == [0, 5]  # the guard counts from 0
    target = 5
    one_step(nan=True)
    assert plugin.rollbacks and plugin.rollbacks[-1]["to"] == target
    assert guard.current_step == target + 1
    assert any(f.reason is Reason.ROLLBACK for f in guard.findings)
    # One command route: the agent's heal commands ({"type": "heal", "action": "emergency_snapshot"
    # | "rollback"}), which the Fuse carries out on its engine; the plugin answers no command.
    assert getattr(plugin, "on_command", None) is None
    # A write made in the writer thread reaches the guard in the training thread, at its next call.
    engine.save(wait=True)

    def on_demand():
        return [f for f in guard.findings if f.reason is Reason.SNAPSHOT_WRITTEN and f.labels.get("why") == "demand"]

    assert on_demand() == []
    one_step()
    assert [f.labels["step"] for f in on_demand()] == [str(target)]
    verify_snapshot(tmp_path / f"step_{target:08d}")
    guard.detach()
    engine.close()


def test_guard_with_a_grad_scaler_rolls_back_a_nan_step_the_scaler_skipped(tmp_path):
    """torch.amp.GradScaler skips optimizer.step() when it finds NaN gradients, so the step's
    end is observed at scaler.update(): the NaN loss still triggers the rollback, and the
    scaler's state comes back with the rest."""
    from mscale.hook import attach

    model, opt, sched, scaler, loader, mpus = build(dataset_size=256)
    plugin = SnapshotPlugin(
        config=SnapshotConfig(memory_every=5),
        data=loader,
        scheduler=sched,
        scaler=scaler,
        rollback_on={Reason.LOSS_NONFINITE},
    )
    guard = attach(model, opt, job_id="scaler-test", connect=False, cmsa=False, plugins=[plugin])
    steps_run = []

    def one_step(nan=False):
        steps_run.append(guard.current_step)
        batch = loader.next_batch()
        images = batch["images"] * (float("nan") if nan else 1.0)
        loss = model(images, batch["tokens"])["loss"]
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()

    for _ in range(10):
        one_step()
    assert guard.current_step == 10 and plugin.engine.memory_steps == [0, 5]
    held = 5
    scale_at_snapshot = plugin.engine.latest().objects["scaler"]["scale"]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    one_step(nan=True)
    assert scaler.get_scale() == scale_at_snapshot  # restored, not the halved scale of the NaN step
    assert plugin.rollbacks and plugin.rollbacks[-1]["to"] == held
    assert guard.current_step == held + 1
    assert [f.reason for f in guard.findings if f.reason in (Reason.LOSS_NONFINITE, Reason.ROLLBACK)] == [
        Reason.LOSS_NONFINITE,
        Reason.ROLLBACK,
    ]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    one_step()  # training goes on from the restored step, through the scaler
    assert guard.current_step == held + 2 and steps_run[-1] == held + 1
    assert any(not torch.equal(weights[k], v) for k, v in model.state_dict().items())
    guard.detach()
    assert "update" not in scaler.__dict__  # the scaler is as it was
    plugin.engine.close()


def test_a_partial_copy_back_restores_only_the_wanted_tensors_and_their_optimizer_state():
    """The one partial restore (an L1 swap's corrupted weights, a weight repair) copies back the
    wanted parameters and their optimizer state, bitwise, and leaves every other tensor as it is."""
    job = Job()
    job.run(1, 10)
    snap = job.engine.latest()
    snap.wait_ready()
    names = [n for n, _ in job.model.named_parameters()]
    wanted, other = names[0], names[-1]
    at10 = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    moment = {n: job.opt.state[p]["exp_avg"].clone() for n, p in job.model.named_parameters()}
    job.run(11, 12)
    after = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    n = snap.copy_back(job.model, job.opt, lambda _file, name: name == wanted)
    live = dict(job.model.named_parameters())
    assert n == 1
    assert torch.equal(live[wanted], at10[wanted]) and not torch.equal(after[wanted], at10[wanted])
    assert torch.equal(job.opt.state[live[wanted]]["exp_avg"], moment[wanted])
    assert torch.equal(live[other], after[other]) and not torch.equal(live[other], at10[other])
    assert not torch.equal(job.opt.state[live[other]]["exp_avg"], moment[other])
    job.close()
