"""Snapshots held in host memory, and the copies that fill them.

A memory snapshot is the training state at one step in host buffers: tensors per snapshot file,
everything else as weights_only-serialisable objects, and the MPU-to-device binding. The
copier moves live tensors into those buffers: on a side CUDA stream per device when they are
on a GPU (completion marked by CUDA events), spread over a few threads on the CPU.
"""

from __future__ import annotations

import copy
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["MemorySnapshot", "HostCopier", "to_host", "rng_state", "set_rng_state"]


@dataclass(eq=False)
class MemorySnapshot:
    """One snapshot held in host memory. Buffers are reused by later snapshots once this one
    is neither kept nor being written."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # file name -> key -> host tensor
    objects: dict  # everything else, weights_only-serialisable
    binding: dict
    nbytes: int
    created: float = field(default_factory=time.time)
    ready: list = field(default_factory=list)  # CUDA events the copies complete at
    pins: int = 0  # disk writes in progress or queued
    retired: bool = False  # no longer kept; buffers free once unpinned
    disk_path: Path | None = None

    def wait_ready(self) -> None:
        for ev in self.ready:
            ev.synchronize()

    def is_ready(self) -> bool:
        """Whether its device-to-host copies have completed (never blocks)."""
        return all(ev.query() for ev in self.ready)


def to_host(obj: Any) -> Any:
    """A deep copy of obj with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if type(obj) is dict:
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, dict):  # OrderedDict, Counter (MultiStepLR milestones): keep the type
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = to_host(v)
        return out
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_host(v) for v in obj)
    return copy.deepcopy(obj)


def rng_state() -> dict:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    try:
        import numpy as np
    except ImportError:  # numpy is optional for the hook library
        return state
    legacy = np.random.get_state(legacy=True)  # the default; numpy's stubs type the call without it as a dict
    assert isinstance(legacy, tuple)  # the global RandomState is MT19937: its legacy state is the 5-tuple
    name, keys, pos, has_gauss, gauss = legacy
    state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _as_tuple(obj: Any) -> Any:
    return tuple(_as_tuple(v) for v in obj) if isinstance(obj, (list, tuple)) else obj


class HostCopier:
    """Copies live tensors into host buffers. threads: for CPU copies (copy_ releases the GIL)."""

    def __init__(self, threads: int) -> None:
        self.copy_threads = threads
        self._streams: dict[torch.device, Any] = {}
        self._copy_pool: ThreadPoolExecutor | None = None

    def copy_state(self, files: dict[str, dict[str, torch.Tensor]], bufs: dict[str, dict[str, torch.Tensor]]) -> list:
        """Copies live tensors into host buffers; on GPU, enqueued on a side stream per device
        (the default stream waits for it before touching the sources again). Returns the
        CUDA events marking completion (none on CPU)."""
        started: set = set()
        host: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for fname, d in files.items():
                for key, src in d.items():
                    dst = bufs[fname][key]
                    if src.is_cuda:
                        stream = self._streams.get(src.device)
                        if stream is None:
                            stream = self._streams[src.device] = torch.cuda.Stream(src.device)
                        if src.device not in started:
                            stream.wait_stream(torch.cuda.current_stream(src.device))
                            started.add(src.device)
                        with torch.cuda.stream(stream):
                            dst.copy_(src, non_blocking=True)
                    else:
                        host.append((dst, src))
        self.parallel_copy(host)
        events = []
        for dev in started:
            ev = torch.cuda.Event()
            ev.record(self._streams[dev])
            torch.cuda.current_stream(dev).wait_event(ev)
            events.append(ev)
        return events

    def parallel_copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for every pair, spread over a few threads by bytes (copy_ releases
        the GIL). Measured here: steadier than torch's intra-op threads, which degrade badly
        when other processes hold the cores."""
        n = min(self.copy_threads, len(pairs))
        if n <= 1:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
            return
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(
                max_workers=self.copy_threads, thread_name_prefix="mscale-snapshot-copy"
            )
        buckets: list[list] = [[] for _ in range(n)]
        loads = [0] * n
        for dst, src in sorted(pairs, key=lambda p: -p[0].numel() * p[0].element_size()):
            i = loads.index(min(loads))
            buckets[i].append((dst, src))
            loads[i] += dst.numel() * dst.element_size()

        def run(bucket: list) -> None:
            with torch.no_grad():
                for dst, src in bucket:
                    dst.copy_(src)

        list(self._copy_pool.map(run, buckets))

    def close(self) -> None:
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=False)
