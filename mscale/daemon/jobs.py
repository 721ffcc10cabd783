"""The agent's per-job, per-MPU state, fed by the hook library's reports, and the MPU health score.

It takes the link's messages as `mscale.link` read them (`Register`, `StepReport`, `MpuReport`:
checked and typed once, on arrival), so nothing here reads a field by name or coerces it again.

Each MPU's state and health score: mscale.daemon.mpu_state.

The findings in a job's reports are counted per job (`JobState.findings`, so alerts on them
carry `job_id`), and the snapshot engine's among them kept as the job's snapshot figures
(`SnapshotStats`: failures, last success, write durations and sizes, recovery times).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mscale.daemon.gpus import GpuSample
from mscale.daemon.gpus import gpus_by_index as gpus_by_index  # (where tests and plugins found it)
from mscale.daemon.mpu_state import MpuState, label_number
from mscale.findings import Finding, Reason, Severity
from mscale.link import Register, StepReport

MAX_FINDING_SERIES = 128  # distinct (source, reason, severity) counted per job: bounds its series
# the step figures a rank and its job both show in their dicts (the job's are its ranks', aggregated)
FIGURES = ("connected", "step", "loss", "task_loss", "grad_norm", "reports_total", "reports_dropped")


def sample_value(v: Any) -> float:
    """A metric sample: a float, NaN for anything float() refuses (a 400-digit integer, None),
    so that one job's odd value never fails a scrape."""
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return math.nan


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
    tiers: dict[str, tuple[float, float, float]] = field(
        default_factory=dict
    )  # node, disk -> newest (step, time, bytes)

    def observe(self, f: Finding) -> None:
        labels = f.labels
        tier = labels.get("tier", "disk")[:32]
        if f.reason is Reason.SNAPSHOT_WRITTEN and (tier in self.tiers or len(self.tiers) < 8):
            step, size = label_number(labels.get("step")), label_number(labels.get("bytes"))
            if math.isfinite(step) and math.isfinite(size) and step >= self.tiers.get(tier, (-1.0, 0.0, 0.0))[0]:
                self.tiers[tier] = (step, f.time, size)  # written and hashed: verified at capture
        if f.reason is Reason.SNAPSHOT_WRITTEN and tier != "disk":
            return  # the other tiers' writes: tiers only (the figures below are the disk's)
        if f.reason is Reason.SNAPSHOT_WRITTEN:
            self.last_success_time = f.time
            size, seconds = label_number(labels.get("bytes")), label_number(labels.get("seconds"))
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
            seconds, tag = label_number(labels.get("recovery_seconds")), labels.get("tag", "")
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

    def apply_report(self, r: StepReport, gpus: Mapping[int, GpuSample], *, score: bool = True) -> None:
        """Apply one step's report; `score` False leaves the health scores to the message's last
        step (mscale.daemon.link: nothing reads them in between, and scoring every step of a
        batched message cost most of its handling)."""
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
        if score:
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
