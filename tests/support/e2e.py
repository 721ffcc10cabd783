"""Processes of the end-to-end tests: the job script an agent-connected training process runs,
a subprocess wrapper that keeps its log, JSON over HTTP, and polling with a deadline."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support import stop_process

JOB = "e2e-job"


JOB_SCRIPT = """
import sys, time
from mscale.demo.scenario import Run, RunConfig
run = Run(RunConfig(steps=10**9, job_id=sys.argv[2], socket_path=sys.argv[1], snapshot_dir="snapshots", disk_every=20))
while True:
    run.one_step()
    time.sleep(0.05)  # pacing, not synchronisation
"""


def http(url: str, *, data: Any = None, headers: dict | None = None, timeout: float = 5) -> Any:
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def poll(what: str, fn: Callable[[], Any], timeout_s: float = 60, logs: Callable[[], str] = lambda: "") -> Any:
    """fn() until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}\n{logs()}")


class Proc:
    """A service we start on 127.0.0.1 with its own dir, stopped by PID."""

    def __init__(self, name: str, argv: list[str], workdir: Path) -> None:
        self.name, self.argv, self.dir = name, argv, workdir
        self.logfile = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        self.log = open(self.logfile, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir)
        return self

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc)
        self.log.close()

    def logs(self) -> str:
        return f"--- {self.name} log (tail) ---\n" + self.logfile.read_text()[-3000:]
