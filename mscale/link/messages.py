"""The job's messages to the agent and the agent's answers, one dataclass each.

Every message has `to_wire()` (the JSON object it is on the socket) and `from_wire(msg)`, which
checks each field as it reads it and returns the message typed (BadMessage, with the refusal's
`why`, on the first field at fault). The step report is spelled out here and only here: the
guard builds a `StepReport`, the agent reads one back and its job state takes it as it is.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mscale.findings import Finding
from mscale.link.wire import (
    FUSE_LEVEL,
    GPU_UUID,
    JOB_ID,
    MAX_FINDINGS,
    MAX_GPU_INDEX,
    MAX_INT,
    MAX_MPUS,
    MAX_PID,
    MAX_RANK,
    MAX_REPORTS,
    MPU_ID,
    BadMessage,
    Msg,
    Wire,
    finding,
    is_int,
    is_num,
    is_text,
    need,
    no_unknown,
    number,
    obj,
    read_amount,
    read_bool,
    read_int,
    read_num,
    read_opt_int,
    read_text,
)

TIME_CAUSES = ("productive", "startup", "snapshot", "rerun", "checks", "degraded", "data_wait", "hang")  # hook.goodput
# the budget's (mscale.hook.checks.coverage)
CHECK_FIGURES = ("checksum_coverage_ratio", "checksum_max_gap_steps", "checksum_replay_gap_steps")
# the fields each message may carry (the job's client sends exactly these): its dataclass's
# fields, named once there (REGISTER_FIELDS and the others are derived after the classes)

# Kubernetes: a training pod's downward API sets these (deploy/kubernetes/examples/training-pod.yaml)
POD_NAME_ENV, POD_NAMESPACE_ENV = "POD_NAME", "POD_NAMESPACE"
POD_FIELDS = frozenset({"name", "namespace"})
POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS label


def _drop_none(d: dict[str, Any]) -> Wire:
    return {k: v for k, v in d.items() if v is not None}


# --- register ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pod:
    """The Kubernetes pod a rank runs in (from the downward API)."""

    name: str
    namespace: str

    def to_wire(self) -> Wire:
        return {"name": self.name, "namespace": self.namespace}

    @classmethod
    def from_wire(cls, v: object) -> Pod:
        pod = obj(v, "register: pod must be an object {name, namespace}")
        no_unknown(pod, POD_FIELDS, "register: pod")
        name = read_text(pod, "name", "register: pod.name must be a Kubernetes pod name", 1, 253, POD_NAME)
        ns = read_text(pod, "namespace", "register: pod.namespace must be a namespace name", 1, 63, NAMESPACE)
        return cls(name, ns)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Pod | None:
        """The job's pod from the downward API's variables; None off Kubernetes (or if malformed)."""
        env = os.environ if env is None else env
        name, ns = env.get(POD_NAME_ENV, ""), env.get(POD_NAMESPACE_ENV, "")
        return cls(name, ns) if POD_NAME.fullmatch(name) and NAMESPACE.fullmatch(ns) else None


pod_from_env = Pod.from_env


@dataclass(frozen=True, slots=True)
class MpuInfo:
    """One MPU as a job registers it."""

    mpu_id: str
    name: str
    gpu: int
    path: str = ""
    device: str = ""
    gpu_uuid: str = ""
    fuse_level: str = "healthy"
    params: int = 0

    def to_wire(self) -> Wire:  # in this order on the wire (the fields' order puts gpu, which has no default, first)
        return {
            "mpu_id": self.mpu_id,
            "name": self.name,
            "path": self.path,
            "device": self.device,
            "gpu": self.gpu,
            "gpu_uuid": self.gpu_uuid,
            "fuse_level": self.fuse_level,
            "params": self.params,
        }

    @classmethod
    def from_wire(cls, v: object, where: str) -> MpuInfo:
        m = obj(v, f"{where} must be an object")
        no_unknown(m, MPU_FIELDS, where)
        return cls(
            mpu_id=read_text(m, "mpu_id", f"{where}.mpu_id must be 1-16 of [A-Za-z0-9._-]", 1, 16, MPU_ID, default=""),
            name=read_text(m, "name", f"{where}.name must be 1-64 printable characters", 1, 64, default=""),
            gpu=read_int(m, "gpu", f"{where}.gpu must be a GPU index", 0, MAX_GPU_INDEX - 1, default=-1),
            gpu_uuid=read_text(m, "gpu_uuid", f"{where}.gpu_uuid must be up to 96 of [A-Za-z0-9-]", 0, 96, GPU_UUID),
            path=read_text(m, "path", f"{where}.path must be up to 256 printable characters", 0, 256),
            device=read_text(m, "device", f"{where}.device must be up to 64 printable characters", 0, 64),
            fuse_level=read_text(
                m, "fuse_level", f"{where}.fuse_level must be 1-32 of [a-z0-9_]", 1, 32, FUSE_LEVEL, default="healthy"
            ),
            params=read_int(m, "params", f"{where}.params must be an integer in 0..{MAX_INT}"),
        )


@dataclass(frozen=True, slots=True)
class Register:
    """A rank's registration: first, and again on a rebind (its MPUs moved)."""

    job_id: str
    rank: int
    pid: int
    step: int = 0
    mpus: tuple[MpuInfo, ...] = ()
    local_rank: int = 0
    world_size: int = 1
    pod: Pod | None = None

    def to_wire(self) -> Wire:
        msg: Wire = {
            "type": Msg.REGISTER.value,
            "job_id": self.job_id,
            "rank": self.rank,
            "pid": self.pid,
            "step": self.step,
            "mpus": [m.to_wire() for m in self.mpus],
            "local_rank": self.local_rank,
            "world_size": self.world_size,
        }
        return msg if self.pod is None else {**msg, "pod": self.pod.to_wire()}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], max_mpus: int = MAX_MPUS) -> Register:
        """Every field of its type and range, no other fields, 1..max_mpus MPUs (more: why
        "mpu_limit")."""
        no_unknown(msg, REGISTER_FIELDS, "register")
        job_id = msg.get("job_id")
        need(
            isinstance(job_id, str) and bool(JOB_ID.fullmatch(job_id)),
            "register: job_id must be 1-128 characters of [A-Za-z0-9._:@/+-]",
        )
        rank = read_int(msg, "rank", f"register: rank must be an integer in 0..{MAX_RANK}", 0, MAX_RANK, default=-1)
        local_rank = read_int(
            msg, "local_rank", f"register: local_rank must be an integer in 0..{MAX_RANK}", 0, MAX_RANK
        )
        world_size = msg.get("world_size", 1)
        need(
            "world_size" not in msg or (is_int(world_size, 1, MAX_RANK + 1) and rank < world_size),
            f"register: world_size must be an integer in 1..{MAX_RANK + 1}, above rank",
        )
        pid = read_int(msg, "pid", f"register: pid must be an integer in 1..{MAX_PID}", 1, MAX_PID, default=-1)
        step = read_int(msg, "step", f"register: step must be an integer in -1..{MAX_INT}", -1, MAX_INT)
        raw = msg.get("mpus")
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_MPUS:
            raise BadMessage("malformed", f"register: mpus must be a list of 1 to {MAX_MPUS} MPUs")
        if len(raw) > max_mpus:
            raise BadMessage("mpu_limit", f"register: {len(raw)} MPUs, over socket.max_mpus_per_job ({max_mpus})")
        mpus: list[MpuInfo] = []
        for i, m in enumerate(raw):
            info = MpuInfo.from_wire(m, f"register: mpus[{i}]")
            need(all(o.mpu_id != info.mpu_id for o in mpus), f"register: mpus[{i}].mpu_id {info.mpu_id!r} repeated")
            mpus.append(info)
        pod = Pod.from_wire(msg["pod"]) if "pod" in msg else None
        return cls(str(job_id), rank, pid, step, tuple(mpus), local_rank, int(world_size), pod)


# --- step reports --------------------------------------------------------------------------------


@dataclass(slots=True)
class MpuReport:
    """One MPU's figures in a step report. None: the job did not say (the agent keeps what it had)."""

    # in the order they go on the wire
    forward_s: float = math.nan
    backward_s: float = math.nan
    grad_norm: float = math.nan
    gvc: float = math.nan
    checksum_ok: bool = True
    checksum_consecutive_failures: int = 0
    checksum_failures_total: int | None = None
    checksum_coverage_ratio: float = math.nan  # share of its checked layers the step checked
    checksum_max_gap_steps: float = math.nan  # the largest gap between checks of any layer
    checksum_replay_gap_steps: float = math.nan  # steps between replays of its forward (inf: none)
    clip_ratio: float = math.nan
    distill_share: float = 0.0  # the fuse's L3 term's share of the loss (0 when none)
    clipped: bool = False
    gpu: int | None = None
    fuse_level: str | None = None
    memory_used_bytes: float | None = None  # None off CUDA
    memory_total_bytes: float | None = None

    def to_wire(self) -> Wire:
        """Every field the report has (None: not sent); the figures as numbers (NaN and the
        infinities spelled out)."""
        return _drop_none(
            {
                f.name: number(getattr(self, f.name)) if f.name in _FIGURES else getattr(self, f.name)
                for f in fields(self)
            }
        )

    @classmethod
    def from_wire(cls, v: object, where: str) -> MpuReport:
        mr = obj(v, f"{where} must be an object")
        no_unknown(mr, MPU_REPORT_FIELDS, where)
        nums = {
            k: read_num(mr, k, f"{where}.{k} must be a number")
            for k in ("forward_s", "backward_s", "grad_norm", "gvc", "clip_ratio", *CHECK_FIGURES)
        }
        level = mr.get("fuse_level")
        need(level is None or is_text(level, 1, 32, FUSE_LEVEL), f"{where}.fuse_level must be 1-32 of [a-z0-9_]")
        return cls(
            **nums,
            distill_share=read_num(mr, "distill_share", f"{where}.distill_share must be a number", 0.0),
            clipped=read_bool(mr, "clipped", f"{where}.clipped must be a boolean"),
            checksum_ok=read_bool(mr, "checksum_ok", f"{where}.checksum_ok must be a boolean", True),
            checksum_consecutive_failures=read_int(
                mr, "checksum_consecutive_failures", f"{where}.checksum_consecutive_failures must be an integer"
            ),
            checksum_failures_total=read_opt_int(
                mr, "checksum_failures_total", f"{where}.checksum_failures_total must be an integer in 0..{MAX_INT}"
            ),
            gpu=read_opt_int(mr, "gpu", f"{where}.gpu must be a GPU index", 0, MAX_GPU_INDEX - 1),
            fuse_level=None if level is None else str(level),
            memory_used_bytes=read_amount(mr, "memory_used_bytes", f"{where}.memory_used_bytes must be a number"),
            memory_total_bytes=read_amount(mr, "memory_total_bytes", f"{where}.memory_total_bytes must be a number"),
        )


@dataclass(slots=True)
class StepReport:
    """One step as the job reports it. The guard builds it (plugins may set their fields, as
    mscale.hook.core.goodput sets `seconds`); the agent reads it back with `from_wire`, where the
    findings become the agent's `Finding`s (source "hook:<detector>") and the ones it cannot
    read are kept apart in `refused_findings` (their start, for the refusal's log line): a bad
    finding is counted, the rest of the report stands."""

    step: int
    time: float = 0.0
    loss: float = math.nan  # what the model returned (with the L3 term while one is in force)
    task_loss: float | None = None  # the task loss alone; None: the job sent none (its loss is)
    grad_norm: float = math.nan
    skipped: bool = False
    guard_overhead_ratio: float = math.nan  # the guard's measured cost over its step time
    mpus: dict[str, MpuReport] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # cause (TIME_CAUSES) -> seconds
    refused_findings: list[str] = field(default_factory=list)

    def to_wire(self) -> Wire:
        out: Wire = {
            "step": self.step,
            "time": self.time,
            "loss": number(self.loss),
            "task_loss": number(self.task_loss),
            "grad_norm": number(self.grad_norm),
            "skipped": self.skipped,
            "guard_overhead_ratio": number(self.guard_overhead_ratio),
            "mpus": {k: m.to_wire() for k, m in self.mpus.items()},
            "findings": [f.to_dict() for f in self.findings],
        }
        out = _drop_none(out)  # a task loss only where the job sets one
        return {**out, "seconds": dict(self.seconds)} if self.seconds else out

    @classmethod
    def from_wire(cls, v: object, where: str = "report: reports[0]") -> StepReport:
        r = obj(v, f"{where} must be an object")
        no_unknown(r, STEP_FIELDS, where)
        step = read_int(r, "step", f"{where}.step must be an integer in 0..{MAX_INT}", default=-1)
        t = r.get("time", 0.0)
        need(is_num(t) and not isinstance(t, str) and (t or 0) >= 0, f"{where}.time must be a time")
        nums = "loss/task_loss/grad_norm/guard_overhead_ratio"
        seconds = r.get("seconds", {})
        need(
            isinstance(seconds, dict)
            and all(
                k in TIME_CAUSES and isinstance(s, (int, float)) and is_num(s) and s >= 0 for k, s in seconds.items()
            ),
            f"{where}.seconds must map causes ({', '.join(TIME_CAUSES)}) to seconds",
        )
        mpus = r.get("mpus", {})
        need(isinstance(mpus, dict) and len(mpus) <= MAX_MPUS, f"{where}.mpus must be an object")
        by_id: dict[str, MpuReport] = {}
        for mid, mr in mpus.items():
            at = f"{where}.mpus[{str(mid)[:20]!r}]"
            need(is_text(mid, 1, 16, MPU_ID), f"{at}: an MPU id is 1-16 of [A-Za-z0-9._-]")
            by_id[mid] = MpuReport.from_wire(mr, at)
        raw = r.get("findings", [])
        need(
            isinstance(raw, list) and len(raw) <= MAX_FINDINGS,
            f"{where}.findings must be a list of at most {MAX_FINDINGS}",
        )
        findings, refused = [], []
        for f in raw:
            read = finding(f)
            if read is None:
                refused.append(str(f)[:200])
            else:
                findings.append(read)
        return cls(
            step=step,
            time=0.0 if t is None else float(t),
            loss=read_num(r, "loss", f"{where} {nums} must be numbers"),
            task_loss=read_amount(r, "task_loss", f"{where} {nums} must be numbers"),
            grad_norm=read_num(r, "grad_norm", f"{where} {nums} must be numbers"),
            skipped=read_bool(r, "skipped", f"{where}.skipped must be a boolean"),
            guard_overhead_ratio=read_num(r, "guard_overhead_ratio", f"{where} {nums} must be numbers"),
            mpus=by_id,
            findings=findings,
            seconds={k: float(s) for k, s in seconds.items()},
            refused_findings=refused,
        )


@dataclass(frozen=True, slots=True)
class Report:
    """A batch of step reports, and how many the job's bounded queue dropped so far."""

    job_id: str
    dropped: int = 0
    reports: tuple[StepReport, ...] = ()

    def to_wire(self) -> Wire:
        return {
            "type": Msg.REPORT.value,
            "job_id": self.job_id,
            "dropped": self.dropped,
            "reports": [r.to_wire() for r in self.reports],
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Report:
        """Every field of its type and range, no other fields (findings: see StepReport)."""
        no_unknown(msg, REPORT_FIELDS, "report")
        raw = msg.get("reports")
        if not isinstance(raw, list) or len(raw) > MAX_REPORTS:
            raise BadMessage("malformed", f"report: reports must be a list of at most {MAX_REPORTS}")
        dropped = read_int(msg, "dropped", f"report: dropped must be an integer in 0..{MAX_INT}")
        job_id = msg.get("job_id")
        reports = tuple(StepReport.from_wire(r, f"report: reports[{i}]") for i, r in enumerate(raw))
        return cls(job_id if isinstance(job_id, str) else "", dropped, reports)


# what each message may carry, from its dataclass (a type field too where it is a message of its
# own; a step report's refused findings are the agent's note, never sent)
REGISTER_FIELDS = frozenset({"type", *(f.name for f in fields(Register))})
MPU_FIELDS = frozenset(f.name for f in fields(MpuInfo))
REPORT_FIELDS = frozenset({"type", *(f.name for f in fields(Report))})
STEP_FIELDS = frozenset(f.name for f in fields(StepReport)) - {"refused_findings"}
MPU_REPORT_FIELDS = frozenset(f.name for f in fields(MpuReport))
_FIGURES = frozenset(f.name for f in fields(MpuReport) if str(f.type).startswith("float"))  # sent as numbers


# --- the agent's answers, the job's small ones ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Registered:
    job_id: str
    node: str

    def to_wire(self) -> Wire:
        return {"type": Msg.REGISTERED.value, "job_id": self.job_id, "node": self.node}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Registered:
        return cls(str(msg.get("job_id", "")), str(msg.get("node", "")))


@dataclass(frozen=True, slots=True)
class Error:
    error: str

    def to_wire(self) -> Wire:
        return {"type": Msg.ERROR.value, "error": self.error}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Error:
        return cls(str(msg.get("error", "")))


@dataclass(frozen=True, slots=True)
class Reply:
    """A plugin's answer to a command (the agent takes it silently)."""

    id: object
    answer: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> Wire:
        return {"type": Msg.REPLY.value, "id": self.id, **self.answer}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Reply:
        return cls(msg.get("id"), {k: v for k, v in msg.items() if k not in ("type", "id")})


@dataclass(frozen=True, slots=True)
class Pong:
    id: object

    def to_wire(self) -> Wire:
        return {"type": Msg.PONG.value, "id": self.id}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Pong:
        return cls(msg.get("id"))
