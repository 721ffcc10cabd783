"""The probe protocol. A probe is one module exporting `SPEC`, listed in probes/__init__.py.

`sample()` is blocking and runs in the probe's own worker thread under a deadline
(mscale.daemon.runner); it returns an immutable snapshot that collectors read at scrape
time. Probes report faults as findings through `ctx.emit`, never by raising.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from mscale.config import Config
    from mscale.daemon.state import AgentState
    from mscale.findings import Finding


class ProbeUnavailable(RuntimeError):
    """The probe cannot run here (no BCC, no permission, no driver): 'not there', not a crash."""


@dataclass(frozen=True)
class ProbeContext:
    config: "Config"
    state: "AgentState"
    emit: Callable[["Finding"], Any]
    clock: Callable[[], float]
    nvml: Any = None  # an mscale.probes.nvml_api.Nvml (real or simulated) for GPU probes


class Probe(Protocol):
    name: str

    def sample(self) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ProbeSpec:
    name: str  # also the config section [probes.<name>] and the `probe` label
    factory: Callable[[ProbeContext], Probe]
    default_enabled: bool = True
    requires: str = ""  # what it needs, shown in /api/v1/probes and the README
