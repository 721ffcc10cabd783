"""A probe that is off by default (`default_enabled=False` on its spec): it runs only when
`[probes.dormant] enabled = true`. Registered by tests/test_probe_registry.py."""

from __future__ import annotations

from dataclasses import dataclass

from mscale.options import opt
from mscale.probes.base import ProbeContext, ProbeSpec


@dataclass(frozen=True)
class DormantSection:
    """[probes.dormant]"""

    interval_s: float = opt(0.05, "seconds between dormant samples", min=0.01, max=60)
    timeout_s: float = opt(2.0, "deadline for one sample", min=0.01, max=60)


class DormantProbe:
    name = "dormant"

    def sample(self) -> str:
        return "awake"

    def close(self) -> None:
        pass


def _factory(ctx: ProbeContext) -> DormantProbe:
    return DormantProbe()


SPEC = ProbeSpec(
    name="dormant",
    factory=_factory,
    section=DormantSection,
    default_enabled=False,
    enabled_help="run the dormant probe (off unless asked for)",
)
