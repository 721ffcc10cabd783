"""Shared test helpers: system tools (skip locally, fail in CI), services the tests start,
job processes. Test modules import from here (`from support import ...`), never from
conftest or from each other."""

from __future__ import annotations

import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
