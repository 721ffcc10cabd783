"""`mscale snapshot list|verify|inspect DIR`, and the torch-free format module it uses."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import pty
import select
import shutil
import struct
import subprocess
import sys
import zipfile
from collections import Counter, OrderedDict

import pytest
import torch

from mscale.cli import main
from mscale.snapshot import format as fmt
from support import REPO
from support.snapshot_inproc import Job


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "snaps"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    job = Job(d, memory_every=10, disk_every=10)
    job.run(1, 20)
    job.engine.flush()
    job.close()
    torch.set_num_threads(threads)
    torn = d / ".tmp-step_00000030-123-abcd"  # what a crash mid-write leaves
    torn.mkdir()
    (torn / "mpu_001_vision_state.safetensors").write_bytes(b"\0" * 100)
    return d


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["snapshot", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_shows_complete_and_interrupted_snapshots(snaps, capsys):
    code, out, _ = cli(capsys, "list", str(snaps))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["RANK", "STEP", "STATUS"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[1], r[2]) for r in rows] == [("10", "complete"), ("20", "complete"), ("30", "incomplete")]
    code, out, _ = cli(capsys, "list", "--json", str(snaps))
    entries = [json.loads(line) for line in out.splitlines()]
    assert [e["step"] for e in entries if e["complete"]] == [10, 20] and all(
        e["bytes"] > 100_000 for e in entries if e["complete"]
    )


def test_verify_passes_then_names_the_corrupted_file(snaps, tmp_path, capsys):
    code, out, err = cli(capsys, "verify", str(snaps))
    assert code == 0 and out.count("OK ") == 2 and "1 incomplete" in out
    assert "verifying" not in err  # no progress bar when stderr is not a terminal
    broken = tmp_path / "broken"
    shutil.copytree(snaps, broken)
    f = broken / "step_00000020" / "mpu_002_aligner_state.safetensors"
    data = bytearray(f.read_bytes())
    data[200] ^= 0x10
    f.write_bytes(bytes(data))
    code, out, _ = cli(capsys, "verify", str(broken))
    assert code == 1
    assert "FAILED  step 20" in out and "mpu_002_aligner_state.safetensors: BLAKE3 differs" in out
    assert "OK      step 10" in out
    code, out, _ = cli(capsys, "verify", "--step", "10", str(broken))
    assert code == 0 and "step 20" not in out
    code, out, _ = cli(capsys, "verify", "--newest", str(broken))
    assert code == 1 and "step 10" not in out


def test_inspect_shows_what_the_snapshot_holds(snaps, capsys):
    code, out, _ = cli(capsys, "inspect", str(snaps))
    assert code == 0
    assert "step       20" in out and "AdamW" in out and "mpu_003_text_state.safetensors" in out
    assert "001  vision" in out and "resumable_loader" in out
    code, out, _ = cli(capsys, "inspect", "--json", "--step", "10", str(snaps))
    info = json.loads(out)
    assert info["step"] == 10 and info["optimizer"]["class"] == "AdamW"
    assert info["data"]["index"] == 80 and info["scheduler"]["last_epoch"] == 10
    assert set(info["mpus"]) == {"001", "002", "003"} and info["rng"] == ["numpy", "python", "torch"]


def test_rank_directories_and_bad_arguments(snaps, tmp_path, capsys):
    multi = tmp_path / "multi"
    for r in (0, 1):
        shutil.copytree(snaps / "step_00000020", multi / f"rank_{r:05d}" / "step_00000020")
    code, out, _ = cli(capsys, "list", str(multi))
    assert code == 0 and len(out.splitlines()) == 3
    code, out, _ = cli(capsys, "verify", str(multi))
    assert code == 0 and out.count("OK ") == 2
    code, _, err = cli(capsys, "verify", str(tmp_path / "nowhere"))
    assert code == 2 and "no such directory" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, "list", str(tmp_path / "empty"))
    assert code == 2 and "no snapshots" in err
    code, _, err = cli(capsys, "inspect", "--step", "999", str(snaps))
    assert code == 2 and "step 999" in err


def test_verify_draws_a_progress_bar_on_a_terminal(snaps):
    """The real command, stderr on a pseudo-terminal."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mscale", "snapshot", "verify", str(snaps)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    tty = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        assert ready, "no output on the terminal"
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        tty += chunk
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    os.close(master)
    assert b"\rverifying [" in tty and b"100.0%" in tty
    assert out.count("OK ") == 2


# -- without torch -------------------------------------------------------------------------

HIDE_TORCH = "import sys\nfor m in ('torch', 'numpy', 'safetensors'): sys.modules[m] = None  # import fails\n"


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # CLI subprocesses: about 2 s
def test_the_cli_runs_with_torch_not_importable(snaps, capsys):
    """Each command prints, byte for byte, what it prints in this process (where torch is
    loaded), in a process where `import torch` (and numpy, safetensors) fails."""
    commands = [
        ["list", str(snaps)],
        ["list", "--json", str(snaps)],
        ["verify", str(snaps)],
        ["inspect", str(snaps)],
        ["inspect", "--json", "--step", "10", str(snaps)],
    ]
    for argv in commands:
        code, out, _ = cli(capsys, *argv)
        r = python(HIDE_TORCH + f"import mscale.cli\nsys.exit(mscale.cli.main({['snapshot', *argv]!r}))")
        assert (r.returncode, r.stdout) == (code, out), f"{argv}: {r.stderr}"
    r = python(HIDE_TORCH + "import torch")
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr  # the hiding works


@pytest.mark.slow  # interpreter subprocesses: about 2 s
def test_the_package_and_the_format_module_do_not_import_torch():
    heavy = "sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules)"
    r = python(f"import sys, mscale.snapshot, mscale.snapshot.format, mscale.snapshot.cli; print({heavy})")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    # the public names are importable from the package, and the check above would see torch
    r = python(
        f"import sys\nfrom mscale.snapshot import SnapshotEngine, SnapshotPlugin, list_snapshots; print({heavy})"
    )
    assert r.returncode == 0 and "'torch'" in r.stdout, r.stderr


def _torch_plain(obj):
    """What `inspect` showed when it read the train state with torch.load."""
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else f"tensor{tuple(obj.shape)}"
    if isinstance(obj, dict):
        return {str(k): _torch_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_torch_plain(v) for v in obj]
    return obj


def test_the_train_state_reads_the_same_without_torch(snaps, tmp_path):
    objects = {
        "format": fmt.FORMAT,
        "step": 3,
        "f32": torch.tensor(1.5),
        "f64": torch.tensor([0.1], dtype=torch.float64),
        "bf16": torch.tensor([2.5], dtype=torch.bfloat16),
        "f16": torch.tensor(0.1, dtype=torch.float16),
        "i64": torch.tensor([-7]),
        "u8": torch.tensor([200], dtype=torch.uint8),
        "bool": torch.tensor(True),
        "c64": torch.tensor(1 + 2j, dtype=torch.complex64),
        "matrix": torch.arange(6.0).reshape(2, 3),
        "view": torch.arange(10)[7:8],
        "size": torch.Size([2, 3]),
        "dtype": torch.float32,
        "device": torch.device("cpu"),
        "od": OrderedDict(a=1),
        "counter": Counter({3: 1}),
        "bytes": b"\x00\xff",
        "set": {1, 2},
        "nested": (1, ["x", None, 2.5]),
    }
    path = tmp_path / "train_state.pt"
    torch.save(objects, path)
    for p in (path, snaps / "step_00000020" / fmt.TRAIN_STATE):
        want = _torch_plain(torch.load(p, weights_only=True))
        got = fmt.plain(fmt.read_train_state(p))
        assert json.dumps(got, default=str, sort_keys=True) == json.dumps(want, default=str, sort_keys=True)
    assert fmt.read_train_state(path)["view"] == fmt.TensorInfo("int64", (1,), 7)  # its storage's offset honoured


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch evil-code-ran",))


def test_a_train_state_with_code_is_refused_without_running_it(snaps, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    snap = tmp_path / "snaps" / "step_00000020"
    shutil.copytree(snaps / "step_00000020", snap)
    with zipfile.ZipFile(snap / fmt.TRAIN_STATE, "w") as z:  # the torch.save container, with the evil pickle
        z.writestr("train_state/data.pkl", pickle.dumps({"format": fmt.FORMAT, "step": 20, "x": _Evil()}, protocol=2))
    manifest = json.loads((snap / fmt.MANIFEST).read_text())
    data = (snap / fmt.TRAIN_STATE).read_bytes()
    manifest["files"][fmt.TRAIN_STATE] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (snap / fmt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(fmt.SnapshotInvalid, match="posix.system is not allowed") as e:
        fmt.read_train_state(snap / fmt.TRAIN_STATE)
    assert e.value.file == fmt.TRAIN_STATE
    code, out, err = cli(capsys, "inspect", str(snap))
    assert code == 1 and out == "" and f"{fmt.TRAIN_STATE}: not a readable train state" in err
    assert not (tmp_path / "evil-code-ran").exists()


def test_tensor_files_are_plain_safetensors(snaps):
    """8 bytes of little-endian header length, a JSON header padded to 8, then the data: every
    tensor aligned to its element size, the last one ending the file."""
    sizes = {"F64": 8, "F32": 4, "I64": 8, "F16": 2, "BF16": 2, "U8": 1, "BOOL": 1}
    snap = snaps / "step_00000020"
    names = [n for n in fmt.read_manifest(snap)["files"] if n.endswith(".safetensors")]
    assert len(names) == 8
    for name in names:
        raw = (snap / name).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        assert n % 8 == 0 and header.pop("__metadata__") == {"format": fmt.FORMAT, "step": "20"}
        end = 0
        for key, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
            start, stop = t["data_offsets"]
            assert start == end and start % sizes[t["dtype"]] == 0, key
            count = 1
            for d in t["shape"]:
                count *= d
            assert stop - start == count * sizes[t["dtype"]], key
            end = stop
        assert 8 + n + end == len(raw)
