"""What a filer is: one module per place the cluster's remediation reads (an ExternalFault
object, the node condition, a command), each exporting `SPEC`.

A filer files a fault and clears it; the service (mscale.kube.remediation.service) decides
when, keeps the books (what is filed, retries, the rate limit) and calls it off nothing but its
own awaitables: a filer's blocking call runs in a thread under its deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mscale.kube.remediation.verdicts import KINDS, Fault

FILED, EXISTS, CLEARED, GONE = "filed", "exists", "cleared", "gone"


class FilingFailed(Exception):
    """A file or clear did not happen; the message says why. The service retries it."""

    def __init__(self, message: str, *, labels: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.labels = labels or {}


class Filer(Protocol):
    name: str
    kinds: tuple[str, ...]  # the kinds of fault it files

    async def start(self) -> None: ...

    async def file(self, fault: Fault) -> str:
        """FILED or EXISTS (filed before: idempotent); raises FilingFailed."""
        ...

    async def clear(self, fault: Fault) -> str:
        """CLEARED or GONE (nothing was there); raises FilingFailed."""
        ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class FilerSpec:
    """One line of the registry: the filer's name (its config table [remediation.<name>]),
    whether it is on by default, its section class and factory(section, ctx) -> Filer."""

    name: str
    default_enabled: bool
    section: type
    factory: Callable[[Any, Any], Any]  # a Filer, or None: inert here (nothing to file to)
    enabled_help: str
    kinds: tuple[str, ...] = KINDS


@dataclass(frozen=True)
class FilerContext:
    """What a filer may use: the agent's state, its whole config, the node's name, a clock."""

    state: Any
    config: Any
    node: str
    clock: Callable[[], float]
