"""Loss and gradient-norm statistics, in-process: NaN/Inf, spikes against a robust,
trend-following baseline, and jumps against the previous value.

Each series (the loss, the global gradient norm, each MPU's gradient norm) is watched on the
log of its values: losses and norms move by factors, and a factor is what a spike is. A real
training curve trends (early training falls fast, gradient norms rise and fall by several
times over tens of steps, warm-up moves both), so the baseline follows it: the location is
the median of the last `baseline` (10) log values, and a value's residual is its distance
above that. The scale is the spread of the recent residuals: the median absolute deviation of
the last `window` (100) residuals around their median, times 1.4826 (a normal sigma), never
below a floor: `scale_floor` (0.1, a 10% move) for the loss, `grad_scale_floor` (0.25) for the
gradient norms, which move 2-3x between clean steps of a quiet stretch. A value's z = (residual - median residual) / scale;
z >= `warn_sigma` (5) is a warning, z >= `action_sigma` (10) an action. Only upward moves
count: a falling loss is training. A value more than `jump_ratio` (10) times the previous one
is a jump, from the first steps on. No spike test until `min_history` (20) residuals are in
the window: the first ~30 steps are warm-up, watched by the NaN and jump tests only.

Why these numbers: on a tiny LLaVA with image-dependent data and on the tiny multimodal model,
3 seeds x 300 steps each (tests/test_loss_calibration.py), the per-MPU gradient norms of the
LLaVA's vision tower move by a factor ~2 per sigma between steps; 5 sigma and these floors keep
the clean runs at 0-1 warnings per 300 steps over all series, none critical, while a 10x jump
of the global gradient norm (>= 5.3 sigma at every step from 40 on, in every run) and a 25x
loss spike (a jump, and tens of sigma) are still caught in their step. Every finite positive value enters the windows, spikes included: the
medians barely move for one outlier, so a spike neither blinds the detector to the next one
nor makes a slow drift alarm. A value <= 0 (log undefined) is only checked for a jump.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mscale.findings import Finding, Reason, Severity

SOURCE = "loss"
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class LossConfig:
    window: int = 100  # residuals the scale is taken from
    warn_sigma: float = 5.0
    action_sigma: float = 10.0
    jump_ratio: float = 10.0
    min_history: int = 20  # residuals before the spike test starts (warm-up)
    grad_norms: bool = True  # also watch the global and per-MPU gradient norms
    baseline: int = 10  # log values whose median is the location (follows the trend)
    scale_floor: float = 0.1  # smallest scale of the loss, in log units (a flat series still has one)
    grad_scale_floor: float = 0.25  # of the gradient norms, which jump 2-3x between clean steps

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError(f"window: expected >= 3, got {self.window}")
        if not 0 < self.warn_sigma <= self.action_sigma:
            raise ValueError(
                f"warn_sigma/action_sigma: expected 0 < warn <= action, got {self.warn_sigma}, {self.action_sigma}"
            )
        if self.jump_ratio <= 1:
            raise ValueError(f"jump_ratio: expected > 1, got {self.jump_ratio}")
        if not 2 <= self.min_history <= self.window:
            raise ValueError(f"min_history: expected between 2 and window ({self.window}), got {self.min_history}")
        if self.baseline < 1:
            raise ValueError(f"baseline: expected >= 1, got {self.baseline}")
        if not (self.scale_floor > 0 and self.grad_scale_floor > 0):
            raise ValueError(
                f"scale_floor, grad_scale_floor: expected > 0, got {self.scale_floor}, {self.grad_scale_floor}"
            )


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])


@dataclass(frozen=True)
class Verdict:
    value: float
    z: float  # NaN when there is not enough history
    level: str  # "ok", "nonfinite", "jump", "action", "warn"


class SeriesDetector:
    """One series' windows. `check(value)` classifies and then records the value."""

    def __init__(self, config: LossConfig, scale_floor: float | None = None) -> None:
        self.config = config
        self.floor = config.scale_floor if scale_floor is None else scale_floor
        self.logs: deque[float] = deque(maxlen=config.baseline)
        self.residuals: deque[float] = deque(maxlen=config.window)
        self.previous: float | None = None
        self.seen = 0  # finite values checked

    def ready(self) -> bool:
        return len(self.logs) >= self.config.baseline and len(self.residuals) >= self.config.min_history

    def location_scale(self) -> tuple[float, float, float]:
        """(location, centre of the residuals, scale), the first two in log units."""
        loc = _median(sorted(self.logs))
        res = sorted(self.residuals)
        centre = _median(res) if res else 0.0
        mad = _median(sorted(abs(r - centre) for r in res)) if res else 0.0
        return loc, centre, max(MAD_TO_SIGMA * mad, self.floor)

    def bound(self, sigma: float) -> float:
        """The value at which a value would be `sigma` sigma above the baseline now."""
        loc, centre, scale = self.location_scale()
        return math.exp(loc + centre + sigma * scale)

    def check(self, value: float) -> Verdict:
        c = self.config
        if not math.isfinite(value):
            return Verdict(value, math.nan, "nonfinite")
        z = math.nan
        level = "ok"
        self.seen += 1
        if value > 0:
            x = math.log(value)
            if len(self.logs) >= c.baseline:
                loc, centre, scale = self.location_scale()
                if len(self.residuals) >= c.min_history:
                    z = (x - loc - centre) / scale
                    if z >= c.action_sigma:
                        level = "action"
                    elif z >= c.warn_sigma:
                        level = "warn"
                self.residuals.append(x - loc)
            self.logs.append(x)
        prev = self.previous
        if prev is not None and prev > 0 and value > c.jump_ratio * prev:
            level = "jump"
        self.previous = value
        return Verdict(value, z, level)


_LOSS_REASONS = {
    "nonfinite": (Reason.LOSS_NONFINITE, Severity.CRITICAL),
    "jump": (Reason.LOSS_JUMP, Severity.CRITICAL),
    "action": (Reason.LOSS_SPIKE_ACTION, Severity.CRITICAL),
    "warn": (Reason.LOSS_SPIKE_WARN, Severity.WARNING),
}
_GRAD_REASONS = {
    "nonfinite": (Reason.GRAD_NORM_NONFINITE, Severity.CRITICAL),
    "jump": (Reason.GRAD_NORM_JUMP, Severity.WARNING),
    "action": (Reason.GRAD_NORM_SPIKE, Severity.CRITICAL),
    "warn": (Reason.GRAD_NORM_SPIKE, Severity.WARNING),
}


class LossDetector:
    """The loss, the global gradient norm and each MPU's gradient norm, each its own series."""

    def __init__(self, config: LossConfig | None = None) -> None:
        self.config = config or LossConfig()
        self.series: dict[str, SeriesDetector] = {}
        self.last: dict[str, Verdict] = {}

    def _series(self, key: str) -> SeriesDetector:
        s = self.series.get(key)
        if s is None:
            floor = self.config.scale_floor if key == "loss" else self.config.grad_scale_floor
            s = self.series[key] = SeriesDetector(self.config, floor)
        return s

    def observe(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        mpu_grad_norms: Mapping[str, float] | None = None,
    ) -> list[Finding]:
        out: list[Finding] = []
        if loss is not None:
            out += self._one("loss", "loss", float(loss), step, _LOSS_REASONS, {})
        if self.config.grad_norms:
            if grad_norm is not None:
                out += self._one("grad_norm", "grad_norm", float(grad_norm), step, _GRAD_REASONS, {})
            for mpu_id, v in sorted((mpu_grad_norms or {}).items()):
                out += self._one(
                    f"grad_norm/{mpu_id}", "mpu_grad_norm", float(v), step, _GRAD_REASONS, {"mpu_id": mpu_id}
                )
        return out

    def _one(self, key: str, series: str, value: float, step: int, reasons: dict, labels: dict) -> Iterable[Finding]:
        verdict = self._series(key).check(value)
        self.last[key] = verdict
        if verdict.level == "ok":
            return []
        reason, severity = reasons[verdict.level]
        if verdict.level in ("warn", "action"):
            msg = f"{series} {value:.6g} is {verdict.z:.1f} sigma above its recent baseline"
        elif verdict.level == "jump":
            msg = f"{series} {value:.6g} is more than {self.config.jump_ratio:g}x the previous value"
        else:
            msg = f"{series} is {value}"
        return [
            Finding(
                SOURCE, reason, severity, msg, {**labels, "series": series, "level": verdict.level, "step": str(step)}
            )
        ]
