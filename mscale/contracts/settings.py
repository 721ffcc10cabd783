"""[contract]: resource contracts, MSRP and the density guard. Read by the agent (compliance
checks, the guard) and by `mscale contract check`; a job passes allow_hugepage_allocation
to `mscale.contract(...)` itself."""

from __future__ import annotations

from dataclasses import dataclass

from mscale.config import ConfigError, opt


@dataclass(frozen=True)
class ContractSection:
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
