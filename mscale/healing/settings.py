"""[healing]: the healing engine's config section, read by the engine in both processes
(the agent's healing service and the in-process fuse). Assembled into `mscale.daemon.config.Config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mscale.options import ConfigError, opt


@dataclass(frozen=True)
class HealingSection:
    HELP: ClassVar[str] = "the healing engine"
    enabled: bool = opt(True, "let the healing engine act (false: detect and report only)")
    checksum_failures_l1: int = opt(
        3,
        "consecutive checksum failures of an MPU that trigger an L1 swap: the one L1 threshold, the fuse's "
        "decision and the checksum detector's checksum_l1_trigger (ChecksumConfig.failures_l1: a deprecated alias)",
        min=1,
        max=1000,
    )
    max_swaps_per_hour: int = opt(4, "L1 swaps of one MPU per hour before escalating to L2", min=1, max=1000)
    recovery_clean_steps: int = opt(50, "clean steps an MPU needs before it counts as recovered", min=1, max=1_000_000)
    lr_cool_factor: float = opt(0.1, "LR multiplier during a loss-spike cooling window", min=1e-6, max=1.0)
    lr_cool_steps: int = opt(20, "length of the cooling window in steps", min=1, max=1_000_000)
    distill_weight_min: float = opt(0.15, "lower bound of the L3 distillation share of the loss", min=0.0, max=1.0)
    distill_weight_max: float = opt(0.30, "upper bound of the L3 distillation share of the loss", min=0.0, max=1.0)
    frozen_weights_every: int = opt(
        1,
        "steps between checks of the frozen weights' fingerprints (trained ones: weight_groups)",
        min=1,
        max=1_000_000,
    )
    weight_groups: int = opt(
        8,
        "the trained weights' fingerprints rotate over N groups of about equal bytes: each window "
        "between two steps checks one group, every weight once in N steps (1: all, every step)",
        min=1,
        max=1_000,
    )
    gradient_groups: int = opt(
        8,
        "each MPU's weight gradients are checked before the reduction in N rotating groups of about "
        "equal bytes, one group a step: every gradient once in N steps (0: off)",
        min=0,
        max=1_000,
    )
    replica_check_steps: int = opt(
        8,
        "with several ranks, every N steps the replicas compare per-MPU weight fingerprints and a "
        "diverged rank's MPU is repaired from a healthy rank (0: never)",
        min=0,
        max=1_000_000,
    )
    progress_step_reruns: int = opt(
        1,
        "re-runs of a step whose checks failed at the commit point, on its batch from the step's "
        "start (weights kept, data and RNG rewound); past them the batch is skipped",
        min=0,
        max=8,
    )
    progress_rung_calls: int = opt(
        3,
        "optimizer calls a fault's culprit (an MPU, or the job) may lose at one level before it "
        "escalates: an MPU to its next fuse level, the job to skipped batches, past the last to the stop",
        min=1,
        max=1000,
    )
    progress_event_calls: int = opt(
        24,
        "the most optimizer calls one fault event may cost (dropped, re-run or undone by a "
        "rollback); past it the job stops with mscale.ProgressBoundExceeded",
        min=1,
        max=1_000_000,
    )
    progress_run_share: float = opt(
        0.25,
        "the share of the run's optimizer calls all faults together may cost (at least "
        "progress_event_calls); past it the job stops with mscale.ProgressBoundExceeded",
        min=0.0,
        max=1.0,
    )
    progress_clean_calls: int = opt(
        5, "clean optimizer calls in a row that end a culprit's fault event", min=1, max=1_000_000
    )
    policy: str = opt("", "healing policy YAML (empty: the shipped default policy)")
    l2_precision_fallback: bool = opt(
        False,
        "L2 on a CPU MPU also runs its forward in bf16; trades checksum sensitivity "
        "(bf16 tolerance 1e-2 vs 2e-6 in fp32: corruption below it goes unseen while "
        "degraded, so L3 may not engage). An MPU on a GPU moves to the CPU regardless",
    )

    def check(self, key: str) -> None:
        """Rules across fields, run when a config file is loaded (`key` is "healing")."""
        from mscale.healing.progress import MPU_RUNGS

        if self.progress_event_calls < MPU_RUNGS * self.progress_rung_calls:
            raise ConfigError(
                f"{key}.progress_event_calls: expected at least {MPU_RUNGS} x {key}.progress_rung_calls "
                f"({MPU_RUNGS * self.progress_rung_calls}: every fuse level its calls), got {self.progress_event_calls}"
            )
        if self.distill_weight_min > self.distill_weight_max:
            raise ConfigError(
                f"{key}.distill_weight_min: expected at most {key}.distill_weight_max "
                f"({self.distill_weight_max}), got {self.distill_weight_min}"
            )
