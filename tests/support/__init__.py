"""Shared test helpers: system tools (skip locally, fail in CI), services the tests start,
job processes. Test modules import from here (`from support import ...`), never from
conftest or from each other."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str, *, why: str = "") -> str:
    """Path of a system tool; skips locally when absent, fails in CI."""
    path = shutil.which(name)
    if path is None:
        msg = f"system tool {name!r} not found{': ' + why if why else ''} (make test installs it via scripts/setup-system.sh)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def require(condition: bool, reason: str) -> None:
    """Skip locally / fail in CI when a machine capability the test needs is absent."""
    if not condition:
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10) -> None:
    """SIGTERM a service the test started, SIGKILL it if it does not exit in time."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _port_pool() -> range:
    """This test process's ports: below the kernel's ephemeral range, which it hands to outgoing
    connections and bind(0) (a job's rendezvous port, taken from that range, was once taken
    again before its rank 0 bound it), and a slice of their own for each xdist worker."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    except (OSError, ValueError, IndexError):
        return range(0)
    low = 10000
    if not 0 <= worker < workers or ephemeral_low - low < 100 * workers:
        return range(0)  # no room below the ephemeral range: let the kernel choose
    width = (ephemeral_low - low) // workers
    return range(low + worker * width, low + (worker + 1) * width)


_POOL = _port_pool()
_next_port = random.randrange(len(_POOL)) if _POOL else 0  # a fresh start each run: no TIME_WAIT


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now, each handed out once per test process (the
    kernel's choice where the pool is empty: an unknown range or worker)."""
    global _next_port
    for _ in range(len(_POOL)):
        port = _POOL[_next_port % len(_POOL)]
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
