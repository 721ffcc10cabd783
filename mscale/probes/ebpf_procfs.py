"""What the eBPF probe reads of the traced processes from procfs, behind an injectable root
(`probes.ebpf.proc_root`, as `probes.host.proc_root`): a process's start time (a reused pid
is another process), the CUDA libraries it maps, the command lines a pattern selects, and
whether a thread still lives. Plain file reads, no BPF: tested against a fixture tree.
"""

from __future__ import annotations

import os
import re

__all__ = ["LIBCUDA", "LIBCUDART", "Procfs"]

LIBCUDA = re.compile(r"/libcuda\.so(\.\d+)*$")
LIBCUDART = re.compile(r"/libcudart\.so(\.\d+)*$")


class Procfs:
    """procfs under `root` ("/proc" on a node)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def start_time(self, pid: int) -> int | None:
        """starttime of a live process, None if gone or a zombie."""
        try:
            with open(f"{self.root}/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            return None
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):
            return None
        return int(fields[19])

    def libcuda(self, pid: int) -> str | None:
        """The libcuda a process has mapped, as a path that reaches the same file from here."""
        return self.library(pid, LIBCUDA)

    def libcudart(self, pid: int) -> str | None:
        """The CUDA runtime a process has mapped (none when it links it statically)."""
        return self.library(pid, LIBCUDART)

    def library(self, pid: int, name: re.Pattern) -> str | None:
        """The first mapped file of `pid` whose path matches `name`: its path when that reaches
        the same file from here, else the path through the process's root (a container)."""
        try:
            with open(f"{self.root}/{pid}/maps") as f:
                maps = f.read()
        except OSError:
            return None
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6 or not name.search(parts[5]):
                continue
            path, inode = parts[5], int(parts[4])
            try:
                if os.stat(path).st_ino == inode:
                    return path
            except OSError:
                pass
            return f"{self.root}/{pid}/root{path}"  # another mount namespace (a container)
        return None

    def matching(self, pattern: re.Pattern, *, skip: set[int]) -> list[int]:
        """The pids, outside `skip`, whose command line (NULs as spaces) matches `pattern`."""
        out = []
        for entry in os.listdir(self.root):
            if not entry.isdigit() or int(entry) in skip:
                continue
            try:
                with open(f"{self.root}/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmdline and pattern.search(cmdline.strip()):
                out.append(int(entry))
        return out

    def thread_alive(self, pid: int, tid: int) -> bool:
        return os.path.exists(f"{self.root}/{pid}/task/{tid}")


def find_libcuda(pid: int) -> str | None:
    """The libcuda process `pid` of this host maps (see Procfs.libcuda)."""
    return Procfs().libcuda(pid)


def find_libcudart(pid: int) -> str | None:
    """The libcudart process `pid` of this host maps (see Procfs.libcudart)."""
    return Procfs().libcudart(pid)
