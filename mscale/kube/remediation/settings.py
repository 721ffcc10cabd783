"""[remediation]: GPU verdicts handed to the cluster's remediation, one table per filer
([remediation.<name>], from mscale.kube.remediation.REGISTRY, `enabled` first with the
filer's default)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mscale.options import opt


@dataclass(frozen=True)
class _Common:
    HELP: ClassVar[str] = "GPU verdicts (SDC proven by the fuse, fatal Xids) filed for node remediation"
    enabled: bool = opt(True, "turn GPU verdicts into filings (each filer below has its own switch)")
    interval_s: float = opt(
        10.0, "seconds between health checks of the open faults (undo) and retries", min=0.5, max=3600
    )
    clear_healthy_checks: int = opt(
        3, "consecutive healthy checks of a reset GPU before its filings are undone", min=1, max=1000
    )
    max_filings_per_hour: int = opt(
        6,
        "filings (not undos) one filer makes per hour at most, for each source: the jobs' proofs (sdc) "
        "and the GPU probe's fatal Xids (xid) apart; past it they wait, counted",
        min=1,
        max=10000,
    )
    retry_interval_s: float = opt(60.0, "a failed file or undo is tried again after this", min=1, max=86400)
    state_file: str = opt(
        "",
        "JSON file keeping the open faults and filings across agent restarts, an absolute path "
        "(empty: kept in memory only; a restart forgets an SDC verdict)",
    )

    def check(self, key: str) -> None:
        from mscale.options import ConfigError

        if self.state_file and not self.state_file.startswith("/"):
            raise ConfigError(f"{key}.state_file: expected an absolute path, got {self.state_file!r}")


class RemediationSection(_Common):
    """The [remediation] class: the common keys, then one table per registered filer. Read
    a filer's table as `cfg.remediation.<name>`."""

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any: ...


@functools.cache
def _filer_table(name: str) -> type:
    from mscale.kube.remediation import spec

    s = spec(name)
    enabled = dataclasses.make_dataclass(
        f"_{s.section.__name__}Enabled", [("enabled", bool, opt(s.default_enabled, s.enabled_help))], frozen=True
    )
    cls = dataclasses.make_dataclass(s.section.__name__, [], bases=(s.section, enabled), frozen=True)
    cls.__module__ = enabled.__module__ = s.section.__module__
    return cls


@functools.cache
def _section(names: tuple[str, ...]) -> type:
    tables = [(n, _filer_table(n)) for n in names]
    cls = dataclasses.make_dataclass(
        "RemediationSection",
        [(n, t, opt(None, f"the {n} filer", factory=t)) for n, t in tables],
        bases=(RemediationSection,),
        frozen=True,
    )
    cls.__module__ = __name__
    cls.HELP = _Common.HELP  # type: ignore[attr-defined]
    return cls


def section() -> type:
    """The [remediation] class for the filers registered now."""
    from mscale.kube.remediation import REGISTRY

    return _section(tuple(REGISTRY))
