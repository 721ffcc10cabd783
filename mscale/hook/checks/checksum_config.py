"""The checksums' configuration (mscale.hook.checks.checksum): what is checked, within which budget,
with which tolerances. `mscale.ChecksumConfig`; see docs/hook.md for every field."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from mscale.healing.settings import HealingSection

DEFAULT_RTOL: dict[torch.dtype, float] = {
    torch.float32: 2e-6,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
    torch.float64: 1e-12,
}
# TF32 keeps float32's exponent and 10 of its 23 mantissa bits: cuBLAS rounds x and W to it
# (unit roundoff 2^-11 ~ 4.9e-4 each, so up to ~2^-10 ~ 9.8e-4 per product term of S) and
# accumulates in float32. 2e-3 is twice that worst case per term, float16's rtol (the same
# 10-bit mantissa), and still ~5000x below the scaling of a single exponent-bit flip.
TF32_RTOL = 2e-3
# bfloat16 outputs: the tolerance comes from the output's own rounding, not from rtol x S. A GEMM
# that accumulates in float32 rounds each output once to bf16 (8-bit mantissa): an error within
# half an ulp, ulp <= 2^-7 |y|, so of standard deviation at most 2^-7/sqrt(12) |y|. Summed with
# random +-1 weights (ChecksumDetector's signs) those errors add like a random walk whatever the
# rounding's bias: the weighted sum's rounding has standard deviation at most
# BF16_ROUNDING x ||y||_2, and the tolerance is `rounding_sigmas` (6) of that. Measured on this
# CPU (tiny LLaVA, 2,800 clean checks): 0.74 of the bound on average (mantissas spread
# log-uniformly give 0.425 x 2^-8 / 0.577 x 2^-8), the largest 2.75, so 6 is 8 actual sigmas.
BF16_ROUNDING = 2.0**-7 / 12**0.5
ROUNDING_SIGMAS = 6.0


VERDICTS = ("auto", "in_step", "commit")


@dataclass(frozen=True)
class ChecksumConfig:
    abft: bool = True  # ABFT on the linear layers inside each MPU
    budget: float = 0.01  # the share of step time the checks may take (mscale.hook.checks.budget)
    # the share of the budget the plans leave unspent: a plan is made from smoothed estimates of
    # figures that vary from step to step (a checked element's seconds, the others' spend, the
    # step time), so one that spent the whole budget would exceed it whenever they read low.
    # Layers beyond the floors are bought up to (1 - headroom) x budget. 0: the whole budget.
    headroom: float = 0.3
    max_gap_steps: int = 8  # every checked layer of every MPU at least once in this many steps
    full: bool = False  # every layer every step, whatever the budget (the pre-budget default)
    # what a check costs the step beyond its own timed work, as a multiple of it: the cache it
    # evicts and the memory traffic the step then repeats, which no timer around the check sees.
    # Layers beyond the max_gap_steps floor are bought at (1 + unseen_cost) x their timed cost.
    unseen_cost: float = 1.0
    # of the budget (at most what the guard's other work leaves), for background replays: an MPU's
    # forward run again, the one check that sees a fault outside every linear layer (a norm, an
    # activation, a tower's output); the steps between two replays of an MPU are what its bound
    # comes to (`mscale_checksum_replay_gap_steps`)
    replay_share: float = 0.2
    # each MPU replayed at least once in this many steps, whatever the budget (0: the budget
    # alone); all MPUs' replays cost about a third of a step, so 400 costs about 0.08% of one
    replay_max_gap_steps: int = 400
    # the pre-budget spelling, a special case: every MPU replayed every K steps, no budgeted
    # replays (0: no background replay at all; incident mode still replays)
    replay_every: int | None = None
    incident_steps: int = 16  # steps of full coverage and replay after a suspicion
    # each MPU output's scale (ln mean square) against its own baseline, every step: a shift held
    # 3 steps is a warning `output_shift` and a suspicion (mscale.hook.checks.outstats); False: off
    output_stats: bool = True
    # deprecated alias of healing.checksum_failures_l1, the one L1 threshold (see one_l1): set,
    # it must agree with that key; None: that key alone
    failures_l1: int | None = None
    # where verdicts are read: "in_step" after each MPU forward (a fault re-run in the step),
    # "commit" once per step at the optimizer step (no host read inside forward or backward);
    # "auto": in_step on a CPU (a read there costs no synchronisation), commit elsewhere
    verdicts: str = "auto"
    # replay recomputes on the same device: deterministic kernels agree bitwise, so the
    # tolerance (relative to the output's largest magnitude) only absorbs reduction-order
    # noise of non-deterministic kernels, in any dtype
    replay_rtol: float = 1e-5
    rtol: Mapping[torch.dtype, float] = field(default_factory=lambda: dict(DEFAULT_RTOL))
    # bfloat16 layers: tolerance in multiples of the bound on the output rounding's standard
    # deviation (BF16_ROUNDING x ||y||_2); 0: rtol[bfloat16] x S instead (the worst-case
    # bound, for a kernel that rounds more than once per output)
    rounding_sigmas: float = ROUNDING_SIGMAS
    tf32_rtol: float = TF32_RTOL  # float32 GEMMs on CUDA while TF32 is allowed (see TF32_RTOL)

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"budget: expected a share of step time in 0..1, got {self.budget}")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom: expected a share of the budget in 0..1 (1 excluded), got {self.headroom}")
        if not 1 <= self.max_gap_steps <= 8:
            raise ValueError(f"max_gap_steps: expected 1..8, got {self.max_gap_steps}")
        if not 0.0 <= self.unseen_cost <= 100.0:
            raise ValueError(f"unseen_cost: expected a multiple of the timed cost in 0..100, got {self.unseen_cost}")
        if not 0.0 <= self.replay_share <= 1.0:
            raise ValueError(f"replay_share: expected 0..1, got {self.replay_share}")
        if self.replay_max_gap_steps < 0:
            raise ValueError(f"replay_max_gap_steps: expected >= 0, got {self.replay_max_gap_steps}")
        if self.replay_every is not None and self.replay_every < 0:
            raise ValueError(f"replay_every: expected >= 0, got {self.replay_every}")
        if self.incident_steps < 1:
            raise ValueError(f"incident_steps: expected >= 1, got {self.incident_steps}")
        if self.failures_l1 is not None and self.failures_l1 < 1:
            raise ValueError(f"failures_l1: expected >= 1, got {self.failures_l1}")
        if not 0.0 <= self.rounding_sigmas < 1e3:
            raise ValueError(f"rounding_sigmas: expected 0 (off) or a multiple below 1000, got {self.rounding_sigmas}")
        if self.verdicts not in VERDICTS:
            raise ValueError(f"verdicts: expected one of {', '.join(VERDICTS)}, got {self.verdicts!r}")

    def replays(self) -> tuple[float, int]:
        """(replay_share, replay_max_gap_steps) in force, `replay_every` applied."""
        if self.replay_every is None:
            return self.replay_share, self.replay_max_gap_steps
        return 0.0, self.replay_every

    def tolerance(
        self, dtype: torch.dtype, device: torch.device | str | None = None, *, tf32: bool | None = None
    ) -> float:
        """rtol for a GEMM with output `dtype` on `device`: by dtype; a float32 GEMM on CUDA while
        TF32 is allowed (`tf32`, default torch.backends.cuda.matmul.allow_tf32, which
        torch.set_float32_matmul_precision("high"/"medium") also turns on) at no less than
        `tf32_rtol`: cuBLAS then rounds its inputs to TF32's 10-bit mantissa."""
        rtol = self.rtol.get(dtype, DEFAULT_RTOL.get(dtype, 1e-2))
        if dtype != torch.float32 or device is None or torch.device(device).type != "cuda":
            return rtol
        if tf32 is None:
            tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        return max(rtol, self.tf32_rtol) if tf32 else rtol


def one_l1(checksum: ChecksumConfig | None, healing: HealingSection | None) -> HealingSection:
    """The healing section in force, with its checksum_failures_l1 the one L1 threshold: the
    fuse's decision (mscale.hook.fuse.fuse) and the detector's CHECKSUM_L1_TRIGGER both read it.
    ChecksumConfig.failures_l1 is a deprecated alias: set with a healing section that says
    otherwise, it is an error naming both keys; set alone, a warning, and it sets the value."""
    old = None if checksum is None else checksum.failures_l1
    if old is None:
        return healing or HealingSection()
    if healing is not None:
        if healing.checksum_failures_l1 != old:
            raise ValueError(
                f"ChecksumConfig.failures_l1 ({old}) and healing.checksum_failures_l1 "
                f"({healing.checksum_failures_l1}) differ: they are one threshold; set "
                "healing.checksum_failures_l1 only (ChecksumConfig.failures_l1 is deprecated)"
            )
        return healing
    warnings.warn(
        f"ChecksumConfig.failures_l1 is deprecated: set healing.checksum_failures_l1 (= {old}) instead",
        FutureWarning,
        stacklevel=3,
    )
    return replace(HealingSection(), checksum_failures_l1=old)
