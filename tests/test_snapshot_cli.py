"""`mscale snapshot list|verify|inspect DIR`."""
from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys

import pytest
import torch

from support import REPO
from mscale.cli import main
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
    assert [e["step"] for e in entries if e["complete"]] == [10, 20] and all(e["bytes"] > 100_000 for e in entries if e["complete"])


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
    assert "FAILED  step 20" in out and "mpu_002_aligner_state.safetensors: SHA-256 differs" in out
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
    proc = subprocess.Popen([sys.executable, "-m", "mscale", "snapshot", "verify", str(snaps)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=slave, text=True)
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
