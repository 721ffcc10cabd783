"""One process the eBPF probe traces: its uprobe links, its counts carried across duty windows
(extrapolated by period/window), and the verdicts on it (hang, sync stall, allocation
failures), each change of which is a finding. `Traced.update` turns one read of the BPF maps
into the immutable `CudaProcess` the probe's snapshot publishes.

The probe (ebpf.py) owns the attaching and the schedule; the judgement over time is
ebpf_detect.py's; this module joins the two per process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from mscale.findings import Reason, Severity
from mscale.probes.ebpf_detect import BlockedShare, LaunchWatch
from mscale.probes.ebpf_loader import DIRECTIONS, HIST_SLOTS, RUNTIME, Link, PidCounters, Role

if TYPE_CHECKING:
    from mscale.probes.ebpf_loader import InflightSync

__all__ = ["HangCause", "CudaProcess", "Limits", "Traced"]

ZERO = PidCounters(0, 0, 0, (0,) * len(DIRECTIONS), (0,) * len(DIRECTIONS), 0, 0, 0, 0, 0, 0, (0,) * HIST_SLOTS)

# reason, severity, message, labels: the probe makes it a Finding
Emit = Callable[[Reason, Severity, str, dict[str, str]], None]


class HangCause(StrEnum):
    """Why a process counts as hung: the `cause` label of a training_hang finding."""

    SYNC_BLOCKED = "sync_blocked"  # a synchronising call (stream, device, event) blocked too long
    NO_LAUNCH = "no_launch"  # no kernel launched for too long while the process was observed


@dataclass(frozen=True)
class CudaProcess:
    pid: int
    job_id: str  # "" for a process traced by cmdline_pattern only
    library: str
    launches: float  # extrapolated by period/window; exact when always on
    launches_observed: int
    graph_launches: float
    graph_launches_observed: int
    memcpy_bytes: tuple[tuple[str, float], ...]  # (direction, bytes), extrapolated
    memcpy_bytes_observed: tuple[tuple[str, int], ...]
    sync_calls: int
    sync_seconds_sum: float
    sync_hist: tuple[int, ...]  # sync_hist[s]: calls that took [2^(s-1), 2^s) ns
    sync_inflight_s: float  # longest synchronise call in flight now (0: none)
    sync_blocked_ratio: float | None  # over sync_stall_window_s; None until a window is seen
    alloc_failures: int
    hang: bool
    hang_cause: str  # a HangCause, or "" while not hung
    launch_quiet_s: float | None  # since the last launch seen; None: never seen one
    sync_stall: bool
    error: str = ""  # a probe that could not attach (the others still count)
    runtime_library: str = ""  # the libcudart attached too ("": none mapped, driver only)


class Limits(Protocol):
    """The thresholds of [probes.ebpf] a verdict reads."""

    @property
    def hang_timeout_s(self) -> float: ...
    @property
    def sync_stall_ratio(self) -> float: ...
    @property
    def sync_stall_window_s(self) -> float: ...


@dataclass
class Traced:
    pid: int
    job_id: str
    start_time: int  # /proc/PID/stat starttime: a reused pid is another process
    library: str
    offsets: dict[str, list[int]]
    watch: LaunchWatch
    share: BlockedShare
    rare: list[Link] = field(default_factory=list)
    high: list[Link] = field(default_factory=list)
    last: PidCounters = ZERO
    launches: float = 0.0
    graph_launches: float = 0.0
    copy_bytes: list[float] = field(default_factory=lambda: [0.0] * len(DIRECTIONS))
    hang_cause: str = ""
    stall: bool = False
    error: str = ""
    runtime: str = ""  # libcudart, once mapped and attached
    rt_offsets: dict[str, list[int]] = field(default_factory=dict)
    runtime_seen: str = ""  # the libcudart last tried (not retried on every sample)

    def targets(self, role: Role) -> tuple[str, list[int]]:
        """(library path, offsets) of a role in this process; no offsets: not attached."""
        if role.library == RUNTIME:
            return self.runtime, self.rt_offsets.get(role.prog, []) if self.runtime else []
        return self.library, self.offsets.get(role.prog, [])

    @property
    def labels(self) -> dict[str, str]:
        return {"pid": str(self.pid), "job_id": self.job_id}

    def update(
        self,
        c: PidCounters | None,
        inflight: Sequence[InflightSync],
        now: float,
        *,
        scale: float,
        limits: Limits,
        emit: Emit,
    ) -> CudaProcess:
        """One read of the maps (None: this process has no entry yet): counts carried on,
        verdicts judged, each change emitted; returns what the snapshot publishes."""
        c = c or self.last
        prev, self.last = self.last, c
        self._count(prev, c, scale)
        blocked = [max(0.0, now - e.entered_ns / 1e9) for e in inflight]
        longest = max(blocked, default=0.0)
        self.share.add(now, c.sync_ns / 1e9 + sum(blocked))
        ratio = self.share.ratio()
        self._judge_hang(longest, inflight, now, limits, emit)
        self._judge_stall(ratio, limits, emit)
        self._judge_alloc(prev, c, emit)
        return self._published(c, longest, ratio, now)

    def _count(self, prev: PidCounters, c: PidCounters, scale: float) -> None:
        self.launches += (c.launches - prev.launches) * scale
        self.graph_launches += (c.graph_launches - prev.graph_launches) * scale
        for i in range(len(DIRECTIONS)):
            self.copy_bytes[i] += (c.copy_bytes[i] - prev.copy_bytes[i]) * scale
        if (c.launches, c.graph_launches) != (prev.launches, prev.graph_launches) and c.last_launch_ns:
            self.watch.launched(c.last_launch_ns / 1e9)

    def _judge_hang(
        self, longest: float, inflight: Sequence[InflightSync], now: float, limits: Limits, emit: Emit
    ) -> None:
        timeout = limits.hang_timeout_s
        cause = ""
        if longest > timeout:
            cause = HangCause.SYNC_BLOCKED
        elif self.watch.hung(now):
            cause = HangCause.NO_LAUNCH
        if cause and not self.hang_cause:
            if cause == HangCause.SYNC_BLOCKED:
                kinds = sorted({e.kind for e in inflight})
                msg = f"process {self.pid} blocked in {', '.join(kinds)} for {longest:.1f}s (> {timeout:g}s)"
            else:
                msg = (
                    f"process {self.pid} launched no kernel for {self.watch.quiet_s(now):.1f}s "
                    f"(> {timeout:g}s, {self.watch.evidence_s(now):.1f}s of it observed)"
                )
            emit(Reason.TRAINING_HANG, Severity.CRITICAL, msg, {**self.labels, "cause": cause})
        elif self.hang_cause and not cause:
            emit(
                Reason.TRAINING_HANG_CLEARED,
                Severity.INFO,
                f"process {self.pid} is launching kernels again",
                {**self.labels, "cause": self.hang_cause},
            )
        self.hang_cause = cause

    def _judge_stall(self, ratio: float | None, limits: Limits, emit: Emit) -> None:
        if ratio is None or (ratio > limits.sync_stall_ratio) == self.stall:
            return
        self.stall = not self.stall
        said = (
            f"process {self.pid} blocked in synchronise calls {ratio:.0%} of the last {limits.sync_stall_window_s:g}s"
        )
        if self.stall:
            emit(Reason.SYNC_STALL, Severity.WARNING, f"{said} (> {limits.sync_stall_ratio:.0%})", self.labels)
        else:
            emit(Reason.SYNC_STALL_CLEARED, Severity.INFO, said, self.labels)

    def _judge_alloc(self, prev: PidCounters, c: PidCounters, emit: Emit) -> None:
        failed = c.alloc_failures - prev.alloc_failures
        if failed > 0:
            emit(
                Reason.CUDA_ALLOC_FAILURE,
                Severity.WARNING,
                f"process {self.pid}: {failed} cuMemAlloc call(s) failed, the latest for "
                f"{c.last_alloc_fail_bytes} bytes with CUresult {c.last_alloc_error}",
                {**self.labels, "bytes": str(c.last_alloc_fail_bytes), "cuda_error": str(c.last_alloc_error)},
            )

    def _published(self, c: PidCounters, longest: float, ratio: float | None, now: float) -> CudaProcess:
        return CudaProcess(
            pid=self.pid,
            job_id=self.job_id,
            library=self.library,
            launches=self.launches,
            launches_observed=c.launches,
            graph_launches=self.graph_launches,
            graph_launches_observed=c.graph_launches,
            memcpy_bytes=tuple(zip(DIRECTIONS, self.copy_bytes, strict=True)),
            memcpy_bytes_observed=tuple(zip(DIRECTIONS, c.copy_bytes, strict=True)),
            sync_calls=c.sync_calls,
            sync_seconds_sum=c.sync_ns / 1e9,
            sync_hist=c.sync_hist,
            sync_inflight_s=longest,
            sync_blocked_ratio=ratio,
            alloc_failures=c.alloc_failures,
            hang=bool(self.hang_cause),
            hang_cause=self.hang_cause,
            launch_quiet_s=self.watch.quiet_s(now),
            sync_stall=self.stall,
            error=self.error,
            runtime_library=self.runtime,
        )
