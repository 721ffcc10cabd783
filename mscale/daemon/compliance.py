"""Does a job's process run where its contract's plan says? Read from /proc, nothing else.

For the job's PID and the processes below it (its data-loader workers), each task's name and
`Cpus_allowed_list` come from /proc/PID/task/TID/status. A plan thread is found by its tag
(the task name mscale.contracts.pin gives it): a process whose main task carries the tag (a
worker) is checked task by task, a thread carrying it inside another process on its own; the
entry "main" is the job's main thread (TID == PID). A thread is `compliant` when every task
found runs on exactly the plan's CPUs, `violated` when one does not, `absent` when none is
found (a loader not started yet, or a job that never pinned it).

Reads are bounded (MAX_PROCS processes, MAX_TASKS tasks per process) and never raise on a
process that exits while read: it is simply not there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mscale.contracts.hardware import format_cpulist, parse_cpulist

MAX_PROCS = 1 << 16
MAX_TASKS = 4096
MAIN = "main"


@dataclass(frozen=True)
class Task:
    pid: int
    tid: int
    name: str
    cpus: frozenset[int]


@dataclass(frozen=True)
class ThreadCompliance:
    name: str
    state: str  # compliant, violated, absent
    expected: str  # the plan's CPUs, kernel spelling
    tasks: int
    violations: tuple[tuple[int, str], ...] = ()  # (tid, CPUs it may run on)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "expected": self.expected,
            "tasks": self.tasks,
            "violations": [{"tid": t, "cpus": c} for t, c in self.violations],
        }


def _status(path: Path) -> tuple[str, frozenset[int]] | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:  # gone meanwhile, or not ours to read
        return None
    name, cpus = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Name":
            name = value.strip()
        elif key == "Cpus_allowed_list":
            try:
                cpus = parse_cpulist(value)
            except ValueError:
                return None
    return (name, cpus) if cpus is not None else None


def tasks_of(pid: int, proc_root: Path) -> list[Task]:
    out = []
    try:
        tids = sorted(os.listdir(proc_root / str(pid) / "task"))[:MAX_TASKS]
    except OSError:
        return []
    for t in tids:
        if t.isdigit():
            st = _status(proc_root / str(pid) / "task" / t / "status")
            if st is not None:
                out.append(Task(pid, int(t), st[0], st[1]))
    return out


def descendants(pid: int, proc_root: Path) -> list[int]:
    """The processes below `pid` (children, theirs...), from each process's parent in /proc/N/stat."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return []
    for name in entries[:MAX_PROCS]:
        if not name.isdigit():
            continue
        try:
            stat = (proc_root / name / "stat").read_text(errors="replace")
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # after the command, which may hold spaces
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = list(children.get(pid, ()))
    while todo and len(out) < MAX_PROCS:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return sorted(out)


def check(plan: dict[str, Any], pid: int, proc_root: str | os.PathLike[str] = "/proc") -> list[ThreadCompliance]:
    """Each plan thread's compliance in the process `pid` and below it."""
    root = Path(proc_root)
    procs = {pid: tasks_of(pid, root)}
    threads = plan.get("threads", [])
    if any(t.get("tag") for t in threads):
        for child in descendants(pid, root):
            procs[child] = tasks_of(child, root)
    out: list[ThreadCompliance] = []
    for t in threads:
        expected = frozenset(t["cpus"])
        if t["name"] == MAIN:
            found = [x for x in procs[pid] if x.tid == pid]
        else:
            found = []
            for p, tasks in procs.items():
                leader = next((x for x in tasks if x.tid == p), None)
                if leader is not None and leader.name == t["tag"] and p != pid:
                    found += tasks  # a worker process: all of it
                else:
                    found += [x for x in tasks if x.name == t["tag"]]
        bad = tuple((x.tid, format_cpulist(x.cpus)) for x in found if x.cpus != expected)
        state = "absent" if not found else "violated" if bad else "compliant"
        out.append(ThreadCompliance(t["name"], state, format_cpulist(expected), len(found), bad[:32]))
    return out
