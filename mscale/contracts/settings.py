"""[contract]: resource contracts, MSRP and the density guard. Read by the agent (compliance
checks, the guard) and by `mscale contract check`; a job passes allow_hugepage_allocation
to `mscale.contract(...)` itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mscale.options import ConfigError, opt


@dataclass(frozen=True)
class ContractSection:
    HELP: ClassVar[str] = "resource contracts, MSRP and the density guard"
    allow_hugepage_allocation: bool = opt(
        False,
        "let a contract short of free hugepages raise nr_hugepages by the shortfall (false: refuse, change nothing)",
    )
    check_interval_s: float = opt(
        10.0, "how often the agent checks each contract's threads in /proc/PID/task/*/status", min=0.5, max=3600
    )
    check_timeout_s: float = opt(5.0, "longest one compliance check may read /proc", min=0.1, max=600)
    max_contracts: int = opt(
        256, "contracts (job, rank) the agent keeps; past it a new one is refused", min=1, max=100_000
    )
    msrp_interval_s: float = opt(
        900.0, "how often a job re-runs its MSRP micro-probes (memory bandwidth, matmul throughput)", min=1, max=86400
    )
    density_interval_s: float = opt(
        10.0, "how often the density guard compares MPUs with their profile", min=1, max=3600
    )
    density_deviation: float = opt(
        0.15, "relative deviation of an MPU's compute density from its profile that counts", min=0.01, max=10
    )
    density_window_s: float = opt(60.0, "how long a deviation must last before it is a finding", min=1, max=86400)
    thermal_limit_c: float = opt(
        70.0, "no scale-up is recommended for an MPU whose GPU is at or above this temperature", min=20, max=120
    )

    def check(self, key: str) -> None:
        if self.check_timeout_s > self.check_interval_s:
            raise ConfigError(
                f"{key}.check_timeout_s: expected at most {key}.check_interval_s ({self.check_interval_s}), "
                f"got {self.check_timeout_s}"
            )


def section_from_file(path: str | None = None) -> ContractSection:
    """The [contract] table of the agent's config file, strictly (ConfigError names the key and
    line): `path`, else the default path when it exists, else the defaults. Reads only this
    table, so a training job does not assemble the agent's whole config."""
    import tomllib
    from pathlib import Path

    from mscale import options
    from mscale.textfile import read_text

    if path is None:
        if not options.DEFAULT_PATH.exists():
            return ContractSection()
        path = str(options.DEFAULT_PATH)
    text = read_text(Path(path), ConfigError, "config")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    table = data.get("contract", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: contract: expected a table [contract]")
    try:
        section = options.build(ContractSection, table, "contract.", text)
        section.check("contract")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return section
