"""Runs tests/support/ddp_job.py (a job of several gloo ranks under DDP) and reads what each rank wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from support import REPO, free_port


def run_group(argv: list[str], log: Path, *, timeout_s: float = 300, env: dict | None = None) -> int:
    """Run `argv` from the repository as a process group (a job and its ranks), its output to
    `log`; its exit code. The whole group is killed on a timeout, which fails with the log's tail."""
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks too
            proc.wait(timeout=10)
            raise AssertionError("the job timed out:\n" + log.read_text()[-3000:]) from None


def run_job(
    tmp_path: Path, *, world: int = 2, timeout_s: float = 240, fails: bool = False, **opts: object
) -> list[dict]:
    """Run the job (options as ddp_job.py's flags, `snapshots=True` for a bare flag); every rank's
    JSON. The job and its rank processes are one process group, killed on a timeout. fails: the
    job must exit non-zero; its log is returned in a one-element list instead."""
    out = tmp_path / "out"
    out.mkdir()
    argv = [
        sys.executable,
        "tests/support/ddp_job.py",
        "--world",
        str(world),
        "--port",
        str(free_port()),
        "--out",
        str(out),
    ]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    log = tmp_path / "job.log"
    code = run_group(argv, log, timeout_s=timeout_s)
    if fails:
        assert code != 0, "the job should have failed"
        return [{"log": log.read_text()}]
    assert code == 0, log.read_text()[-3000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


def skipped_steps(rank: dict) -> list[int]:
    """The steps whose update the rank dropped."""
    return [e["step"] for e in rank["ends"] if e["skip"]]
