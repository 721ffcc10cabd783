"""Snapshots load only what their manifest vouches for (issue 16, item 6).

Real snapshots written by the real engine, then tampered with: files removed from the manifest
and altered, malformed manifests, FIFOs, devices, directories and symbolic links in place of
files, a corrupted tensor file. Each is refused by `verify`, `list` and `inspect` with a reason
and exit status 1 (never a traceback, never a hang), and `resume` falls back to the previous
good snapshot with a `snapshot_refused` finding. The manifest parser is fuzzed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mscale.cli import main
from mscale.findings import Reason
from mscale.snapshot import format as fmt
from mscale.snapshot.manifest import MAX_DEPTH, parse_manifest, required_files
from support import REPO
from support.fuzz import json_values
from support.snapshot_inproc import Job, two_disk_snapshots

STEP = "step_00000020"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Snapshots of steps 10 and 20, and the state at step 10 (what a fallback must restore)."""
    d = tmp_path_factory.mktemp("pristine") / "snaps"
    at10 = two_disk_snapshots(d)
    return d, at10


@pytest.fixture
def snaps(pristine, tmp_path):
    d = tmp_path / "snaps"
    shutil.copytree(pristine[0], d, symlinks=True)
    return d


def edit_manifest(snap: Path, change) -> None:
    m = json.loads((snap / fmt.MANIFEST).read_text())
    change(m)
    (snap / fmt.MANIFEST).write_text(json.dumps(m))


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["snapshot", *argv])
    return code, out.getvalue(), err.getvalue()


def cli_process(*argv: str) -> subprocess.CompletedProcess:
    """The real command in its own process: a hang fails the test (timeout), not the suite."""
    return subprocess.run(
        [sys.executable, "-m", "mscale", "snapshot", *argv], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def assert_resumes_older(d: Path, at10: dict, file: str) -> None:
    """A fresh job resumes step 10, bitwise, with a finding naming `file`; bounded in time."""
    fresh = Job(d)
    got: list = []
    t = threading.Thread(target=lambda: got.append(fresh.engine.resume()), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "resume hangs"
    assert got == [10]
    state = fresh.state()
    assert all(torch.equal(state["params"][k], v) for k, v in at10["params"].items())
    assert state["optim"].keys() == at10["optim"].keys()
    assert all(torch.equal(state["optim"][k], v) for k, v in at10["optim"].items())
    assert (state["lr"], state["data"]) == (at10["lr"], at10["data"])
    refused = [f for f in fresh.engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
    assert len(refused) == 1 and refused[0].labels["file"] == file and refused[0].labels["step"] == "20"
    fresh.close()


# -- a file taken out of the manifest, then altered ------------------------------------------


def _lr_changed(snap: Path) -> str:
    objects = torch.load(snap / fmt.TRAIN_STATE, weights_only=True)
    objects["scheduler"]["_last_lr"] = [lr * 10 for lr in objects["scheduler"]["_last_lr"]]
    for g in objects["optimizer"]["param_groups"]:
        g["lr"] *= 10
    torch.save(objects, snap / fmt.TRAIN_STATE)
    return fmt.TRAIN_STATE


def _vision_optimizer_emptied(snap: Path) -> str:
    from safetensors.torch import save_file

    name = "mpu_001_vision_optim.safetensors"
    save_file({}, snap / name)
    return name


@pytest.mark.parametrize("alter", [_lr_changed, _vision_optimizer_emptied])
def test_a_file_removed_from_the_manifest_and_altered_is_refused(snaps, pristine, alter):
    snap = snaps / STEP
    name = alter(snap)
    edit_manifest(snap, lambda m: m["files"].pop(name))
    with pytest.raises(fmt.SnapshotInvalid) as e:
        fmt.verify_snapshot(snap)
    assert e.value.file == fmt.MANIFEST and f"does not list {name}" in e.value.why
    code, out, _ = cli("verify", str(snaps))
    assert code == 1 and f"FAILED  step 20  {snap}: manifest.json: does not list {name}" in out
    assert "OK      step 10" in out
    code, _, err = cli("list", str(snaps))
    assert code == 1 and f"does not list {name}" in err
    code, out, err = cli("inspect", str(snaps))
    assert code == 1 and out == "" and f"does not list {name}" in err
    assert_resumes_older(snaps, pristine[1], fmt.MANIFEST)


def test_the_optimizer_flag_and_its_files_cannot_be_removed_together(snaps, pristine):
    """Declaring no optimizer and listing none of its files: the train state still holds
    optimizer state, so the manifest is refused (the optimizer would restore empty)."""
    snap = snaps / STEP

    def drop(m: dict) -> None:
        m["optimizer"] = False
        for name in [n for n in m["files"] if "_optim." in n]:
            del m["files"][name]

    edit_manifest(snap, drop)
    with pytest.raises(fmt.SnapshotInvalid, match="optimizer files do not match the train state") as e:
        fmt.verify_snapshot(snap)
    assert e.value.file == fmt.MANIFEST
    edit_manifest(snap, lambda m: m.pop("optimizer"))  # as an older manifest would be
    with pytest.raises(fmt.SnapshotInvalid, match="optimizer files do not match"):
        fmt.verify_snapshot(snap)
    assert_resumes_older(snaps, pristine[1], fmt.MANIFEST)


def test_an_older_manifest_without_the_optimizer_flag_still_verifies(snaps):
    edit_manifest(snaps / STEP, lambda m: m.pop("optimizer"))
    assert fmt.verify_snapshot(snaps / STEP)["step"] == 20


# -- malformed manifests and files of the wrong kind ----------------------------------------


def _size_abc(snap: Path) -> str:
    edit_manifest(snap, lambda m: m["files"][fmt.TRAIN_STATE].update(size="abc"))
    return "size must be an integer"


def _nul_name(snap: Path) -> str:
    edit_manifest(snap, lambda m: m["files"].update({"a\0b": {"size": 1, "sha256": "0" * 64}}))
    return "file name 'a\\x00b'"


def _long_name(snap: Path) -> str:
    edit_manifest(snap, lambda m: m["files"].update({"x" * 300: {"size": 1, "sha256": "0" * 64}}))
    return "is not 1-255 of"


def _deep(snap: Path) -> str:
    raw = (snap / fmt.MANIFEST).read_text()
    (snap / fmt.MANIFEST).write_text(raw[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return f"nested deeper than {MAX_DEPTH}"


def _step_text(snap: Path) -> str:
    edit_manifest(snap, lambda m: m.update(step="20"))
    return "step must be an integer"


def _escape_name(snap: Path) -> str:
    edit_manifest(snap, lambda m: m["files"].update({"../evil": {"size": 1, "sha256": "0" * 64}}))
    return "file name '../evil'"


def _unknown_file(snap: Path) -> str:
    (snap / "extra.safetensors").write_bytes(b"")
    edit_manifest(
        snap, lambda m: m["files"].update({"extra.safetensors": {"size": 0, "sha256": hashlib.sha256().hexdigest()}})
    )
    return "lists extra.safetensors, which is not a file of"


def _not_json(snap: Path) -> str:
    (snap / fmt.MANIFEST).write_bytes(b'{"format": "mscale-snapshot/1", "files": \xff')
    return "not UTF-8"


@pytest.mark.parametrize(
    "malform", [_size_abc, _nul_name, _long_name, _deep, _step_text, _escape_name, _unknown_file, _not_json]
)
def test_a_malformed_manifest_is_refused_with_a_reason_everywhere(snaps, pristine, malform):
    snap = snaps / STEP
    reason = malform(snap)
    with pytest.raises(fmt.SnapshotInvalid) as e:
        fmt.verify_snapshot(snap)
    assert e.value.file == fmt.MANIFEST and reason in e.value.why
    for command in ("verify", "list", "inspect"):
        code, out, err = cli(command, str(snaps))  # a traceback would raise here
        assert code == 1 and reason in out + err, command
    assert_resumes_older(snaps, pristine[1], fmt.MANIFEST)


def _directory(snap: Path, name: str) -> str:
    (snap / name).unlink()
    (snap / name).mkdir()
    return "a directory: refused"


def _fifo(snap: Path, name: str) -> str:
    (snap / name).unlink()
    os.mkfifo(snap / name)
    return "a FIFO: refused"


def _dev_zero(snap: Path, name: str) -> str:
    (snap / name).unlink()
    (snap / name).symlink_to("/dev/zero")
    return "a symbolic link: refused"


def _outside_twin(snap: Path, name: str) -> str:
    twin = snap.parent.parent / f"twin-{name}"  # identical bytes, outside the snapshot
    shutil.copyfile(snap / name, twin)
    (snap / name).unlink()
    (snap / name).symlink_to(twin)
    return "a symbolic link: refused"


@pytest.mark.slow  # 12 cases, each CLI run in a subprocess: about 16 s
@pytest.mark.parametrize("replace", [_directory, _fifo, _dev_zero, _outside_twin])
@pytest.mark.parametrize("name", ["mpu_002_aligner_state.safetensors", fmt.TRAIN_STATE, fmt.MANIFEST])
def test_anything_but_a_regular_file_inside_the_snapshot_is_refused_without_hanging(snaps, pristine, replace, name):
    snap = snaps / STEP
    reason = replace(snap, name)
    for command in ("verify", "list", "inspect"):
        r = cli_process(command, str(snaps))
        assert "Traceback" not in r.stderr
        if command == "list" and name != fmt.MANIFEST:  # list reads manifests only
            assert r.returncode == 0 and "complete" in r.stdout
            continue
        assert r.returncode == 1 and f"{name}: {reason}" in r.stdout + r.stderr, (command, r.stdout, r.stderr)
    assert_resumes_older(snaps, pristine[1], name)


def test_inspect_of_a_corrupted_tensor_file_exits_1(snaps):
    f = snaps / STEP / "mpu_001_vision_state.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40
    f.write_bytes(bytes(data))
    code, out, err = cli("inspect", str(snaps))
    assert code == 1 and out == "" and "mpu_001_vision_state.safetensors: BLAKE3 differs" in err
    code, out, _ = cli("inspect", "--step", "10", str(snaps))
    assert code == 0 and "step       10" in out


def test_a_disk_snapshot_refused_at_rollback_falls_back_to_an_older_one(snaps, pristine):
    """Resumed from step 20, no in-memory snapshot yet: a rollback goes to step 20 on disk;
    tampered with since, it is refused with a finding and step 10 restored instead."""
    fresh = Job(snaps)
    assert fresh.engine.resume() == 20
    fresh.run(21, 23)
    os.truncate(snaps / STEP / "mpu_003_text_optim.safetensors", 100)
    assert fresh.engine.rollback() == 10
    state = fresh.state()
    assert all(torch.equal(state["params"][k], v) for k, v in pristine[1]["params"].items())
    assert all(torch.equal(state["optim"][k], v) for k, v in pristine[1]["optim"].items())
    refused = [f for f in fresh.engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
    assert [f.labels["file"] for f in refused] == ["mpu_003_text_optim.safetensors"]
    assert fresh.engine.held_steps == [10]
    fresh.close()


def test_the_writer_never_writes_a_manifest_its_loader_would_refuse(tmp_path):
    """A job id the schema refuses (a terminal escape in it): the write fails loudly (a
    finding, no step_ directory), instead of leaving a snapshot that can never be loaded."""
    job = Job(tmp_path, memory_every=5, disk_every=5, job_id="run\x1b[2J")
    job.run(1, 5)
    job.engine.flush()
    failed = [f for f in job.engine.findings if f.reason is Reason.SNAPSHOT_FAILED]
    assert len(failed) == 1 and "job_id and why must be printable" in failed[0].message
    assert fmt.list_snapshots(tmp_path, include_incomplete=True) == []
    job.close()


# -- fuzzing the manifest parser --------------------------------------------------------------

JSON = json_values(int_bound=2**70, max_key=12)


@pytest.fixture(scope="module")
def valid_manifest(pristine) -> bytes:
    return (pristine[0] / STEP / fmt.MANIFEST).read_bytes()


def check_parse(raw: bytes) -> None:
    """A clear refusal or a valid result: never another exception."""
    path = Path("/snapshots/step_00000020")
    try:
        m = parse_manifest(raw, path)
    except fmt.SnapshotInvalid as e:
        assert e.file == fmt.MANIFEST and e.why and str(e).startswith(f"snapshot {path} refused: manifest.json: ")
        return
    assert m == json.loads(raw) and required_files(m).keys() == m["files"].keys()
    assert all(isinstance(f["size"], int) and len(f["blake3_tree"]) == 64 for f in m["files"].values())


@given(st.binary(max_size=300))
def test_fuzz_manifest_parser_with_bytes(raw):
    check_parse(raw)


@given(st.data())
def test_fuzz_manifest_parser_with_a_mutated_real_manifest(valid_manifest, data):
    m = json.loads(valid_manifest)
    # replace, add or remove a value somewhere in the manifest
    target = m
    for _ in range(data.draw(st.integers(0, 3))):
        if not isinstance(target, dict) or not target:
            break
        key = data.draw(st.sampled_from(sorted(target)))
        if not isinstance(target[key], dict):
            break
        target = target[key]
    if isinstance(target, dict):
        key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=300))
        if data.draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = data.draw(JSON)
    check_parse(json.dumps(m).encode())


@given(st.integers(1, 200_000), st.sampled_from(["[", '{"a":']))
def test_fuzz_manifest_parser_with_deep_nesting(depth, opener):
    closer = "]" if opener == "[" else "}"
    raw = b'{"format": "mscale-snapshot/1", "x": ' + (opener * depth + "1" + closer * depth).encode() + b"}"
    check_parse(raw)


@given(st.binary(max_size=200))
@pytest.mark.slow  # fuzzed CLI runs: about 2 s
def test_fuzz_the_cli_on_a_snapshot_directory_changes_nothing(pristine, tmp_path_factory, raw):
    """Whatever the manifest holds, `list` and `verify` answer 0 or 1 and touch no file."""
    d = tmp_path_factory.getbasetemp() / "fuzz" / STEP
    if not d.exists():
        shutil.copytree(pristine[0] / STEP, d)
    (d / fmt.MANIFEST).write_bytes(raw)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for command in ("list", "verify"):
        code, _, _ = cli(command, str(d))
        assert code in (0, 1)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
