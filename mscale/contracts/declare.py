"""`mscale.contract(...)`: declaring a contract on a train function, or applying it as a call.

    @mscale.contract(compute_profile="mlvm-heavy",
                     io_topology={"image_loader": {"cpu_cores": [2, 3], "numa_node": 1}},
                     fault_tolerance={"recovery_point": "step_128", "stateful_io": True})
    def train(model, image_loader): ...      # validated at the call, before the first step;
                                              # an argument named like an entry is pinned
    applied = mscale.contract(...).apply(loaders={"image_loader": loader})   # the same, as a call
    ...
    applied.release()                         # (or `with mscale.contract(...) as applied:`)

While applied, the plan is the process's active plan: `mscale.attach(...)` adds the contract
plugin (mscale.hook.core.contract), which sends the plan to the agent. A contract the host cannot
honour raises ContractRefused before anything is pinned.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from mscale.contracts import pin
from mscale.contracts.hardware import HostView, nvml_pci, read_host
from mscale.contracts.plan import Plan
from mscale.contracts.settings import section_from_file
from mscale.contracts.spec import MAIN, Contract, parse
from mscale.contracts.validate import validate

_active: list[Applied] = []
_lock = threading.Lock()


def active() -> Applied | None:
    """The contract applied last in this process and not released, if any."""
    with _lock:
        return _active[-1] if _active else None


class Applied:
    """A validated contract in force: its plan, and what was pinned."""

    def __init__(self, plan: Plan, host: HostView, msrp: Mapping[str, float] | None = None) -> None:
        self.plan, self.host = plan, host
        self.msrp = dict(msrp) if msrp is not None else None  # MsrpPlugin's settings; None: off
        self.loaders: dict[str, Any] = {}
        self._main: pin.MainPin | None = None
        main = plan.thread(MAIN)
        if main is not None:
            self._main = pin.MainPin(main)
        with _lock:
            _active.append(self)

    def pin_loader(self, name: str, loader: Any) -> None:
        """Pin `loader`'s workers to the entry `name`'s CPUs."""
        thread = self._thread(name)
        pin.pin_loader(loader, thread)
        self.loaders[name] = loader

    def pin_thread(self, name: str) -> None:
        """Pin the calling thread (an I/O thread the job starts) to the entry `name`'s CPUs."""
        pin.pin_current(self._thread(name))

    def _thread(self, name: str) -> Any:
        thread = self.plan.thread(name)
        if thread is None or thread.main:
            names = ", ".join(t.name for t in self.plan.threads if not t.main) or "none"
            raise KeyError(f"io_topology has no thread entry {name!r} with cpu_cores (entries: {names})")
        return thread

    def release(self) -> None:
        """End the contract in this process: the main thread gets its mask back."""
        with _lock:
            if self in _active:
                _active.remove(self)
        if self._main is not None:
            self._main.restore()
            self._main = None

    def __enter__(self) -> Applied:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class ContractDecl:
    """What `mscale.contract(...)` returns: a decorator, or `.apply()` as a call."""

    def __init__(
        self,
        contract: Contract,
        *,
        sys_root: str | os.PathLike,
        proc_root: str | os.PathLike,
        allow_hugepage_allocation: bool,
        use_nvml: bool,
        msrp: Mapping[str, float] | None = None,
    ) -> None:
        self.contract = contract
        self.msrp = msrp
        self.sys_root, self.proc_root = sys_root, proc_root
        self.allow_hugepage_allocation = allow_hugepage_allocation
        self.use_nvml = use_nvml

    def check(self) -> tuple[Plan, HostView]:
        """Validate against the host now; ContractRefused with every problem."""
        host = read_host(self.sys_root, self.proc_root, nvml_pci() if self.use_nvml else None)
        plan = validate(
            self.contract,
            host,
            allow_hugepage_allocation=self.allow_hugepage_allocation,
            sys_root=self.sys_root,
            proc_root=self.proc_root,
            # this process's CPU set is the real host's: checked when the real tree is read
            allowed_cpus=os.sched_getaffinity(0) if str(self.sys_root) == "/sys" else None,
        )
        return plan, host

    def apply(self, *, loaders: Mapping[str, Any] | None = None) -> Applied:
        plan, host = self.check()
        applied = Applied(plan, host, self.msrp)
        try:
            for name, loader in (loaders or {}).items():
                applied.pin_loader(name, loader)
        except BaseException:
            applied.release()
            raise
        return applied

    def __enter__(self) -> Applied:
        self._applied = self.apply()
        return self._applied

    def __exit__(self, *exc: Any) -> None:
        self._applied.release()

    def __call__(self, fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError("mscale.contract(...) decorates a function; to apply it now, call .apply()")
        sig = inspect.signature(fn)
        threads = {e.name for e in self.contract.io_topology if e.cpu_cores and e.name != MAIN}

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind_partial(*args, **kwargs)
            loaders = {
                n: v
                for n, v in bound.arguments.items()
                if n in threads and hasattr(v, "worker_init_fn") and getattr(v, "num_workers", None)
            }
            with self.apply(loaders=loaders):
                return fn(*args, **kwargs)

        wrapper.contract = self  # type: ignore[attr-defined]
        return wrapper


def contract(
    compute_profile: str,
    io_topology: Mapping[str, Mapping[str, Any]] | None = None,
    fault_tolerance: Mapping[str, Any] | None = None,
    *,
    sys_root: str | os.PathLike = "/sys",
    proc_root: str | os.PathLike = "/proc",
    allow_hugepage_allocation: bool | None = None,
    use_nvml: bool = True,
    msrp: bool = True,
    msrp_interval_s: float | None = None,
    msrp_report_s: float = 10.0,
    config: str | None = None,
) -> ContractDecl:
    """Declare a resource contract (see mscale.contracts.spec for the fields). Malformed
    arguments raise ContractRefused now; the host is checked when the decorated function is
    called, or at `.apply()`. allow_hugepage_allocation and msrp_interval_s default to the
    [contract] table of the agent's config (`config`, else /etc/mscale/agent.toml when it
    exists, else the defaults: no allocation, 900 s). msrp: measure and report the job's MSRP
    (mscale.hook.core.msrp) every msrp_interval_s, sending it to the agent every msrp_report_s."""
    if allow_hugepage_allocation is None or msrp_interval_s is None:
        section = section_from_file(config)
        if allow_hugepage_allocation is None:
            allow_hugepage_allocation = section.allow_hugepage_allocation
        if msrp_interval_s is None:
            msrp_interval_s = section.msrp_interval_s
    for name, v in (("msrp_interval_s", msrp_interval_s), ("msrp_report_s", msrp_report_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 86400:
            raise ValueError(f"{name}: expected seconds in 0..86400, got {v!r}")
    parsed = parse(
        compute_profile,
        dict(io_topology) if isinstance(io_topology, Mapping) else io_topology,
        dict(fault_tolerance) if isinstance(fault_tolerance, Mapping) else fault_tolerance,
    )
    return ContractDecl(
        parsed,
        sys_root=sys_root,
        proc_root=proc_root,
        allow_hugepage_allocation=allow_hugepage_allocation,
        use_nvml=use_nvml,
        msrp={"interval_s": float(msrp_interval_s), "report_s": float(msrp_report_s)} if msrp else None,
    )
