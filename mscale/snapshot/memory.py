"""Snapshots held in host memory, and the copies that fill them.

A memory snapshot is the training state at one step in host buffers: tensors per snapshot file,
everything else as weights_only-serialisable objects, and the MPU-to-device binding. The
copier moves live tensors into those buffers: on a side CUDA stream per device when they are
on a GPU (completion marked by CUDA events), spread over a few threads on the CPU.

Off the critical path: the parameters and the optimizer state are not written until the next
optimizer step, so their copy ("late" tensors) runs beside the next forward and backward: in
the copier's background thread on the CPU (torch's copy releases the GIL), on the side stream
on a GPU. `HostCopier.fence()` (the engine runs it as an optimizer step pre-hook, and before
anything it restores) waits only for what is not finished yet; on a GPU it makes the compute
stream wait for the copy, without blocking the host. Everything else (buffers, which the
forward may update in place) is copied before `snapshot()` returns. A snapshot's `ready`
(`Completion`) says, without blocking, whether all its copies have landed.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mscale.snapshot.keys import wrapper_prefix
from mscale.snapshot.values import StateDict, as_float, as_int, as_list

__all__ = ["MemorySnapshot", "HostCopier", "Completion", "Verdict", "to_host", "rng_state", "set_rng_state"]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class Completion:
    """Whether a snapshot's copies have landed: the host copies running in the copier's
    thread (a flag it sets when done) and the device copies on side streams (CUDA events).
    `done()` never blocks (the emergency write asks it about a GPU that may be lost)."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []  # CUDA events recorded after the last copy, one per device
        self.devices: list[torch.device] = []  # the device of each event
        self._host = threading.Event()
        self._host.set()  # nothing in flight until the copier says so
        self.error: BaseException | None = None

    def start_host(self) -> None:
        self._host.clear()

    def finish_host(self, error: BaseException | None = None) -> None:
        self.error = error
        self._host.set()

    def done(self) -> bool:
        """All copies landed without error (never blocks)."""
        return self._host.is_set() and self.error is None and all(ev.query() for ev in self.events)

    def host_done(self) -> bool:
        return self._host.is_set()

    def wait_host(self, timeout: float | None = None) -> bool:
        return self._host.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every copy has landed; raises the host copy's error, or TimeoutError."""
        if not self._host.wait(timeout):
            raise TimeoutError(f"snapshot copy not finished within {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"snapshot copy failed: {self.error}") from self.error
        for ev in self.events:
            ev.synchronize()


class Verdict:
    """A snapshot's verification (verify.py): pending until the copier's thread has run it,
    then set once. `passed()` never blocks; `wait` does, at most `timeout` seconds."""

    def __init__(self) -> None:
        self.bad: frozenset[str] = frozenset()  # the parameters it found implausible (weight or state)
        self.maxima: dict[str, float] = {}  # the weights' largest magnitudes (the next one's baseline)
        self.error = ""  # why it could not run (the snapshot is then not trusted either)
        self.cpu_s = 0.0  # CPU seconds it took on the copier's thread
        self.abandoned = False  # of a timeline a rollback left (its result goes unreported)
        self._done = threading.Event()

    def finish(self) -> None:
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def passed(self) -> bool:
        """Completed, and found nothing (never blocks)."""
        return self._done.is_set() and not self.error and not self.bad


@dataclass(eq=False)
class MemorySnapshot:
    """One snapshot held in host memory. Buffers are reused by later snapshots once this one
    is neither kept nor being written."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # file name -> key -> host tensor
    objects: StateDict  # everything else, weights_only-serialisable
    binding: StateDict
    nbytes: int
    created: float = field(default_factory=time.time)
    ready: Completion = field(default_factory=Completion)  # when the copies have landed
    pins: int = 0  # disk writes in progress or queued
    retired: bool = False  # no longer kept; buffers free once unpinned
    disk_path: Path | None = None
    verdict: Verdict = field(default_factory=Verdict)  # restored only once it passed (verify.py)

    def wait_ready(self, timeout: float | None = None) -> None:
        self.ready.wait(timeout)

    def is_ready(self) -> bool:
        """Whether its copies have completed (never blocks, never touches a lost device)."""
        return self.ready.done()

    def copy_back(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        wanted: Callable[[str, str], bool],
    ) -> int:
        """Copy part of this snapshot back into the live model in place: every model tensor
        (parameter or buffer) and, with `optimizer`, every optimizer-state tensor of a parameter
        for which `wanted(file name, tensor name)` holds. Returns how many model tensors were
        copied. The one partial restore (an L1 swap's corrupted weights, a weight repair).
        Names are `model`'s own: a DDP-wrapped model's `module.` before the snapshot's (keys.py)."""
        live = model.state_dict(keep_vars=True)
        params = dict(model.named_parameters())
        pre = wrapper_prefix(model)
        n = 0
        with torch.no_grad():
            for fname, tensors in self.tensors.items():
                for key, saved in tensors.items():
                    kind, _, rest = key.partition("/")
                    rest = pre + rest
                    if kind == "model" and rest in live and wanted(fname, rest):
                        live[rest].copy_(saved)
                        n += 1
                    elif kind == "optim" and optimizer is not None:
                        fqn, _, k = rest.rpartition("/")
                        p = params.get(fqn)
                        state = optimizer.state.get(p, {}) if p is not None else {}
                        if wanted(fname, fqn) and isinstance(state.get(k), torch.Tensor):
                            state[k].copy_(saved)
        return n


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


def rng_state() -> StateDict:
    state: StateDict = {"python": random.getstate(), "torch": torch.get_rng_state()}
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


def set_rng_state(state: StateDict) -> None:
    python = _as_tuple(state["python"])
    if not isinstance(python, tuple):
        raise TypeError(f"the Python RNG state must be a tuple, not {type(python).__name__}")
    random.setstate(python)
    torch.set_rng_state(_tensor(state["torch"], "the torch RNG state"))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(as_list(state["cuda"], "the CUDA RNG states")[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_tensor(s, f"the RNG state of cuda:{i}"), i)
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = as_list(state["numpy"], "the numpy RNG state")
        legacy = (str(name), _tensor(keys, "numpy's RNG keys").numpy().astype("uint32"), as_int(pos, "pos"))
        np.random.set_state((*legacy, as_int(has_gauss, "has_gauss"), as_float(gauss, "gauss")))


def _tensor(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, not {type(value).__name__}")
    return value


def _as_tuple(obj: object) -> object:
    return tuple(_as_tuple(v) for v in obj) if isinstance(obj, (list, tuple)) else obj


def host_buffers(
    files: dict[str, dict[str, torch.Tensor]], old: dict[str, dict[str, torch.Tensor]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Host buffers shaped like `files`, those of `old` reused where they fit (pinned when the
    state is on a GPU)."""
    pin = any(t.is_cuda for d in files.values() for t in d.values())
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fname, d in files.items():
        prev = old.get(fname, {})
        out[fname] = {}
        for key, t in d.items():
            b = prev.get(key)
            if b is None or b.shape != t.shape or b.dtype != t.dtype:
                b = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            out[fname][key] = b
    return out


def late_keys(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Callable[[str], bool]:
    """Which snapshot keys may be copied beside the next forward and backward: the optimizer's
    parameters and state, which only its step writes. Without an optimizer whose step can be
    hooked (none, or a wrapper such as the FSDP path's LocalOptimizer): none."""
    if optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
        return lambda key: False
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = {"model/" + n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in held}
    return lambda key: key.startswith("optim/") or key in params


def fence_on_step(optimizer: Any, copier: HostCopier) -> Any:
    """Registers copier.fence() as the optimizer's step pre-hook; the handle, or None where the
    optimizer's step cannot be hooked (late_keys then defers nothing)."""
    if optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
        return None
    return optimizer.register_step_pre_hook(copier.fence_hook)


class HostCopier:
    """Copies live tensors into host buffers. threads: for CPU copies (copy_ releases the GIL).
    `waits` and `waited_seconds` count the times a fence found a copy unfinished, and how long
    the training thread waited for it."""

    def __init__(self, threads: int) -> None:
        self.copy_threads = threads
        self._streams: dict[torch.device, Any] = {}
        self._copy_pool: ThreadPoolExecutor | None = None
        # One thread runs the late host copies in order: at most one snapshot's copy in flight.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mscale-snapshot-late")
        self._pending: Completion | None = None
        self.waiting = False  # a fence is blocked on the host copy right now
        self.waits = 0
        self.waited_seconds = 0.0
        self.last_wait = 0.0

    def copy_state(
        self,
        files: dict[str, dict[str, torch.Tensor]],
        bufs: dict[str, dict[str, torch.Tensor]],
        late: Callable[[str], bool] = lambda key: False,
    ) -> Completion:
        """Copies live tensors into host buffers: those `late` accepts beside the training that
        follows (until the next fence), the others before returning. On GPU everything is
        enqueued on a side stream per device; the compute stream waits at once for the early
        copies, and for the late ones at the next fence."""
        self.fence()  # the previous snapshot's copy first: its sources may be written next
        done = Completion()
        started: set[torch.device] = set()
        now: Pairs = []
        later: Pairs = []
        device: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        for fname, d in files.items():
            for key, src in d.items():
                pair = (bufs[fname][key], src)
                if src.is_cuda:
                    device.append((*pair, late(key)))
                else:
                    (later if late(key) else now).append(pair)
        with torch.no_grad():
            for is_late in (False, True):  # early copies first: the compute stream waits for them
                for dst, src, lt in device:
                    if lt != is_late:
                        continue
                    stream = self._streams.get(src.device)
                    if stream is None:
                        stream = self._streams[src.device] = torch.cuda.Stream(src.device)
                    if src.device not in started:
                        stream.wait_stream(torch.cuda.current_stream(src.device))
                        started.add(src.device)
                    with torch.cuda.stream(stream):
                        dst.copy_(src, non_blocking=True)
                if not is_late:
                    for dev in started:  # buffers the forward may update: wait for their copy now
                        ev = torch.cuda.Event()
                        ev.record(self._streams[dev])
                        torch.cuda.current_stream(dev).wait_event(ev)
        for dev in started:
            ev = torch.cuda.Event()
            ev.record(self._streams[dev])
            done.events.append(ev)
            done.devices.append(dev)
        self.parallel_copy(now)
        if later:
            done.start_host()
            self._background.submit(self._copy_late, later, done)
        self._pending = done
        return done

    def after_copy(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the copier's thread once every copy queued so far has run there."""
        self._background.submit(fn)

    def _copy_late(self, pairs: Pairs, done: Completion) -> None:
        # One thread: the training thread has the other cores for its forward and backward.
        try:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
        except BaseException as e:
            done.finish_host(e)
        else:
            done.finish_host()

    def fence(self, timeout: float | None = None) -> float:
        """Before the live parameters or optimizer state are written: waits for the part of the
        snapshot copy in flight that has not finished (host copies), and orders the GPU's
        compute streams after its device copies (without blocking). Returns seconds waited."""
        done, self.last_wait = self._pending, 0.0
        if done is None:
            return 0.0
        waited = 0.0
        if not done.host_done():
            t0 = time.perf_counter()
            self.waiting = True
            try:  # a failed copy leaves its snapshot never ready; training goes on
                if not done.wait_host(timeout):
                    raise TimeoutError(f"snapshot copy not finished within {timeout} s")
            finally:
                self.waiting = False
            waited = time.perf_counter() - t0
            self.waits += 1
            self.waited_seconds += waited
        for dev, ev in zip(done.devices, done.events, strict=True):  # the GPU waits, not the host
            torch.cuda.current_stream(dev).wait_event(ev)
        self._pending = None
        self.last_wait = waited
        return waited

    def fence_hook(self, *_: object) -> None:
        """fence() as an optimizer step pre-hook."""
        self.fence()

    def pool(self) -> ThreadPoolExecutor:
        """The copy threads, started once (a restore reads its files with them too)."""
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(
                max_workers=self.copy_threads, thread_name_prefix="mscale-snapshot-copy"
            )
        return self._copy_pool

    def parallel_copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for every pair, spread over a few threads by bytes (copy_ releases
        the GIL). Measured here: steadier than torch's intra-op threads, which degrade badly
        when other processes hold the cores. A pair whose source is its destination (read from
        disk in place: inplace.py) is skipped."""
        pairs = [(d, s) for d, s in pairs if not (d.data_ptr() == s.data_ptr() and d.stride() == s.stride())]
        n = min(self.copy_threads, len(pairs))
        if n <= 1:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
            return
        pool = self.pool()
        buckets: list[Pairs] = [[] for _ in range(n)]
        loads = [0] * n
        for dst, src in sorted(pairs, key=lambda p: -p[0].numel() * p[0].element_size()):
            i = loads.index(min(loads))
            buckets[i].append((dst, src))
            loads[i] += dst.numel() * dst.element_size()

        def run(bucket: Pairs) -> None:
            with torch.no_grad():
                for dst, src in bucket:
                    dst.copy_(src)

        list(pool.map(run, buckets))

    def close(self) -> None:
        self.fence()
        self._background.shutdown(wait=True)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=False)
