"""A probe as a new contributor would add one: this module plus one line in
mscale.probes.REGISTRY (tests/test_probe_registry.py adds it). On by default; its sample
echoes its own config keys, so a test sees the configured values reach the running probe."""

from __future__ import annotations

from dataclasses import dataclass

from mscale.options import opt
from mscale.probes.base import ProbeContext, ProbeSpec


@dataclass(frozen=True)
class ThrowawaySection:
    """[probes.throwaway]"""

    interval_s: float = opt(0.05, "seconds between throwaway samples", min=0.01, max=60)
    timeout_s: float = opt(2.0, "deadline for one sample", min=0.01, max=60)
    greeting: str = opt("hello", "what the sample says")
    level: int = opt(3, "how loudly it says it", min=1, max=10)


@dataclass(frozen=True)
class ThrowawaySnapshot:
    greeting: str
    level: int
    samples: int


class ThrowawayProbe:
    name = "throwaway"

    def __init__(self, section: ThrowawaySection) -> None:
        self.section = section
        self.samples = 0

    def sample(self) -> ThrowawaySnapshot:
        self.samples += 1
        return ThrowawaySnapshot(self.section.greeting, self.section.level, self.samples)

    def close(self) -> None:
        pass


def _factory(ctx: ProbeContext) -> ThrowawayProbe:
    return ThrowawayProbe(ctx.config.probes.throwaway)


SPEC = ProbeSpec(name="throwaway", factory=_factory, section=ThrowawaySection)
