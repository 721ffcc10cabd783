"""The probe protocol. A probe is one module exporting `SPEC` (its factory and config section),
listed in probes/__init__.py.

`sample()` is blocking and runs in the probe's own worker thread under a deadline
(mscale.daemon.runner); it returns an immutable snapshot that collectors read at scrape
time. Probes report faults as findings through `ctx.emit`, never by raising.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mscale.findings import Finding


class ProbeUnavailable(RuntimeError):
    """The probe cannot run here (no BCC, no permission, no driver): 'not there', not a crash."""


class RegisteredJob(Protocol):
    """A job as a probe reads it: its id, and the processes of its live ranks on this node
    (the agent's mscale.daemon.jobs.JobState is one)."""

    @property
    def job_id(self) -> str: ...

    @property
    def pids(self) -> list[int]: ...


def no_jobs() -> Sequence[RegisteredJob]:
    return []


@dataclass(frozen=True)
class ProbeContext:
    """What a probe is built with: the agent's config, where its findings go, the clock, the
    jobs registered now (a call, read when the probe needs it: the probes that follow the
    training processes read nothing else of the agent), and the GPU library."""

    config: Any  # the agent's mscale.daemon.config.Config (the agent's room, so not named here)
    emit: Callable[[Finding], Any]
    clock: Callable[[], float]
    jobs: Callable[[], Sequence[RegisteredJob]] = no_jobs  # the agent: AgentState.registered_jobs
    nvml: Any = None  # an mscale.probes.nvml_api.Nvml (real or simulated) for GPU probes


class Probe(Protocol):
    name: str

    def sample(self) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ProbeSpec:
    """One probe's registration: what mscale.probes.REGISTRY points at as the module's `SPEC`.

    `section` is the probe's config table [probes.<name>], a frozen dataclass of `opt()`
    fields declared in the probe's module; it must have `interval_s` and `timeout_s` (the
    runner's schedule and deadline) and leaves out `enabled`: mscale.daemon.config adds that key
    in front, defaulting to `default_enabled` and documented by `enabled_help`.
    """

    name: str  # also the config table [probes.<name>] and the `probe` label
    factory: Callable[[ProbeContext], Probe]
    section: type
    default_enabled: bool = True  # default of probes.<name>.enabled
    enabled_help: str = ""  # help of probes.<name>.enabled in the config table (empty: "run the <name> probe")

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.section):
            raise TypeError(f"probe {self.name}: section must be a dataclass, got {self.section!r}")
        keys = {f.name for f in dataclasses.fields(self.section)}
        if "enabled" in keys:
            raise TypeError(f"probe {self.name}: section declares 'enabled'; set default_enabled on the spec instead")
        missing = {"interval_s", "timeout_s"} - keys
        if missing:
            raise TypeError(f"probe {self.name}: section lacks {', '.join(sorted(missing))}")
