"""Applying a plan inside the training process: CPU affinity and task names, nothing else.

A named I/O thread is pinned from inside itself (`pin_current`): its CPU mask set with
os.sched_setaffinity(0, ...) (the calling thread only) and its task name set to the plan's tag
(prctl PR_SET_NAME), which is how the agent finds it in /proc/PID/task/*/status. Data-loader
workers are pinned by their `worker_init_fn` (`pin_loader` wraps the loader's own), so every
worker of every epoch starts pinned. The main thread is pinned only when the contract names
the entry "main"; its name is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from typing import Any

from mscale.contracts.plan import COMM_BYTES, ThreadPlan

PR_SET_NAME = 15


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def set_task_name(name: str) -> None:
    """Name the calling thread (its /proc/PID/task/TID/comm); OSError if the kernel refuses."""
    raw = name.encode()[:COMM_BYTES]
    if _libc().prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NAME, {name!r}): {os.strerror(err)}")


def pin_current(thread: ThreadPlan) -> None:
    """Pin the calling thread to the plan's CPUs and give it the plan's task name."""
    os.sched_setaffinity(0, thread.cpus)
    if thread.tag:
        set_task_name(thread.tag)


class WorkerInit:
    """A data-loader worker_init_fn: pins the worker, then runs the loader's own init function.
    A class, not a closure, so loaders that spawn their workers can pickle it."""

    def __init__(self, thread: ThreadPlan, previous: Callable[[int], Any] | None) -> None:
        self.thread, self.previous = thread, previous

    def __call__(self, worker_id: int) -> None:
        pin_current(self.thread)
        if self.previous is not None:
            self.previous(worker_id)


def pin_loader(loader: Any, thread: ThreadPlan) -> None:
    """Pin `loader`'s workers (a torch DataLoader or anything with num_workers and
    worker_init_fn) to `thread`'s CPUs from their next start. A loader with no workers loads
    in the main thread, which a contract leaves alone: refused with ValueError."""
    workers = getattr(loader, "num_workers", None)
    if not hasattr(loader, "worker_init_fn") or not isinstance(workers, int):
        raise TypeError(f"io_topology.{thread.name}: expected a data loader with num_workers and worker_init_fn")
    if workers < 1:
        raise ValueError(
            f"io_topology.{thread.name}: the loader has num_workers=0, so it loads in the main thread, "
            "which the contract leaves alone; give it workers or name the entry 'main'"
        )
    previous = loader.worker_init_fn
    if isinstance(previous, WorkerInit):  # pinned before: re-pin, keep the user's own function
        previous = previous.previous
    loader.worker_init_fn = WorkerInit(thread, previous)


class MainPin:
    """The main thread's CPU mask while a contract naming "main" is applied; `restore` puts
    the mask it had back."""

    def __init__(self, thread: ThreadPlan) -> None:
        self.before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, thread.cpus)

    def restore(self) -> None:
        os.sched_setaffinity(0, self.before)
