"""One MPU of a rank as the agent holds it (`MpuState`), and its health score.

Health score (0-100, per MPU and phase, forward or backward), recomputed on every report
and every scrape:

    score = max(0, 100 - latency - checksum - memory - gpu)

    latency  = 40 * clamp((r - 1.1) / (3 - 1.1), 0, 1)   r = median of the last 5 latencies of
               the phase / the MPU's own baseline (median of its first 20 measured steps after
               the first 3, warm-up excluded); 0 until the baseline exists
    checksum = min(60, 20 * consecutive failures) + min(20, 2 * failures in the last 100 reports)
    memory   = 15 * clamp((used/total - 0.85) / 0.15, 0, 1), of the GPU the MPU is bound to
               (the agent's GPU snapshot, else the job's own report)
    gpu      = 0 healthy, 25 degraded, 100 failed (the bound GPU's health in state.snapshots["gpu"])

So one checksum failure costs 22 points, the three in a row that trigger an L1 swap 66
(score 34, below the 60 that means "act"), a 3x slowdown 40, a failed GPU all 100.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mscale.daemon.gpus import GpuSample
from mscale.healing.fsm import Level
from mscale.link import MpuReport

BASELINE_SKIP = 3
BASELINE_STEPS = 20
RECENT = 5
MAX_PLACEMENTS = 16  # GPUs remembered per MPU (registered, rebound, swapped to): the agent's view of where it ran
PHASES = ("forward", "backward")


def label_number(v: object) -> float:
    """A number in a finding's label: a float, NaN for anything else."""
    if isinstance(v, bool) or v is None:
        return math.nan
    if isinstance(v, (int, float, str)):
        try:
            return float(v)
        except (ValueError, OverflowError):  # not a number, or an integer past a float's range
            return math.nan
    return math.nan


def _clamp01(v: float) -> float:
    return 0.0 if v < 0 else 1.0 if v > 1 else v


@dataclass
class Latency:
    """One phase's latency history: the MPU's own baseline and its recent samples."""

    seen: int = 0
    baseline_samples: list[float] = field(default_factory=list)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    last_s: float = 0.0

    def add(self, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self.seen += 1
        self.last_s = seconds
        self.recent.append(seconds)
        if self.seen > BASELINE_SKIP and len(self.baseline_samples) < BASELINE_STEPS:
            self.baseline_samples.append(seconds)

    @property
    def baseline_s(self) -> float | None:
        if len(self.baseline_samples) < BASELINE_STEPS:
            return None
        return statistics.median(self.baseline_samples)

    def ratio(self) -> float | None:
        base = self.baseline_s
        if base is None or not self.recent or base <= 0:
            return None
        return statistics.median(self.recent) / base


@dataclass
class MpuState:
    """One MPU of a rank as the agent holds it: what the job registered, the last report it
    sent (`report`, as the link read it, held whole), and what the agent keeps across reports
    (latency baselines, the failures counted, the placements, the health score)."""

    mpu_id: str
    name: str
    gpu: int
    gpu_uuid: str = ""
    device: str = ""
    path: str = ""
    params: int = 0
    fuse_level: str = Level.HEALTHY.value  # as the job reports it (mscale.healing.fsm.Level)
    health_score: float = 100.0  # the lower of the two phases
    health: dict[str, float] = field(default_factory=lambda: {p: 100.0 for p in PHASES})
    latency: dict[str, Latency] = field(default_factory=lambda: {p: Latency() for p in PHASES})
    report: MpuReport = field(default_factory=MpuReport)  # the last report (none yet: the defaults)
    clip_ratio: float = 0.0  # the last finite one reported
    checksum_failures_total: int = 0
    recent_failures: deque[int] = field(default_factory=lambda: deque(maxlen=100))
    # the GPUs this MPU was registered, rebound or swapped to here, oldest first (MAX_PLACEMENTS):
    # the only GPUs a finding of the MPU may name (mscale.daemon.link), so the only ones its job
    # can have filed for remediation
    placements: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.place(self.gpu)

    # the last report's figures, as the exporters and the API read them
    @property
    def grad_norm(self) -> float:
        return self.report.grad_norm

    @property
    def gvc(self) -> float:
        return self.report.gvc

    @property
    def distill_share(self) -> float:
        """The L3 distillation term's share of the job's loss (0 when none or not finite)."""
        return self.report.distill_share if math.isfinite(self.report.distill_share) else 0.0

    @property
    def checksum_ok(self) -> bool:
        return self.report.checksum_ok

    @property
    def checksum_consecutive_failures(self) -> int:
        return self.report.checksum_consecutive_failures

    @property
    def checksum_coverage_ratio(self) -> float:
        """Share of its checked layers the last step checked."""
        return self.report.checksum_coverage_ratio

    @property
    def checksum_max_gap_steps(self) -> float:
        """The largest gap between checks of any layer, steps."""
        return self.report.checksum_max_gap_steps

    @property
    def checksum_replay_gap_steps(self) -> float:
        """Steps between replays of its forward (inf: none)."""
        return self.report.checksum_replay_gap_steps

    @property
    def memory_used_bytes(self) -> float:
        return math.nan if self.report.memory_used_bytes is None else self.report.memory_used_bytes

    @property
    def memory_total_bytes(self) -> float:
        return math.nan if self.report.memory_total_bytes is None else self.report.memory_total_bytes

    def place(self, gpu: int) -> None:
        """Record that the MPU runs on `gpu` now (the latest placement last)."""
        if gpu < 0:
            return
        if gpu in self.placements:
            self.placements.remove(gpu)
        self.placements.append(gpu)
        del self.placements[:-MAX_PLACEMENTS]

    def update(self, r: MpuReport) -> None:
        """Take a report: held whole; what lasts across reports is kept here."""
        self.report = r
        self.latency["forward"].add(r.forward_s)
        self.latency["backward"].add(r.backward_s)
        self.clip_ratio = r.clip_ratio if math.isfinite(r.clip_ratio) else self.clip_ratio
        total = self.checksum_failures_total if r.checksum_failures_total is None else r.checksum_failures_total
        self.recent_failures.append(max(0, total - self.checksum_failures_total))
        self.checksum_failures_total = max(total, self.checksum_failures_total)
        if r.gpu is not None:
            if r.gpu != self.gpu:
                self.gpu_uuid = ""  # rebound: the UUID comes from the agent's snapshot again
            self.gpu = r.gpu
            self.place(r.gpu)
        if r.fuse_level is not None:
            self.fuse_level = r.fuse_level

    def score(self, gpu_sample: GpuSample | None = None) -> dict[str, float]:
        """Recompute the health per phase (see the module docstring) and return it."""
        checksum = min(60.0, 20.0 * self.checksum_consecutive_failures) + min(20.0, 2.0 * sum(self.recent_failures))
        used, total = self.memory_used_bytes, self.memory_total_bytes
        if gpu_sample is not None:
            g_used = label_number(getattr(gpu_sample, "memory_used_bytes", None))
            g_total = label_number(getattr(gpu_sample, "memory_total_bytes", None))
            if math.isfinite(g_used) and math.isfinite(g_total):
                used, total = g_used, g_total
        memory = 15.0 * _clamp01((used / total - 0.85) / 0.15) if math.isfinite(used) and total and total > 0 else 0.0
        health = getattr(gpu_sample, "health", "healthy") if gpu_sample is not None else "healthy"
        gpu = {"healthy": 0.0, "degraded": 25.0, "failed": 100.0}.get(health, 0.0)
        for phase in PHASES:
            ratio = self.latency[phase].ratio()
            latency = 40.0 * _clamp01((ratio - 1.1) / (3.0 - 1.1)) if ratio is not None else 0.0
            self.health[phase] = max(0.0, 100.0 - latency - checksum - memory - gpu)
        self.health_score = min(self.health.values())
        return dict(self.health)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mpu_id": self.mpu_id,
            "name": self.name,
            "gpu": self.gpu,
            "gpu_uuid": self.gpu_uuid,
            "device": self.device,
            "fuse_level": self.fuse_level,
            "health_score": self.health_score,
            "health": dict(self.health),
            "forward_s": self.latency["forward"].last_s,
            "backward_s": self.latency["backward"].last_s,
            "forward_baseline_s": self.latency["forward"].baseline_s,
            "backward_baseline_s": self.latency["backward"].baseline_s,
            "grad_norm": self.grad_norm,
            "clip_ratio": self.clip_ratio,
            "distill_share": self.distill_share,
            "checksum_consecutive_failures": self.checksum_consecutive_failures,
            "checksum_failures_total": self.checksum_failures_total,
        }
