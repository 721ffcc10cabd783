"""Output statistics per MPU: faults outside every linear layer (a norm, an activation, a
residual add, a tower's output after its last linear), which ABFT does not see and a background
replay sees only once in up to `replay_max_gap_steps` steps, found within a few steps.

Every training forward of every MPU, the norm of each of its first `MAX_TENSORS` distinct output
tensors is taken on the device (no host read); at the commit point they join the step's one read
and each output's x = ln(mean square) over the step's forwards is compared with its own baseline
(`Series`): two of Holt's predictors of level and trend (`PREDICTORS`: a steady one, for an output
that jitters, and a quick one, which follows training's swings), so training's drift is predicted,
and of the two the one whose median absolute one-step error over the last `RECENT` baseline steps
is the smaller, that median its spread (robust: the warm-up's ramp and a swing's few large errors
leave it once out of that window, and do not widen it meanwhile). `CONFIRM` steps in a row
departing on one side by more than max(`SIGMAS` sigmas, `FLOOR`), each to a scale the output has
not had in its last `RANGE` baseline steps (past their range by `FLOOR`: a swing of training's
coming back is not new), are a shift: a warning `output_shift` naming the MPU and a
suspicion (incident mode: every layer checked, the forward replayed, for `incident_steps`), whose
replays make the verdict the fuse acts on. Bounds, costs and limits: docs/hook.md, "Faults
outside the linears".
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from mscale.findings import Finding, Reason, Severity

SOURCE = "output_stats"
MAX_TENSORS = 4  # output tensors followed per MPU (the first: a tower's last hidden state first)
# Holt's smoothings (level, trend) of the baseline's predictors: steady, and quick (a swing followed)
PREDICTORS = ((0.5, 0.2), (0.9, 0.8))
SIGMAS = 6.0  # the departure, in standard deviations of the one-step prediction error
NORMAL = 1.4826  # a normal error's standard deviation over its median absolute value
FLOOR = 0.25  # the least departure looked at, in ln(mean square)
CONFIRM = 3  # departing steps in a row that make a shift
WARMUP = 8  # steps before the baseline is tested
RECENT = 16  # the baseline steps whose one-step errors make the spread
RANGE = 8  # the baseline steps whose range a shift must leave (a swing of training's stays inside)


class Series:
    """One output's baseline (see the module docstring); `add(x)` returns the shift when `x` is
    the `CONFIRM`th departing step in a row: (departure, threshold), else None."""

    __slots__ = ("levels", "trends", "n", "pending", "errors", "recent")

    def __init__(self) -> None:
        self.levels: list[float] = []  # per predictor; empty before the first step
        self.trends = [0.0] * len(PREDICTORS)
        self.n = 0
        self.pending: list[float] = []  # the departures of the steps departing now
        # per predictor, the last baseline steps' |one-step error|
        self.errors: list[deque[float]] = [deque(maxlen=RECENT) for _ in PREDICTORS]
        self.recent: deque[float] = deque(maxlen=RANGE)  # the last baseline steps' x

    def _start(self, x: float) -> None:
        """The baseline from `x`, its first step (again after a shift: from the new level)."""
        self.levels, self.trends, self.n, self.pending = [x] * len(PREDICTORS), [0.0] * len(PREDICTORS), 1, []
        for errors in self.errors:
            errors.clear()
        self.recent.clear()
        self.recent.append(x)

    def _spreads(self) -> list[float]:
        return [statistics.median(e) if e else 0.0 for e in self.errors]

    def threshold(self) -> float:
        return max(SIGMAS * NORMAL * min(self._spreads()), FLOOR)

    def add(self, x: float) -> tuple[float, float] | None:
        if not self.levels:
            self._start(x)
            return None
        ahead = len(self.pending) + 1  # steps since the last baseline step
        errs = [x - (level + trend * ahead) for level, trend in zip(self.levels, self.trends, strict=True)]
        # (inside the last RANGE steps' range, widened by FLOOR, no step departs: no medians to take)
        if self.n >= WARMUP and not min(self.recent) - FLOOR <= x <= max(self.recent) + FLOOR:
            spreads = self._spreads()
            r, thr = errs[spreads.index(min(spreads))], max(SIGMAS * NORMAL * min(spreads), FLOOR)
            if self._departs(x, r, thr):
                self.pending.append(r)
                if len(self.pending) < CONFIRM:
                    return None
                self._start(x)
                return r, thr
        for i, (a, b) in enumerate(PREDICTORS):  # (a transient: carried on past the steps it departed)
            last = self.levels[i] + self.trends[i] * (ahead - 1)
            level = a * x + (1 - a) * (last + self.trends[i])
            self.trends[i] = b * (level - last) + (1 - b) * self.trends[i]
            self.levels[i] = level
            self.errors[i].append(abs(errs[i]))
        self.pending = []
        self.n += 1
        self.recent.append(x)
        return None

    def _departs(self, x: float, r: float, thr: float) -> bool:
        """`x` is off the better predictor's prediction by more than `thr`, on the side of the
        steps departing now, and past the range of the last `RANGE` baseline steps by `FLOOR` on
        that side: a level the output had a few steps ago (training's swing coming back, which
        the trend, still pointing the other way, mispredicts) is not a shift."""
        if abs(r) <= thr or (self.pending and (r > 0) != (self.pending[0] > 0)):
            return False
        return x > max(self.recent) + FLOOR if r > 0 else x < min(self.recent) - FLOOR


class _Mpu:
    """One MPU's outputs' baselines, and its in-graph sums when its forwards run compiled."""

    __slots__ = ("graph", "series", "where")

    def __init__(self) -> None:
        self.graph: torch.Tensor | None = None  # (2, MAX_TENSORS): sum(y^2), numel (compiled forwards)
        self.series: list[Series] = []
        self.where: Any = None  # the fuse level and device the baselines were made at


class OutputStats:
    """Owned by the checksum detector: `observe` (eager) or `traced` (in a compiled graph) in each
    MPU forward, `pack` and `judge` at the commit point; `forget` starts an MPU's baselines again."""

    def __init__(
        self,
        *,
        emit: Callable[[Finding], None],
        suspect: Callable[[str, str], None],
        labels: Callable[[Any], dict[str, str]],
        enabled: bool = True,
    ) -> None:
        self._emit, self._suspect, self._labels, self.enabled = emit, suspect, labels, enabled
        self._mpus: dict[str, _Mpu] = {}
        self._by_id: dict[str, Any] = {}
        # this step's eager norms, by device (one stack each at the commit), and what each is:
        # (mpu_id, output slot, elements), in the same order
        self._norms: dict[torch.device, list[torch.Tensor]] = {}
        self._what: dict[torch.device, list[tuple[str, int, int]]] = {}
        self._last_step = -1  # the step judged last (a step not after it: a rollback)
        self._packed: list[tuple[str, list[tuple[str, int, int]]]] = []  # (key, what) in the read

    def attach(self, mpu: Any) -> None:
        if self.enabled:  # (disabled: no MPU, every other call does nothing)
            self._mpus[mpu.mpu_id] = _Mpu()
        self._by_id[mpu.mpu_id] = mpu

    def begin_step(self) -> None:
        """The step's sums start empty; the in-graph ones on each MPU's device (it may have moved)."""
        self._norms, self._what = {}, {}
        for mid, st in self._mpus.items():
            device = self._by_id[mid].device
            if st.graph is None or st.graph.device != device:
                st.graph = torch.zeros(2, MAX_TENSORS, dtype=torch.float64, device=device)

    def forget(self, mpu: Any) -> None:
        st = self._mpus.get(mpu.mpu_id)
        if st is not None:
            st.series = []

    # --- in forward (no host read) ------------------------------------------------------

    def observe(self, mpu: Any, outs: list[torch.Tensor]) -> None:
        """The norms of the forward's first output tensors (one reduction each), left on the
        device. Called under no_grad."""
        if mpu.mpu_id not in self._mpus or not mpu.module.training or not outs:
            return
        dev = outs[0].device
        norms, what = self._norms.setdefault(dev, []), self._what.setdefault(dev, [])
        for i, t in enumerate(outs[:MAX_TENSORS]):  # (the caller's no_grad: no detach)
            if t.device == dev:
                norms.append(torch.linalg.vector_norm(t, dtype=_acc(t.dtype)))
                what.append((mpu.mpu_id, i, t.numel()))

    def traced(self, mpu: Any, outs: list[torch.Tensor]) -> None:
        """`observe` inside a compiled graph: the sums written in place into a device tensor."""
        st = self._mpus.get(mpu.mpu_id)
        if st is None or st.graph is None or not outs or not mpu.module.training:
            return
        with torch.no_grad():
            ts = outs[:MAX_TENSORS]
            sq = torch.stack([torch.linalg.vector_norm(t.detach(), dtype=torch.float32) for t in ts])
            n = sq.new_tensor([float(t.numel()) for t in ts])
            st.graph[:, : len(ts)].add_(torch.stack((sq.square(), n)).to(st.graph.device, st.graph.dtype))

    # --- at the commit point --------------------------------------------------------------

    def pack(self, point: Any, traced: set[str]) -> None:
        """The step's norms into the commit point's read (one stack per device, `outputs/<n>`);
        the in-graph sums of the MPUs whose forwards ran compiled (`traced`, by id)."""
        self._packed = []
        for n, (dev, norms) in enumerate(self._norms.items()):
            if norms:
                point.put(f"outputs/{n}", torch.stack(norms))
                self._packed.append((f"outputs/{n}", self._what[dev]))
        self._norms, self._what = {}, {}
        for mid in traced:
            st = self._mpus.get(mid)
            if st is not None and st.graph is not None:
                point.put(f"outputs/{mid}", st.graph.reshape(-1).clone())
                st.graph.zero_()
                self._packed.append((f"outputs/{mid}", []))

    def _sums(self, point: Any) -> dict[str, list[tuple[float, int]]]:
        """Per MPU id, per output slot: (sum(y^2), elements) over the step's forwards."""
        sums: dict[str, dict[int, list[Any]]] = {}
        for key, what in self._packed:
            values = point.get(key) or []
            if not what:  # the in-graph sums: (sum(y^2) x MAX_TENSORS, numel x MAX_TENSORS)
                mid = key.split("/", 1)[1]
                what = [(mid, i, int(n)) for i, n in enumerate(values[MAX_TENSORS:]) if n > 0]
                values = [math.sqrt(v) if v >= 0 else math.nan for v in values[: len(what)]]
            for (mid, i, n), norm in zip(what, values, strict=False):
                acc = sums.setdefault(mid, {}).setdefault(i, [0.0, 0])
                acc[0] += norm * norm
                acc[1] += n
        return {mid: [(v[0], v[1]) for _, v in sorted(slots.items())] for mid, slots in sums.items()}

    def judge(self, point: Any, step: int, *, skip: bool = False) -> None:
        """After the read: each output's ln(mean square) against its baseline; a shift is a
        warning and a suspicion of its MPU. `skip`: the step is not judged (a batch that was
        not finite: nothing to learn from)."""
        rollback, self._last_step = step <= self._last_step, step
        sums = self._sums(point)
        self._packed = []
        for mid, slots in sums.items():
            mpu, st = self._by_id[mid], self._mpus[mid]
            where = (getattr(mpu, "fuse_level", None), mpu.device)
            if rollback or where != st.where or len(st.series) != len(slots):
                st.series, st.where = [Series() for _ in slots], where  # the baselines start again
            if skip:
                continue
            shifts = []
            for i, (sq, n) in enumerate(slots):
                if n > 0 and math.isfinite(sq) and sq > 0:  # (non-finite: the checksum's; all zero: no scale)
                    shift = st.series[i].add(math.log(sq / n))
                    if shift is not None:
                        shifts.append((i, *shift))
            if shifts:
                self._shift(mpu, shifts)

    def _shift(self, mpu: Any, shifts: list[tuple[int, float, float]]) -> None:
        ratios = [(i, math.exp(d / 2), math.exp(thr / 2)) for i, d, thr in shifts]  # of the RMS
        what = ", ".join(f"output {i} RMS x{r:.3g} (threshold x{t:.3g})" for i, r, t in ratios)
        self._emit(
            Finding(
                SOURCE,
                Reason.OUTPUT_SHIFT,
                Severity.WARNING,
                f"{mpu.name}: {what} its baseline's prediction, {CONFIRM} steps in a row",
                {**self._labels(mpu), "output": str(ratios[0][0]), "rms_ratio": f"{ratios[0][1]:.4g}"},
            )
        )
        self._suspect(mpu.mpu_id, Reason.OUTPUT_SHIFT.value)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
