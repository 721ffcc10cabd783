"""Loss and gradient-norm statistics, in-process: NaN/Inf, spikes against a robust rolling
baseline, and jumps against the previous value.

For each series (the loss, the global gradient norm, each MPU's gradient norm) a rolling
window of the last `window` finite values (default 100) gives a robust location and scale:
the median and 1.4826 * MAD (the median absolute deviation, scaled to a normal sigma). A
value's z = (value - median) / scale; z >= `warn_sigma` (3, the usual alerting practice) is a
warning, z >= `action_sigma` (6, where OLMo-core skips the step) an action. Only upward
moves count: a falling loss is training. A value more than `jump_ratio` (10) times the
previous one is a jump. Every finite value enters the window, spikes included: the median
and MAD barely move for one outlier, so a spike neither blinds the detector to the next one
nor makes a slow drift alarm (the window follows it). No spike test until `min_history`
values are in the window.
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
    window: int = 100
    warn_sigma: float = 3.0
    action_sigma: float = 6.0
    jump_ratio: float = 10.0
    min_history: int = 10
    grad_norms: bool = True  # also watch the global and per-MPU gradient norms

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
    """One series' rolling window. `check(value)` classifies and then records the value."""

    def __init__(self, config: LossConfig) -> None:
        self.config = config
        self.values: deque[float] = deque(maxlen=config.window)
        self.previous: float | None = None

    def location_scale(self) -> tuple[float, float]:
        vals = sorted(self.values)
        med = _median(vals)
        mad = _median(sorted(abs(v - med) for v in vals))
        # floor: a flat series (MAD 0) still needs a scale; relative to its level
        return med, max(MAD_TO_SIGMA * mad, 1e-3 * abs(med), 1e-12)

    def check(self, value: float) -> Verdict:
        c = self.config
        if not math.isfinite(value):
            return Verdict(value, math.nan, "nonfinite")
        z = math.nan
        level = "ok"
        if len(self.values) >= c.min_history:
            med, scale = self.location_scale()
            z = (value - med) / scale
            if z >= c.action_sigma:
                level = "action"
            elif z >= c.warn_sigma:
                level = "warn"
        prev = self.previous
        if prev is not None and prev > 0 and value > c.jump_ratio * prev:
            level = "jump"
        self.values.append(value)
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
            s = self.series[key] = SeriesDetector(self.config)
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
            msg = f"{series} {value:.6g} is {verdict.z:.1f} sigma above its rolling median"
        elif verdict.level == "jump":
            msg = f"{series} {value:.6g} is more than {self.config.jump_ratio:g}x the previous value"
        else:
            msg = f"{series} is {value}"
        return [
            Finding(
                SOURCE, reason, severity, msg, {**labels, "series": series, "level": verdict.level, "step": str(step)}
            )
        ]
