"""The snapshot job's fork server, driven from the tests."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from support import REPO

JOB = str(Path(__file__).resolve().parent / "snapshot_job.py")


class Zygote:
    """The job's fork server (snapshot_job.py --zygote): real child processes, started
    without importing torch again each time. Lines the children print are queued by pid."""

    def __init__(self, log: Path) -> None:
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, JOB, "--zygote"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.pending: list[str] = []
        self.children: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("CLOSED")

    def expect(self, prefix: str, pid: int | None = None, timeout: float = 240) -> list[str]:
        """The next line starting with prefix (and, if given, ending with pid's fields)."""

        def match(line: str) -> bool:
            parts = line.split()
            return line.startswith(prefix) and (pid is None or str(pid) in parts[1:])

        for i, line in enumerate(self.pending):
            if match(line):
                return self.pending.pop(i).split()
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line != "CLOSED", "the zygote died; see its log"
            if match(line):
                return line.split()
            self.pending.append(line)

    def run(self, *args: str) -> int:
        self.proc.stdin.write("run " + " ".join(shlex.quote(a) for a in args) + "\n")
        pid = int(self.expect("PID")[1])
        self.children.add(pid)
        return pid

    def wait(self, pid: int) -> int:
        self.proc.stdin.write(f"wait {pid}\n")
        code = int(self.expect("EXIT", pid)[2])
        self.children.discard(pid)
        return code

    def close(self) -> None:
        # A failed or timed-out test must not leave job processes spinning behind it.
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()
