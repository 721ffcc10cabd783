"""The agent's per-job, per-MPU state, fed by the hook library's reports, and the MPU health score.

It takes the link's messages as `mscale.link` read them (`Register`, `StepReport`, `MpuReport`:
checked and typed once, on arrival), so nothing here reads a field by name or coerces it again.

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

The findings in a job's reports are counted per job (`JobState.findings`, so alerts on them
carry `job_id`), and the snapshot engine's among them kept as the job's snapshot figures
(`SnapshotStats`: failures, last success, write durations and sizes, recovery times).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mscale.daemon.gpus import GpuSample
from mscale.daemon.gpus import gpus_by_index as gpus_by_index  # (where tests and plugins found it)
from mscale.findings import Finding, Reason, Severity
from mscale.healing.fsm import Level
from mscale.link import MpuReport, Register, StepReport

BASELINE_SKIP = 3
MAX_FINDING_SERIES = 128  # distinct (source, reason, severity) counted per job: bounds its series
BASELINE_STEPS = 20
RECENT = 5
MAX_PLACEMENTS = 16  # GPUs remembered per MPU (registered, rebound, swapped to): the agent's view of where it ran
PHASES = ("forward", "backward")
# the step figures a rank and its job both show in their dicts (the job's are its ranks', aggregated)
FIGURES = ("connected", "step", "loss", "task_loss", "grad_norm", "reports_total", "reports_dropped")


def _clamp01(v: float) -> float:
    return 0.0 if v < 0 else 1.0 if v > 1 else v


def _num(v: object) -> float:
    """A number in a finding's label: a float, NaN for anything else."""
    if isinstance(v, bool) or v is None:
        return math.nan
    if isinstance(v, (int, float, str)):
        try:
            return float(v)
        except (ValueError, OverflowError):  # not a number, or an integer past a float's range
            return math.nan
    return math.nan


def sample_value(v: Any) -> float:
    """A metric sample: a float, NaN for anything float() refuses (a 400-digit integer, None),
    so that one job's odd value never fails a scrape."""
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return math.nan


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
    grad_norm: float = math.nan
    gvc: float = math.nan
    clip_ratio: float = 0.0
    distill_share: float = 0.0  # the L3 distillation term's share of the job's loss
    checksum_ok: bool = True
    checksum_consecutive_failures: int = 0
    checksum_failures_total: int = 0
    checksum_coverage_ratio: float = math.nan  # share of its checked layers the last step checked
    checksum_max_gap_steps: float = math.nan  # the largest gap between checks of any layer, steps
    checksum_replay_gap_steps: float = math.nan  # steps between replays of its forward (inf: none)
    recent_failures: deque[int] = field(default_factory=lambda: deque(maxlen=100))
    memory_used_bytes: float = math.nan
    memory_total_bytes: float = math.nan
    # the GPUs this MPU was registered, rebound or swapped to here, oldest first (MAX_PLACEMENTS):
    # the only GPUs a finding of the MPU may name (mscale.daemon.link), so the only ones its job
    # can have filed for remediation
    placements: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.place(self.gpu)

    def place(self, gpu: int) -> None:
        """Record that the MPU runs on `gpu` now (the latest placement last)."""
        if gpu < 0:
            return
        if gpu in self.placements:
            self.placements.remove(gpu)
        self.placements.append(gpu)
        del self.placements[:-MAX_PLACEMENTS]

    def update(self, r: MpuReport) -> None:
        self.latency["forward"].add(r.forward_s)
        self.latency["backward"].add(r.backward_s)
        self.grad_norm, self.gvc = r.grad_norm, r.gvc
        self.clip_ratio = r.clip_ratio if math.isfinite(r.clip_ratio) else self.clip_ratio
        self.distill_share = r.distill_share if math.isfinite(r.distill_share) else 0.0
        self.checksum_ok = r.checksum_ok
        self.checksum_coverage_ratio, self.checksum_max_gap_steps = r.checksum_coverage_ratio, r.checksum_max_gap_steps
        self.checksum_replay_gap_steps = r.checksum_replay_gap_steps
        self.checksum_consecutive_failures = r.checksum_consecutive_failures
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
        self.memory_used_bytes = math.nan if r.memory_used_bytes is None else r.memory_used_bytes
        self.memory_total_bytes = math.nan if r.memory_total_bytes is None else r.memory_total_bytes

    def score(self, gpu_sample: GpuSample | None = None) -> dict[str, float]:
        """Recompute the health per phase (see the module docstring) and return it."""
        checksum = min(60.0, 20.0 * self.checksum_consecutive_failures) + min(20.0, 2.0 * sum(self.recent_failures))
        used, total = self.memory_used_bytes, self.memory_total_bytes
        if gpu_sample is not None:
            g_used = _num(getattr(gpu_sample, "memory_used_bytes", None))
            g_total = _num(getattr(gpu_sample, "memory_total_bytes", None))
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


# Disk snapshot write durations: from a tiny model's milliseconds to a large one's minutes.
SNAPSHOT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class SnapshotStats:
    """A job's snapshot figures, from its snapshot engine's findings (source hook:snapshot)."""

    failures: int = 0  # writes that failed, snapshots refused on load
    last_success_time: float | None = None  # Unix time of the last disk snapshot written
    last_size_bytes: float | None = None
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(SNAPSHOT_BUCKETS_S))
    writes: int = 0
    seconds_total: float = 0.0
    recovery_seconds: dict[str, float] = field(default_factory=dict)  # tag (memory, disk) -> last

    def observe(self, f: Finding) -> None:
        labels = f.labels
        if f.reason is Reason.SNAPSHOT_WRITTEN:
            self.last_success_time = f.time
            size, seconds = _num(labels.get("bytes")), _num(labels.get("seconds"))
            if math.isfinite(size):
                self.last_size_bytes = size
            if math.isfinite(seconds) and seconds >= 0:
                self.writes += 1
                self.seconds_total += seconds
                for i, le in enumerate(SNAPSHOT_BUCKETS_S):
                    if seconds <= le:
                        self.bucket_counts[i] += 1
        elif f.reason is Reason.SNAPSHOT_FAILED or (
            f.reason is Reason.SNAPSHOT_REFUSED and f.severity is Severity.WARNING
        ):
            # (a CRITICAL refusal only sums up the refused ones before it: "none valid")
            self.failures += 1
        elif f.reason in (Reason.ROLLBACK, Reason.SNAPSHOT_RESUMED):
            seconds, tag = _num(labels.get("recovery_seconds")), labels.get("tag", "")
            # a failed rollback carries neither; tags are few (memory, disk): bound them anyway
            if tag and math.isfinite(seconds) and (tag[:32] in self.recovery_seconds or len(self.recovery_seconds) < 8):
                self.recovery_seconds[tag[:32]] = seconds


@dataclass
class RankState:
    """One rank of a job on this node: its process, its MPUs (each bound to this rank's GPU)
    and its step figures. A rank's MPU health is its own: rank 3's vision MPU runs on another
    GPU than rank 0's."""

    rank: int
    pid: int
    local_rank: int = 0
    world_size: int = 1
    mpus: dict[str, MpuState] = field(default_factory=dict)
    connected: bool = True
    last_report_at: float = 0.0
    step: int = -1
    loss: float = math.nan
    task_loss: float = math.nan
    grad_norm: float = math.nan
    reports_total: int = 0
    reports_dropped: int = 0  # dropped by the rank's bounded queue (agent slow or down)
    steps_skipped: int = 0
    guard_overhead_ratio: float = math.nan  # the guard's measured cost over its step time

    def register(self, msg: Register) -> None:
        """Apply a (re-)registration: MPUs added or rebound keep their history."""
        self.pid, self.local_rank, self.world_size = msg.pid, msg.local_rank, msg.world_size
        mpus = {}
        for d in msg.mpus:
            old = self.mpus.get(d.mpu_id)
            m = old or MpuState(mpu_id=d.mpu_id, name=d.name, gpu=d.gpu)
            if old is not None and old.gpu != d.gpu:
                m.gpu_uuid = ""
            m.name, m.gpu = d.name, d.gpu
            m.place(d.gpu)
            m.gpu_uuid = d.gpu_uuid or m.gpu_uuid
            m.device, m.path, m.params, m.fuse_level = d.device, d.path, d.params, d.fuse_level
            mpus[m.mpu_id] = m
        self.mpus = mpus

    def apply_report(self, r: StepReport, gpus: Mapping[int, GpuSample]) -> None:
        self.reports_total += 1
        self.last_report_at = time.time()
        self.step = max(self.step, r.step)
        self.loss, self.grad_norm = r.loss, r.grad_norm
        self.task_loss = r.loss if r.task_loss is None else r.task_loss  # a job that sends none: the one loss
        self.steps_skipped += 1 if r.skipped else 0
        self.guard_overhead_ratio = r.guard_overhead_ratio
        for mpu_id, mr in r.mpus.items():
            m = self.mpus.get(mpu_id)
            if m is not None:
                m.update(mr)
        self.refresh(gpus)

    def refresh(self, gpus: Mapping[int, GpuSample]) -> None:
        for m in self.mpus.values():
            sample = gpus.get(m.gpu)
            uuid = str(getattr(sample, "uuid", "") or "") if sample is not None else ""
            if uuid:  # the GPU probe's UUID of the GPU, over what the job registered
                m.gpu_uuid = uuid
            m.score(sample)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "pid": self.pid,
            **_figures(self),
            "steps_skipped": self.steps_skipped,
            "mpus": {k: m.to_dict() for k, m in sorted(self.mpus.items())},
        }


class RankLimit(Exception):
    """A new rank past the job's bound on ranks, none of them disconnected to make room."""


@dataclass
class JobState:
    """A job on this node: its ranks (`rank_states`, keyed by global rank), and the job-level
    figures aggregated on purpose from them: `step` the minimum over the live ranks (the job is
    as far as its slowest rank), `loss` and `grad_norm` as the lowest rank (rank 0 where it runs
    here) reports them (DDP averages the gradients, and rank 0's loss is what the training
    script logs), report counters summed. The findings and snapshot figures are per job."""

    job_id: str
    rank: int = 0  # the first registration's; `lead` is the rank the job figures come from now
    pid: int = 0
    rank_states: dict[int, RankState] = field(default_factory=dict)
    max_ranks: int = 4096  # rank_states bound (socket.max_ranks_per_job)
    connected: bool = True
    registered_at: float = field(default_factory=time.time)
    connects: int = 1
    findings: Counter[tuple[str, str, str]] = field(
        default_factory=Counter
    )  # (source, reason, severity) of reported findings
    snapshots: SnapshotStats = field(default_factory=SnapshotStats)
    # identity (mscale.daemon.link): the uid that registered the job first owns its id until the
    # job expires; the live ranks on this node and their processes; when the last one left
    uid: int | None = None
    ranks: dict[int, int] = field(default_factory=dict)  # live rank -> pid
    disconnected_at: float | None = None  # time.monotonic() when the last live rank left
    # Kubernetes: rank -> (namespace, pod) the rank reported from the downward API (mscale.kube.attribution)
    pods: dict[int, tuple[str, str]] = field(default_factory=dict)

    # --- ranks -------------------------------------------------------------------------------

    def rank_state(self, rank: int | None = None) -> RankState:
        """A rank's state (None: the lead rank); KeyError when the rank never registered."""
        if rank is None:
            return self.rank_states[self.lead]
        return self.rank_states[rank]

    @property
    def lead(self) -> int:
        """The rank the job-level loss comes from: the lowest live rank, else the lowest known."""
        live = [r for r in self.rank_states if r in self.ranks]
        return min(live or self.rank_states or [self.rank])

    def register(self, msg: Register) -> RankState:
        """Apply a (re-)registration of one rank. Past `max_ranks` ranks a disconnected rank's
        state makes room (the one gone longest); with none, RankLimit and nothing changes."""
        rank = msg.rank
        rs = self.rank_states.get(rank)
        if rs is None:
            if len(self.rank_states) >= self.max_ranks:
                gone = [(s.last_report_at, r) for r, s in self.rank_states.items() if r not in self.ranks]
                if not gone:
                    raise RankLimit(f"job {self.job_id} holds {len(self.rank_states)} ranks")
                del self.rank_states[min(gone)[1]]
            rs = self.rank_states[rank] = RankState(rank=rank, pid=msg.pid)
        rs.register(msg)
        rs.connected = True
        if msg.pod is not None:  # Kubernetes: the pod this rank runs in
            self.pods[rank] = (msg.pod.namespace, msg.pod.name)
        if len(self.rank_states) == 1:
            self.rank, self.pid = rank, msg.pid
        return rs

    def disconnect(self, rank: int) -> None:
        rs = self.rank_states.get(rank)
        if rs is not None:
            rs.connected = False

    def apply_report(self, r: StepReport, gpus: Mapping[int, GpuSample], rank: int | None = None) -> None:
        self.rank_state(rank).apply_report(r, gpus)

    def iter_mpus(self) -> Iterator[tuple[RankState, MpuState]]:
        """Every rank's MPUs, by rank."""
        for _, rs in sorted(self.rank_states.items()):
            for _, m in sorted(rs.mpus.items()):
                yield rs, m

    # --- job-level figures, aggregated on purpose --------------------------------------------

    @property
    def mpus(self) -> dict[str, MpuState]:
        """The lead rank's MPUs (a single-rank job's MPUs); `iter_mpus` for every rank's."""
        return self.rank_states[self.lead].mpus if self.rank_states else {}

    @property
    def step(self) -> int:
        live = [s.step for r, s in self.rank_states.items() if r in self.ranks]
        steps = live or [s.step for s in self.rank_states.values()]
        return min(steps) if steps else -1

    @property
    def loss(self) -> float:
        return self.rank_states[self.lead].loss if self.rank_states else math.nan

    @property
    def task_loss(self) -> float:
        return self.rank_states[self.lead].task_loss if self.rank_states else math.nan

    @property
    def grad_norm(self) -> float:
        return self.rank_states[self.lead].grad_norm if self.rank_states else math.nan

    @property
    def reports_total(self) -> int:
        return sum(s.reports_total for s in self.rank_states.values())

    @property
    def reports_dropped(self) -> int:
        return sum(s.reports_dropped for s in self.rank_states.values())

    @property
    def steps_skipped(self) -> int:
        """Steps skipped, as the rank that skipped most counts them (with agreed decisions
        every rank skips the same steps)."""
        return max((s.steps_skipped for s in self.rank_states.values()), default=0)

    @property
    def pids(self) -> list[int]:
        """The processes of the job's live ranks here (the probes trace and measure each)."""
        return sorted({pid for pid in self.ranks.values() if pid > 0})

    @property
    def last_report_at(self) -> float:
        return max((s.last_report_at for s in self.rank_states.values()), default=0.0)

    def observe_finding(self, f: Finding) -> bool:
        """Count a finding the job reported (source hook:<detector>); False (and not counted)
        when it would be a new series past MAX_FINDING_SERIES."""
        key = (f.source, f.reason.value, f.severity.value)
        if key not in self.findings and len(self.findings) >= MAX_FINDING_SERIES:
            return False
        self.findings[key] += 1
        if f.source == "hook:snapshot":
            self.snapshots.observe(f)
        return True

    def refresh(self, gpus: Mapping[int, GpuSample]) -> None:
        for rs in self.rank_states.values():
            rs.refresh(gpus)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            **_figures(self),
            "ranks": {str(r): s.to_dict() for r, s in sorted(self.rank_states.items())},
        }


def _figures(state: RankState | JobState) -> dict[str, Any]:
    return {name: getattr(state, name) for name in FIGURES}
