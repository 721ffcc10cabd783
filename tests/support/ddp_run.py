"""Runs tests/support/ddp_job.py (a job of several gloo ranks under DDP) and reads what each rank wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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


def run_agents(argvs: list[list[str]], logs: list[Path], *, env: dict, timeout_s: float = 400) -> list[int]:
    """Several launchers of one job at once (torchrun agents: a node each), each a process group
    with its log; their exit codes. Every group is killed on a timeout, which fails with the logs' tails."""
    files = [open(log, "w") for log in logs]  # noqa: SIM115 (closed below)
    procs = [
        subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        for argv, f in zip(argvs, files, strict=True)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the ranks too
                p.wait(timeout=10)
        raise AssertionError("the agents timed out:\n" + "\n".join(log.read_text()[-2000:] for log in logs)) from None
    finally:
        for f in files:
            f.close()


def torchrun_argv(*, nnodes: int, nproc: int, endpoint: str, restarts: int, node_rank: int | None = None) -> list[str]:
    """torchrun (`python -m torch.distributed.run`) of `nnodes` agents of `nproc` ranks each,
    restarting the group up to `restarts` times, its rendezvous c10d at `endpoint` (127.0.0.1:
    a free port the test chose); the script and its flags follow. Run it with
    `torchrun_env`: every restart then gets a TCPStore of its own. On this torch (2.13) a store
    shared with the agent (the static rendezvous of --master-port, or c10d's shared one) keeps
    the previous attempt's keys, so a restarted rank's gloo group can read a dead peer's
    address and fail with "connectFullMesh ... Connection refused" (pytorch#135712)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    argv += ["--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    argv += ["--rdzv-id", "world-job", "--monitor-interval", "0.5"]
    return argv + (["--node-rank", str(node_rank)] if node_rank is not None else [])


def torchrun_env(**extra: str) -> dict[str, str]:
    """The environment for `torchrun_argv`: the repository and tests/ importable, and the
    rendezvous store not shared with the restarted workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return {**env, **extra}


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
