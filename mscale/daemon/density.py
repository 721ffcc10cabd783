"""The compute-density and thermal guard: is each MPU as dense as its contract's profile says?

Every `contract.density_interval_s` (10 s) the agent compares each MPU's compute density
(achieved TFLOP/s per GB of its memory, from the job's MSRP reports) with its contract's
compute profile (mscale/contracts/profiles.yaml). A relative deviation above
`contract.density_deviation` (15%) that lasts `contract.density_window_s` (every evaluation
in the window above it) is a recommendation: the catalogue profile nearest (in log scale) to
the measured density, "up" when that profile is denser than the contract's, "down" when not.
No scale-up is recommended while the MPU's GPU is at or above `contract.thermal_limit_c`
(70 C, from the GPU probe's latest sample): the recommendation is "hold" and says why.

Each new recommendation (or a change of it) is a `density_deviation` finding (warning) with
the recommended profile in its labels, for the event API, the metrics and the alert
MscaleMpuDensityDeviation; the scheduler acts on it (none is built here). A deviation that
ends clears the recommendation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mscale.contracts.spec import profiles
from mscale.findings import Finding, Reason, Severity


@dataclass(frozen=True)
class MpuDensity:
    """One MPU's latest comparison (immutable; published beside the contracts)."""

    job_id: str
    rank: int
    mpu_id: str
    gpu: int | None
    profile: str
    expected: float  # TFLOP/s per GB the profile expects
    density: float  # measured
    deviation: float  # (density - expected) / expected
    since: float | None  # when the current deviation began (None: within tolerance)
    recommended: str = ""  # "" until a deviation is sustained
    direction: str = ""  # up, down, hold
    temperature_c: float | None = None


def nearest_profile(density: float) -> str:
    """The catalogue profile whose density is nearest to `density` in log scale."""
    cat = profiles()
    return min(cat, key=lambda n: (abs(math.log(cat[n].density_tflops_per_gb) - math.log(density)), n))


def _density(mpu: dict[str, Any]) -> float | None:
    flops, memory = mpu.get("achieved_flops"), mpu.get("memory_bytes")
    if not isinstance(flops, (int, float)) or not isinstance(memory, (int, float)) or memory <= 0 or flops <= 0:
        return None
    return (flops / 1e12) / (memory / 1e9)


class DensityGuard:
    def __init__(self, config: Any, emit: Any) -> None:
        self.config, self.emit = config, emit
        self.latest: dict[tuple[str, int, str], MpuDensity] = {}
        self.findings_total = 0

    def evaluate(self, records: Any, jobs: dict[str, Any], gpus: dict[int, Any], now: float) -> tuple[MpuDensity, ...]:
        cfg = self.config
        seen = set()
        for r in records:
            profile = profiles().get(str(r.plan.get("compute_profile", "")))
            if profile is None or not r.msrp:
                continue
            job = jobs.get(r.job_id)
            for mpu_id, m in sorted(r.msrp.get("mpus", {}).items()):
                d = _density(m)
                if d is None:
                    continue
                key = (r.job_id, r.rank, mpu_id)
                seen.add(key)
                old = self.latest.get(key)
                expected = profile.density_tflops_per_gb
                deviation = (d - expected) / expected
                gpu = getattr(getattr(job, "mpus", {}).get(mpu_id), "gpu", None)
                temp = getattr(gpus.get(gpu), "temperature_c", None) if gpu is not None else None
                if abs(deviation) <= cfg.density_deviation:
                    self.latest[key] = MpuDensity(
                        r.job_id, r.rank, mpu_id, gpu, profile.name, expected, d, deviation, None, temperature_c=temp
                    )
                    continue
                since = old.since if old is not None and old.since is not None else now
                rec = direction = ""
                if now - since >= cfg.density_window_s:
                    rec = nearest_profile(d)
                    direction = "up" if profiles()[rec].density_tflops_per_gb > expected else "down"
                    if rec == profile.name:  # the nearest is the contract's own: say which way it leans
                        direction = "up" if deviation > 0 else "down"
                    if direction == "up" and temp is not None and temp >= cfg.thermal_limit_c:
                        direction = "hold"
                new = MpuDensity(
                    r.job_id, r.rank, mpu_id, gpu, profile.name, expected, d, deviation, since, rec, direction, temp
                )
                self.latest[key] = new
                if rec and (old is None or (old.recommended, old.direction) != (rec, direction)):
                    self._finding(new)
        for key in [k for k in self.latest if k not in seen]:
            del self.latest[key]
        return tuple(self.latest.values())

    def _finding(self, m: MpuDensity) -> None:
        self.findings_total += 1
        where = f"MPU {m.mpu_id} of job {m.job_id}" + (f" on GPU {m.gpu}" if m.gpu is not None else "")
        what = (
            f"{where}: compute density {m.density:.4g} TFLOP/s per GB, {abs(m.deviation):.0%} "
            f"{'above' if m.deviation > 0 else 'below'} its profile {m.profile} ({m.expected:g}) "
            f"for {self.config.density_window_s:g} s"
        )
        if m.direction == "hold":
            what += (
                f"; no scale-up while its GPU is at {m.temperature_c:g} C "
                f"(contract.thermal_limit_c {self.config.thermal_limit_c:g}); would recommend {m.recommended}"
            )
        else:
            what += f"; recommended profile {m.recommended} (scale {m.direction})"
        labels = {
            "job_id": m.job_id,
            "rank": str(m.rank),
            "mpu_id": m.mpu_id,
            "profile": m.profile,
            "recommended": m.recommended,
            "direction": m.direction,
        }
        if m.gpu is not None:
            labels["gpu"] = str(m.gpu)
        self.emit(Finding("density", Reason.DENSITY_DEVIATION, Severity.WARNING, what, labels))
