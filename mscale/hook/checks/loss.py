"""Loss and gradient-norm statistics, in-process: NaN/Inf, spikes against a robust,
trend-following baseline, and jumps. docs/hook.md gives the calibration.

Series, on log values (a spike is a factor): the loss, the global gradient norm, and each MPU's
gradient norm relative to the rest of the model's, ||g_i|| / sqrt(||g||^2 - ||g_i||^2), all of
the whole gradient on every rank (mscale.hook.checks.cmsa.grad_stats). Clean training moves the whole
gradient together (4-6x for a few steps when a model starts to use an input): the global norm
watches that, and it cancels out of an MPU's relative norm, which moves when that MPU's gradient
moves alone, as a fault in it does. Location: the median of the last `baseline` (5) values; a
value's residual is its distance above it. Scale: 1.4826 x the MAD of the last `window` (100)
residuals, at least `scale_floor` (0.1) for the loss, `global_scale_floor` (0.3) for the global
norm, `grad_scale_floor` (0.25) for an MPU's. z = (residual - median residual) / scale: >=
`warn_sigma` (5) a warning, >= `action_sigma` (10) an action, upward only, once `min_history`
(20) residuals are in (the first ~25 steps are warm-up). A jump: more than `jump_ratio` (10)
times both the previous value and the recent median (a clean norm can fall 5x for one step),
from the first step; a gradient norm's is a warning unless it is an action too. A run of
warning-level values (a spike between warn and action, a gradient norm's jump) shorter than
`warn_run` (3) steps in a row is info: a finding of the same reason, which still puts its MPU
under suspicion (incident mode); the `warn_run`th in a row is the warning. Clean runs that
learn their data (tiny batches, the loss towards 0.02) show 5-7 sigma steps and 10-60x
whole-gradient jumps about once per 100 steps, one step alone or two in a row (docs/hook.md);
a fault that lasts is warned of from its third step, and a step at action level, a loss jump
or a NaN is critical in its step. Every finite positive value enters the windows, spikes
included (the medians barely move for one outlier); a value <= 0 is only checked for a jump.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mscale.findings import Finding, Reason, Severity

SOURCE = "loss"
MAD_TO_SIGMA = 1.4826


JUMP_AFTER = 3  # values seen before a jump is judged (see check)


@dataclass(frozen=True)
class LossConfig:
    window: int = 100  # residuals the scale is taken from
    warn_sigma: float = 5.0
    action_sigma: float = 10.0
    jump_ratio: float = 10.0
    min_history: int = 20  # residuals before the spike test starts (warm-up)
    grad_norms: bool = True  # also watch the global and per-MPU gradient norms
    baseline: int = 5  # log values whose median is the location (follows the trend)
    scale_floor: float = 0.1  # smallest scale of the loss, in log units (a flat series still has one)
    grad_scale_floor: float = 0.25  # of each MPU's gradient norm relative to the rest of the model's
    global_scale_floor: float = 0.3  # of the global gradient norm, which jumps 3-6x between clean steps
    warn_run: int = 3  # warning-level values in a row before they are a warning (fewer: info)

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
        if self.warn_run < 1:
            raise ValueError(f"warn_run: expected >= 1, got {self.warn_run}")
        if self.baseline < 1:
            raise ValueError(f"baseline: expected >= 1, got {self.baseline}")
        floors = (self.scale_floor, self.grad_scale_floor, self.global_scale_floor)
        if not all(f > 0 for f in floors):
            raise ValueError(f"scale_floor, grad_scale_floor, global_scale_floor: expected > 0, got {floors}")


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])


@dataclass(frozen=True)
class Verdict:
    value: float
    z: float  # NaN when there is not enough history
    level: str  # "ok", "nonfinite", "jump", "action", "warn"
    run: int = 1  # values in a row at "warn", "jump" or "action", this one included (0 when "ok")


class SeriesDetector:
    """One series' windows. `check(value)` classifies and then records the value."""

    def __init__(self, config: LossConfig, scale_floor: float | None = None) -> None:
        self.config = config
        self.floor = config.scale_floor if scale_floor is None else scale_floor
        self.logs: deque[float] = deque(maxlen=config.baseline)
        self.residuals: deque[float] = deque(maxlen=config.window)
        self.previous: float | None = None
        self.seen = 0  # finite values checked
        self.run = 0  # finite values in a row at warning level or above, up to the last one

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
        # a jump is over the previous value and the recent median both: not a value that follows
        # one unusually small (clean gradient norms fall 5x for a step and come back)
        ref = self.previous
        if ref is not None and self.logs:
            ref = max(ref, math.exp(_median(sorted(self.logs))))
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
        # from the fourth value on: the first updates (Adam's bias-corrected first steps) move
        # every norm by orders of magnitude in a clean run
        if ref is not None and ref > 0 and len(self.logs) > JUMP_AFTER and value > c.jump_ratio * ref:
            level = "jump"
        self.previous = value
        self.run = self.run + 1 if level != "ok" else 0
        return Verdict(value, z, level, self.run)


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
    """The loss, the global gradient norm and each MPU's gradient norm relative to the rest of
    the model's, each its own series (see the module docstring)."""

    def __init__(self, config: LossConfig | None = None) -> None:
        self.config = config or LossConfig()
        self.series: dict[str, SeriesDetector] = {}
        self.last: dict[str, Verdict] = {}

    def _series(self, key: str) -> SeriesDetector:
        s = self.series.get(key)
        if s is None:
            c = self.config
            floor = (
                c.scale_floor if key == "loss" else c.global_scale_floor if key == "grad_norm" else c.grad_scale_floor
            )
            s = self.series[key] = SeriesDetector(c, floor)
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
                value = relative(float(v), grad_norm)
                if value is not None:
                    what = f"mpu_grad_norm {float(v):.6g} ({value:.6g} times the rest of the model's)"
                    labels = {"mpu_id": mpu_id}
                    out += self._one(f"grad_norm/{mpu_id}", "mpu_grad_norm", value, step, _GRAD_REASONS, labels, what)
        return out

    def _one(
        self,
        key: str,
        series: str,
        value: float,
        step: int,
        reasons: dict[str, tuple[Reason, Severity]],
        labels: dict[str, str],
        what: str = "",
    ) -> Iterable[Finding]:
        verdict = self._series(key).check(value)
        self.last[key] = verdict
        level = verdict.level
        if level == "ok":
            return []
        if level == "jump" and reasons[level][1] is Severity.WARNING and verdict.z >= self.config.action_sigma:
            level = "action"  # a gradient norm's jump is a warning, its action level is more
        reason, severity = reasons[level]
        if severity is Severity.WARNING and verdict.run < self.config.warn_run:
            severity = Severity.INFO  # not yet a run: a clean run's heavy tail (see the module doc)
        what = what or f"{series} {value:.6g}"
        if level in ("warn", "action"):
            msg = f"{what} is {verdict.z:.1f} sigma above its recent baseline"
        elif level == "jump":
            msg = f"{what} is more than {self.config.jump_ratio:g}x the previous value and the recent median"
        else:
            msg = f"{series} is {value}"
        return [Finding(SOURCE, reason, severity, msg, {**labels, "series": series, "level": level, "step": str(step)})]


def relative(norm: float, global_norm: float | None) -> float | None:
    """An MPU's gradient norm relative to the rest of the model's (the global norm without it):
    what its series watches. The norm itself when there is no global norm to compare with, or
    when it is not finite (found as such); None when the rest is not finite (another MPU's
    fault, not this one's) or holds nothing (the MPU is the whole model: the global series
    watches it)."""
    if global_norm is None or not math.isfinite(norm):
        return norm
    if not math.isfinite(global_norm):
        return None
    rest_sq = global_norm * global_norm - norm * norm
    if not rest_sq > 1e-12 * global_norm * global_norm:
        return None
    return norm / math.sqrt(rest_sq)
