"""The per-MPU fuse state machine and the per-job loss state.

    HEALTHY -> SUSPECT -> L1_SWAPPED -> L2_DEGRADED -> L3_DISTILLING -> RECOVERED -> HEALTHY

Escalation may skip levels (no standby: straight to L2; swap rate limit: L1 -> L2). Coming
down needs a clean stretch (hysteresis): `clean_steps` steps without a failure move an MPU at
L1/L2/L3 to RECOVERED (the L2/L3 measures are undone then), and RECOVERED or SUSPECT back to
HEALTHY. A failure resets the stretch. Pure Python, no torch: the agent and the training
process share it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class Level(str, Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    L1_SWAPPED = "l1_swapped"
    L2_DEGRADED = "l2_degraded"
    L3_DISTILLING = "l3_distilling"
    RECOVERED = "recovered"

    @property
    def number(self) -> int:
        """The fuse level in force: 0 (none), 1, 2 or 3; the `mscale_fuse_level` gauge."""
        return {Level.L1_SWAPPED: 1, Level.L2_DEGRADED: 2, Level.L3_DISTILLING: 3}.get(self, 0)


_ESCALATED = (Level.L1_SWAPPED, Level.L2_DEGRADED, Level.L3_DISTILLING)

ALLOWED: dict[Level, frozenset[Level]] = {
    Level.HEALTHY: frozenset({Level.SUSPECT, Level.L1_SWAPPED, Level.L2_DEGRADED}),
    Level.SUSPECT: frozenset({Level.HEALTHY, Level.L1_SWAPPED, Level.L2_DEGRADED}),
    # a second swap (the standby failed, a new standby is healthy) stays at L1
    Level.L1_SWAPPED: frozenset({Level.L1_SWAPPED, Level.L2_DEGRADED, Level.RECOVERED}),
    Level.L2_DEGRADED: frozenset({Level.L3_DISTILLING, Level.RECOVERED}),
    Level.L3_DISTILLING: frozenset({Level.RECOVERED}),
    Level.RECOVERED: frozenset({Level.HEALTHY, Level.SUSPECT, Level.L1_SWAPPED, Level.L2_DEGRADED}),
}


class IllegalTransition(ValueError):
    pass


@dataclass
class Transition:
    step: int
    before: Level
    after: Level
    why: str


@dataclass
class MpuFuseState:
    """One MPU's place in the fuse state machine. `clean_steps` is the hysteresis length."""

    job_id: str
    mpu_id: str
    clean_steps: int = 50
    level: Level = Level.HEALTHY
    clean: int = 0  # consecutive clean steps
    swap_times: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    history: list[Transition] = field(default_factory=list)

    def to(self, level: Level, *, step: int = -1, why: str = "") -> Transition:
        if level not in ALLOWED[self.level]:
            raise IllegalTransition(f"mpu {self.mpu_id}: {self.level.value} -> {level.value} is not a fuse transition")
        t = Transition(step, self.level, level, why)
        self.level = level
        self.clean = 0
        self.history.append(t)
        return t

    def failed(self) -> None:
        self.clean = 0

    def clean_step(self, step: int) -> Transition | None:
        """Count one clean step; returns the transition the hysteresis allows, if any."""
        if self.level is Level.HEALTHY:
            return None
        self.clean += 1
        if self.clean < self.clean_steps:
            return None
        if self.level in _ESCALATED:
            return self.to(Level.RECOVERED, step=step, why=f"{self.clean_steps} clean steps")
        return self.to(Level.HEALTHY, step=step, why=f"{self.clean_steps} clean steps")

    def swaps_since(self, t0: float) -> int:
        return sum(1 for t in self.swap_times if t >= t0)


@dataclass
class JobLossState:
    """Loss-side state of one job: whether its LR cooling window is open (the policy's job
    levels: healthy or cooling)."""

    job_id: str
    cooling: bool = False

    @property
    def level(self) -> str:
        return "cooling" if self.cooling else "healthy"
