"""The link protocol: what the hook library and the node agent say to each other, in one place.

SHARED: imported by the agent's socket server (mscale.daemon.link), the job's client
(mscale.hook.link), the guard and the plugins that take commands, and by the CLIs for the
agent's default address. Pure Python: imports only `mscale.findings`; no torch, no aiohttp.

Where the agent is, by default:
  DEFAULT_LISTEN   127.0.0.1:9477, the HTTP API and /metrics (config `agent.listen`,
                   `mscale agent --listen`, `--agent` of `mscale status` and `mscale chaos`)
  DEFAULT_SOCKET   /run/mscale/agent.sock, the Unix socket jobs connect to (config
                   `agent.socket_path`; in the job `socket_path=`, else env MSCALE_SOCKET)

Wire format: a websocket at PATH on the Unix socket; JSON text frames, one object each, every
one with a string "type" (binary frames are refused).
  job -> agent   {"type": "register", job_id, rank, pid, step, mpus: [{mpu_id, name, path,
                  device, gpu, gpu_uuid, fuse_level, params}], local_rank?, world_size?}
                                                                           first, and on a rebind
                 {"type": "report", job_id, dropped, reports: [{step, time, loss, grad_norm,
                  skipped, mpus: {mpu_id: {forward_s, backward_s, grad_norm, gvc, clip_ratio,
                  ...}}, findings: [Finding.to_dict()], seconds: {cause: s}}]}   batched per step
                 {"type": "reply", id, ok, ...}   a plugin's answer to a command
                 {"type": "pong", id} (to a ping), {"type": "bye"}; any plugin-registered type
  agent -> job   {"type": "registered", job_id, node}
                 {"type": "error", error}         the job's message was refused (and counted)
                 a command: {"type": one of Command, ...}; a plugin may take other types too

A message over the agent's `socket.max_message_bytes` (default MAX_MESSAGE_BYTES), a frame that
is not a JSON object with a string type, an unknown type, or a register or report that fails
its validator below is refused with an error frame; the connection and other jobs go on. (A
frame over twice the limit cannot be read: the agent closes the connection, code 1009.)

The validators are a strict schema: the fields each message may carry (REGISTER_FIELDS,
MPU_FIELDS, REPORT_FIELDS, STEP_FIELDS, MPU_REPORT_FIELDS) and no others; steps, counters and
sizes integers in 0..MAX_INT, ranks, pids and GPU indexes in their ranges, other numbers finite
(non-finite ones only as the strings "nan", "inf", "-inf"); strings bounded, identifiers in a
fixed charset, names printable (`printable` escapes what a CLI prints anyway).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any

from mscale.findings import Finding, Reason, Severity

# --- where the agent is ----------------------------------------------------------------------

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9477  # not 9400: that is dcgm-exporter's, which the agent may read on the same node
DEFAULT_LISTEN = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_URL = f"http://{DEFAULT_LISTEN}"
DEFAULT_SOCKET = "/run/mscale/agent.sock"
SOCKET_ENV = "MSCALE_SOCKET"
PATH = "/v1/link"  # the websocket's HTTP path on the socket


AGENT_UID_ENV = "MSCALE_AGENT_UID"
MAX_UID = 4294967294  # (uid_t)-1 is no uid


def socket_path(explicit: str | None = None) -> str:
    """The socket a job connects to: `explicit`, else $MSCALE_SOCKET, else DEFAULT_SOCKET."""
    return explicit or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def agent_uids(explicit: int | None = None) -> frozenset[int]:
    """The uids a job accepts as its agent (the socket's listener, by SO_PEERCRED): root, the
    job's own uid (which can do anything to the job anyway) and `explicit`, else
    $MSCALE_AGENT_UID, when the agent runs as another user. A bad value raises ValueError."""
    where, value = "agent_uid", explicit
    if value is None and os.environ.get(AGENT_UID_ENV, "").strip():
        where, raw = AGENT_UID_ENV, os.environ[AGENT_UID_ENV].strip()
        if not raw.isdigit() or len(raw) > 10:
            raise ValueError(f"{where}: expected a uid (an integer 0..{MAX_UID}), got {raw[:40]!r}")
        value = int(raw)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_UID):
        raise ValueError(f"{where}: expected a uid (an integer 0..{MAX_UID}), got {str(value)[:40]!r}")
    return frozenset({0, os.geteuid()} | ({value} if value is not None else set()))


# --- sizes -----------------------------------------------------------------------------------

MAX_MESSAGE_BYTES = 1 << 20  # default of the agent's socket.max_message_bytes
MAX_BATCH = 64  # reports per report message: each message stays far below the size limit
MAX_REPORTS = 4096  # reports in one message, at most
MAX_MPUS = 64  # MPUs in one registration, at most
MAX_GPU_INDEX = 4096  # a registered GPU index is below this
MAX_INT = (1 << 63) - 1  # steps, counters and sizes are integers in 0..MAX_INT
MAX_RANK = (1 << 24) - 1
MAX_PID = 1 << 22  # the kernel's largest pid_max
MAX_FINDINGS = 256  # findings in one step report, at most
MAX_TYPE = 64  # characters of a message type
JOB_ID = re.compile(r"^[A-Za-z0-9._:@/+-]{1,128}$")
MPU_ID = re.compile(r"[A-Za-z0-9._-]{1,16}")
GPU_UUID = re.compile(r"[A-Za-z0-9-]*")
FUSE_LEVEL = re.compile(r"[a-z0-9_]{1,32}")
SOURCE = re.compile(r"[a-z0-9_.-]{1,32}")
# the fields each message may carry (the job's client sends exactly these)
REGISTER_FIELDS = frozenset({"type", "job_id", "rank", "pid", "step", "mpus", "local_rank", "world_size", "pod"})
MPU_FIELDS = frozenset({"mpu_id", "name", "path", "device", "gpu", "gpu_uuid", "fuse_level", "params"})
REPORT_FIELDS = frozenset({"type", "job_id", "dropped", "reports"})
STEP_FIELDS = frozenset(
    {"step", "time", "loss", "task_loss", "grad_norm", "skipped", "mpus", "findings", "seconds"}
    | {"guard_overhead_ratio"}
)
TIME_CAUSES = ("productive", "startup", "snapshot", "rerun", "checks", "degraded", "data_wait", "hang")  # hook.goodput
CHECK_FIGURES = ("checksum_coverage_ratio", "checksum_max_gap_steps")  # the budget's (mscale.hook.coverage)
MPU_REPORT_FIELDS = frozenset(
    {"forward_s", "backward_s", "grad_norm", "gvc", "clip_ratio", "distill_share", "clipped", "checksum_ok"}
    | {"checksum_consecutive_failures", "checksum_failures_total", "gpu", "fuse_level"}
    | {"memory_used_bytes", "memory_total_bytes", *CHECK_FIGURES}
)
# a reported finding is clamped to these on the agent
MAX_FINDING_LABELS, MAX_LABEL_NAME, MAX_LABEL_VALUE = 32, 64, 256
MAX_FINDING_MESSAGE, MAX_FINDING_SOURCE = 1000, 32


# --- vocabulary ------------------------------------------------------------------------------


class Msg(StrEnum):
    """The link's own message types (commands aside)."""

    REGISTER = "register"  # job -> agent
    REPORT = "report"  # job -> agent
    REPLY = "reply"  # job -> agent: a plugin's answer to a command
    PONG = "pong"  # job -> agent
    BYE = "bye"  # job -> agent
    REGISTERED = "registered"  # agent -> job
    ERROR = "error"  # agent -> job: the last message was refused


ACCEPTED_SILENTLY = frozenset({Msg.REPLY, Msg.PONG, Msg.BYE})  # taken by the agent, no handler needed
RESERVED = frozenset({Msg.REGISTER, Msg.REPORT})  # no plugin may take these over


class Command(StrEnum):
    """The commands the agent sends and the project's own job-side code carries out. An
    emergency snapshot or a rollback is a heal command (action emergency_snapshot, rollback)."""

    PING = "ping"  # the guard answers with a pong
    HEAL = "heal"  # a healing decision for the fuse plugin (mscale.hook.fuse)
    CHAOS = "chaos"  # a fault for the chaos plugin (mscale.sim.chaos_job)


# a standby GPU for an L1 swap, from the agent's node view (mscale.daemon.standby,
# mscale.hook.standby): the job asks, the agent answers that rank only
STANDBY_REQUEST = "standby_request"  # job -> agent: {type, id, mpu_id, gpu, avoid: [gpu, ...]}
STANDBY = "standby"  # agent -> job: {type, id, gpu (null: none), gpu_uuid, why, decided (false: no node view)}
STANDBY_REQUEST_FIELDS = frozenset({"type", "id", "mpu_id", "gpu", "avoid"})
MAX_AVOID = 256

# the fields a heal command may carry besides type and action
HEAL_FIELDS = ("rule", "level", "mpu_id", "gpu", "gpu_uuid", "reason", "why", "fault_key", "decided_at", "end")

# chaos: the kinds `POST /api/v1/chaos` takes (`mscale chaos inject` spells them with "-"),
# its fields, the corruption modes, and the kinds a job's chaos command carries
CHAOS_KINDS = ("corrupt", "loss_spike", "nan_loss", "xid", "ecc", "hang", "agent_kill")
CHAOS_FIELDS = ("kind", "job_id", "mpu", "gpu", "mode", "steps", "factor", "code", "corrupt", "seconds")
CHAOS_MODES = ("bitflip", "noise", "nan")
CHAOS_JOB_KINDS = ("corrupt", "gpu_fault", "loss_spike", "nan_loss", "hang")


# --- building messages -----------------------------------------------------------------------


def register(
    *,
    job_id: str,
    rank: int,
    pid: int,
    step: int,
    mpus: list[dict],
    local_rank: int = 0,
    world_size: int = 1,
    pod: dict | None = None,
) -> dict:
    msg = {
        "type": Msg.REGISTER.value,
        "job_id": job_id,
        "rank": rank,
        "pid": pid,
        "step": step,
        "mpus": mpus,
        "local_rank": local_rank,
        "world_size": world_size,
    }
    return msg if pod is None else {**msg, "pod": pod}


# Kubernetes: a training pod's downward API sets these (deploy/kubernetes/examples/training-pod.yaml)
POD_NAME_ENV, POD_NAMESPACE_ENV = "POD_NAME", "POD_NAMESPACE"
POD_FIELDS = frozenset({"name", "namespace"})
POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS label


def pod_from_env(env: Mapping[str, str] | None = None) -> dict | None:
    """The job's pod from the downward API's variables; None off Kubernetes (or if malformed)."""
    env = os.environ if env is None else env
    pod = {"name": env.get(POD_NAME_ENV, ""), "namespace": env.get(POD_NAMESPACE_ENV, "")}
    return pod if POD_NAME.fullmatch(pod["name"]) and NAMESPACE.fullmatch(pod["namespace"]) else None


def report(job_id: str, dropped: int, reports: list[dict]) -> dict:
    return {"type": Msg.REPORT.value, "job_id": job_id, "dropped": dropped, "reports": reports}


def number(v: Any) -> float | str | None:
    """A number as a report carries it: JSON has no non-finite numbers, so NaN and the
    infinities travel as "nan", "inf" and "-inf" (which the report validator accepts)."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else str(v)


def reply(command_id: Any, answer: Mapping[str, Any]) -> dict:
    return {"type": Msg.REPLY.value, "id": command_id, **answer}


def pong(command_id: Any) -> dict:
    return {"type": Msg.PONG.value, "id": command_id}


def registered(job_id: str, node: str) -> dict:
    return {"type": Msg.REGISTERED.value, "job_id": job_id, "node": node}


def error(text: str) -> dict:
    return {"type": Msg.ERROR.value, "error": text}


def heal(action: str, **fields: Any) -> dict:
    """A heal command: {"type": "heal", "action": action, ...}, fields from HEAL_FIELDS."""
    unknown = sorted(set(fields) - set(HEAL_FIELDS))
    if unknown:
        raise ValueError(f"heal command: unknown field(s) {', '.join(unknown)}; expected {', '.join(HEAL_FIELDS)}")
    return {"type": Command.HEAL.value, "action": action, **fields}


def chaos(kind: str, **fields: Any) -> dict:
    """A chaos command for a job's chaos plugin: {"type": "chaos", "kind": kind, ...}."""
    if kind not in CHAOS_JOB_KINDS:
        raise ValueError(f"chaos command: kind {kind!r} is not one of {', '.join(CHAOS_JOB_KINDS)}")
    return {"type": Command.CHAOS.value, "kind": kind, **fields}


def printable(text: Any, limit: int | None = None) -> str:
    """`text` made safe to print on a terminal: every character that is not printable (escape,
    other control and format characters, line breaks) shown as its Python escape (\\x1b,
    \\u202e); cut to `limit` characters first. For strings a job sent, where a CLI prints them."""
    text = str(text)
    if limit is not None:
        text = text[:limit]
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def encode(message: Mapping[str, Any]) -> str:
    """One text frame."""
    return json.dumps(message)


# --- reading and validating ------------------------------------------------------------------


class BadMessage(ValueError):
    """A message the protocol refuses; `why` is the refusal counter's label."""

    def __init__(self, why: str, detail: str) -> None:
        super().__init__(detail)
        self.why = why


def _need(cond: bool, detail: str, why: str = "malformed") -> None:
    if not cond:
        raise BadMessage(why, detail)


def _is_int(v: Any, lo: int = 0, hi: int = MAX_INT) -> bool:
    """An integer (not a bool) in lo..hi."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_num(v: Any) -> bool:
    """A report number: null, a finite float, an integer within +-MAX_INT, or "nan"/"inf"/"-inf"
    (how `number` sends non-finite values). `1e400` arrives as a float infinity and is refused."""
    if v is None or isinstance(v, str):
        return v in (None, "nan", "inf", "-inf")
    if isinstance(v, float):
        return math.isfinite(v)
    return _is_int(v, -MAX_INT, MAX_INT)


def _is_text(v: Any, lo: int, hi: int, pattern: re.Pattern[str] | None = None) -> bool:
    """A string of lo..hi characters, printable (no control, format or separator characters
    other than space, so nothing that drives a terminal), matching `pattern` if given."""
    return (
        isinstance(v, str)
        and lo <= len(v) <= hi
        and (v.isprintable() if pattern is None else bool(pattern.fullmatch(v)))
    )


def _no_unknown(d: dict, allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(k)[:40] for k in d if k not in allowed)
    _need(not unknown, f"{where}: unknown field(s) {', '.join(map(repr, unknown[:5]))}")


def decode(data: str, max_bytes: int | None = None) -> dict:
    """A text frame as a message: a JSON object with a string "type", at most max_bytes."""
    if max_bytes is not None and len(data) > max_bytes // 4 and len(data.encode()) > max_bytes:
        raise BadMessage(
            "oversized", f"message of {len(data.encode())} bytes over socket.max_message_bytes ({max_bytes})"
        )
    try:
        msg = json.loads(data)
    except ValueError as e:  # also an integer of more than 4300 digits
        raise BadMessage("malformed", f"not JSON: {str(e)[:200]}") from None
    except RecursionError:
        raise BadMessage("malformed", "not JSON: nested too deep") from None
    _need(isinstance(msg, dict) and isinstance(msg.get("type"), str), "expected a JSON object with a string 'type'")
    _need(len(msg["type"]) <= MAX_TYPE, f"type: at most {MAX_TYPE} characters")
    return msg


def check_command(command: Any) -> None:
    """A command is a dict with a string type (plugins may understand types beyond Command)."""
    if not isinstance(command, dict) or not isinstance(command.get("type"), str):
        raise ValueError("command: expected a dict with a string 'type'")


def validate_register(msg: dict, max_mpus: int = MAX_MPUS) -> None:
    """A registration: job_id, rank, pid, step and 1..max_mpus MPUs, every field of its type and
    range, no other fields. Too many MPUs is refused with why "mpu_limit"."""
    _no_unknown(msg, REGISTER_FIELDS, "register")
    _need(
        isinstance(msg.get("job_id"), str) and bool(JOB_ID.fullmatch(msg["job_id"])),
        "register: job_id must be 1-128 characters of [A-Za-z0-9._:@/+-]",
    )
    _need(_is_int(msg.get("rank"), 0, MAX_RANK), f"register: rank must be an integer in 0..{MAX_RANK}")
    _need(_is_int(msg.get("local_rank", 0), 0, MAX_RANK), f"register: local_rank must be an integer in 0..{MAX_RANK}")
    _need(
        "world_size" not in msg or (_is_int(msg["world_size"], 1, MAX_RANK + 1) and msg["rank"] < msg["world_size"]),
        f"register: world_size must be an integer in 1..{MAX_RANK + 1}, above rank",
    )
    _need(_is_int(msg.get("pid"), 1, MAX_PID), f"register: pid must be an integer in 1..{MAX_PID}")
    _need(_is_int(msg.get("step", 0), -1, MAX_INT), f"register: step must be an integer in -1..{MAX_INT}")
    mpus = msg.get("mpus")
    if not isinstance(mpus, list) or not 1 <= len(mpus) <= MAX_MPUS:
        raise BadMessage("malformed", f"register: mpus must be a list of 1 to {MAX_MPUS} MPUs")
    if len(mpus) > max_mpus:
        raise BadMessage("mpu_limit", f"register: {len(mpus)} MPUs, over socket.max_mpus_per_job ({max_mpus})")
    seen = set()
    for i, m in enumerate(mpus):
        _need(isinstance(m, dict), f"register: mpus[{i}] must be an object")
        _no_unknown(m, MPU_FIELDS, f"register: mpus[{i}]")
        _need(_is_text(m.get("mpu_id"), 1, 16, MPU_ID), f"register: mpus[{i}].mpu_id must be 1-16 of [A-Za-z0-9._-]")
        _need(m["mpu_id"] not in seen, f"register: mpus[{i}].mpu_id {m['mpu_id']!r} repeated")
        seen.add(m["mpu_id"])
        _need(_is_text(m.get("name"), 1, 64), f"register: mpus[{i}].name must be 1-64 printable characters")
        _need(_is_int(m.get("gpu"), 0, MAX_GPU_INDEX - 1), f"register: mpus[{i}].gpu must be a GPU index")
        _need(
            _is_text(m.get("gpu_uuid", ""), 0, 96, GPU_UUID),
            f"register: mpus[{i}].gpu_uuid must be up to 96 of [A-Za-z0-9-]",
        )
        for k, hi in (("path", 256), ("device", 64)):
            _need(_is_text(m.get(k, ""), 0, hi), f"register: mpus[{i}].{k} must be up to {hi} printable characters")
        _need(
            _is_text(m.get("fuse_level", "healthy"), 1, 32, FUSE_LEVEL),
            f"register: mpus[{i}].fuse_level must be 1-32 of [a-z0-9_]",
        )
        _need(_is_int(m.get("params", 0)), f"register: mpus[{i}].params must be an integer in 0..{MAX_INT}")
    if "pod" in msg:
        pod = msg["pod"]
        _need(isinstance(pod, dict), "register: pod must be an object {name, namespace}")
        _no_unknown(pod, POD_FIELDS, "register: pod")
        _need(_is_text(pod.get("name"), 1, 253, POD_NAME), "register: pod.name must be a Kubernetes pod name")
        _need(_is_text(pod.get("namespace"), 1, 63, NAMESPACE), "register: pod.namespace must be a namespace name")


def standby_request(*, id: int, mpu_id: str, gpu: int, avoid: list[int]) -> dict:
    return {"type": STANDBY_REQUEST, "id": id, "mpu_id": mpu_id, "gpu": gpu, "avoid": sorted(set(avoid))}


def standby(id: int, gpu: int | None, gpu_uuid: str = "", why: str = "", *, decided: bool = True) -> dict:
    return {"type": STANDBY, "id": id, "gpu": gpu, "gpu_uuid": gpu_uuid, "why": why, "decided": decided}


def validate_standby_request(msg: dict) -> None:
    """A standby request: an id, the MPU, the GPU it leaves, the GPUs the job avoids."""
    _no_unknown(msg, STANDBY_REQUEST_FIELDS, "standby_request")
    _need(_is_int(msg.get("id")), f"standby_request: id must be an integer in 0..{MAX_INT}")
    _need(_is_text(msg.get("mpu_id"), 1, 16, MPU_ID), "standby_request: mpu_id must be 1-16 of [A-Za-z0-9._-]")
    _need(_is_int(msg.get("gpu"), 0, MAX_GPU_INDEX - 1), "standby_request: gpu must be a GPU index")
    avoid = msg.get("avoid", [])
    _need(
        isinstance(avoid, list) and len(avoid) <= MAX_AVOID and all(_is_int(g, 0, MAX_GPU_INDEX - 1) for g in avoid),
        f"standby_request: avoid must be a list of at most {MAX_AVOID} GPU indexes",
    )


def validate_report(msg: dict) -> None:
    """A batch of step reports: every field of its type and range, no other fields. Findings are
    checked one by one when applied (`finding`): a bad one is counted, the rest of the report stands."""
    _no_unknown(msg, REPORT_FIELDS, "report")
    reports = msg.get("reports")
    if not isinstance(reports, list) or len(reports) > MAX_REPORTS:
        raise BadMessage("malformed", f"report: reports must be a list of at most {MAX_REPORTS}")
    _need(_is_int(msg.get("dropped", 0)), f"report: dropped must be an integer in 0..{MAX_INT}")
    for i, r in enumerate(reports):
        _need(isinstance(r, dict), f"report: reports[{i}] must be an object")
        _no_unknown(r, STEP_FIELDS, f"report: reports[{i}]")
        _need(_is_int(r.get("step")), f"report: reports[{i}].step must be an integer in 0..{MAX_INT}")
        t = r.get("time", 0.0)
        _need(_is_num(t) and not isinstance(t, str) and (t or 0) >= 0, f"report: reports[{i}].time must be a time")
        _need(
            all(_is_num(r.get(k)) for k in ("loss", "task_loss", "grad_norm", "guard_overhead_ratio")),
            f"report: reports[{i}] loss/task_loss/grad_norm/guard_overhead_ratio must be numbers",
        )
        _need(isinstance(r.get("skipped", False), bool), f"report: reports[{i}].skipped must be a boolean")
        seconds = r.get("seconds", {})
        _need(
            isinstance(seconds, dict)
            and all(
                k in TIME_CAUSES and isinstance(v, (int, float)) and _is_num(v) and v >= 0 for k, v in seconds.items()
            ),
            f"report: reports[{i}].seconds must map causes ({', '.join(TIME_CAUSES)}) to seconds",
        )
        mpus = r.get("mpus", {})
        _need(isinstance(mpus, dict) and len(mpus) <= MAX_MPUS, f"report: reports[{i}].mpus must be an object")
        for mid, mr in mpus.items():
            where = f"report: reports[{i}].mpus[{str(mid)[:20]!r}]"
            _need(_is_text(mid, 1, 16, MPU_ID), f"{where}: an MPU id is 1-16 of [A-Za-z0-9._-]")
            _need(isinstance(mr, dict), f"{where} must be an object")
            _no_unknown(mr, MPU_REPORT_FIELDS, where)
            for k in ("forward_s", "backward_s", "grad_norm", "gvc", "clip_ratio", "distill_share") + CHECK_FIGURES:
                _need(_is_num(mr.get(k)), f"{where}.{k} must be a number")
            for k in ("memory_used_bytes", "memory_total_bytes"):
                _need(_is_num(mr.get(k)), f"{where}.{k} must be a number")
            for k in ("checksum_ok", "clipped"):
                _need(isinstance(mr.get(k, False), bool), f"{where}.{k} must be a boolean")
            for k in ("checksum_consecutive_failures", "checksum_failures_total"):
                _need(_is_int(mr.get(k, 0)), f"{where}.{k} must be an integer in 0..{MAX_INT}")
            _need(_is_int(mr.get("gpu", 0), 0, MAX_GPU_INDEX - 1), f"{where}.gpu must be a GPU index")
            _need(
                _is_text(mr.get("fuse_level", "healthy"), 1, 32, FUSE_LEVEL),
                f"{where}.fuse_level must be 1-32 of [a-z0-9_]",
            )
        findings = r.get("findings", [])
        _need(
            isinstance(findings, list) and len(findings) <= MAX_FINDINGS,
            f"report: reports[{i}].findings must be a list of at most {MAX_FINDINGS}",
        )


_REASONS = {r.value: r for r in Reason}
_SEVERITIES = {s.value: s for s in Severity}


def finding(f: Any) -> Finding | None:
    """A reported finding (the job sends `Finding.to_dict()`) read back, clamped to the sizes
    above, its source prefixed "hook:"; None when its reason, severity, source (1-32 of
    [a-z0-9_.-]) or labels are not understood. A time that is not a finite number >= 0 is
    replaced by the agent's."""
    if not isinstance(f, dict):
        return None
    r, sev, message = f.get("reason"), f.get("severity"), f.get("message", "")
    reason = _REASONS.get(r) if isinstance(r, str) else None
    severity = _SEVERITIES.get(sev) if isinstance(sev, str) else None
    labels = f.get("labels", {})
    if reason is None or severity is None or not isinstance(labels, dict) or not isinstance(message, str):
        return None
    source = f.get("source", "")
    if not _is_text(source, 1, MAX_FINDING_SOURCE, SOURCE):
        return None
    labels = {str(k)[:MAX_LABEL_NAME]: str(v)[:MAX_LABEL_VALUE] for k, v in list(labels.items())[:MAX_FINDING_LABELS]}
    t = f.get("time")
    kwargs = {"time": float(t)} if _is_num(t) and isinstance(t, (int, float)) and t >= 0 else {}
    return Finding(
        f"hook:{source}",
        reason,
        severity,
        message[:MAX_FINDING_MESSAGE],
        labels,
        **kwargs,
    )


# --- resource contracts and MSRP (job -> agent, taken by mscale.daemon.contract) --------------
#   {"type": "contract", job_id, rank, plan: Plan.to_dict()}  when a contract's plan is in force
#   {"type": "msrp", job_id, rank, gpus: {index: {bandwidth_bytes_per_s, matmul_flops, dtype,
#    measured_at}}, mpus: {mpu_id: {flops_per_step, achieved_flops, memory_bytes}}}
# Each field below is checked by (test, what it must be); every field of a row is required.

CONTRACT, MSRP = "contract", "msrp"
MAX_PLAN_ROWS, MAX_PLAN_CPUS, MAX_CPU_INDEX = 64, 1024, 8191
_PLAN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_Check = tuple[Callable[[Any], bool], str]
_NAME: _Check = (lambda v: _is_text(v, 1, 32, _PLAN_NAME), "1-32 of [A-Za-z0-9_.-]")
_NODE: _Check = (lambda v: v is None or _is_int(v, 0, 1023), "null or a NUMA node 0..1023")
_COUNT: _Check = (_is_int, f"an integer in 0..{MAX_INT}")
_AMOUNT: _Check = (lambda v: not isinstance(v, str) and _is_num(v) and v is not None and v >= 0, "a finite number >= 0")
PLAN_TABLES: dict[str, dict[str, _Check]] = {
    "threads": {
        "name": _NAME,
        "cpus": (
            lambda v: (
                isinstance(v, list) and 0 < len(v) <= MAX_PLAN_CPUS and all(_is_int(c, 0, MAX_CPU_INDEX) for c in v)
            ),
            f"1..{MAX_PLAN_CPUS} CPUs in 0..{MAX_CPU_INDEX}",
        ),
        "tag": (lambda v: _is_text(v, 0, 15), "up to 15 printable characters"),
        "numa_node": _NODE,
    },
    "gpus": {
        "name": _NAME,
        "gpu_id": (lambda v: _is_int(v, 0, MAX_GPU_INDEX - 1), "a GPU index"),
        "bdf": (lambda v: _is_text(v, 12, 12, re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")), "a BDF"),
        "numa_node": _NODE,
    },
    "pools": {"name": _NAME, "size_kb": _COUNT, "pages": _COUNT, "free": _COUNT},
    "rdma": {"name": _NAME, "device": _NAME, "port": (lambda v: _is_int(v, 0, 255), "a port 0..255")},
    "nvme": {"name": _NAME, "namespace": _NAME},
}
_ROWS: _Check = (lambda v: isinstance(v, list) and len(v) <= MAX_PLAN_ROWS, f"a list of at most {MAX_PLAN_ROWS}")
PLAN_FIELDS: dict[str, _Check] = {
    "contract_id": (lambda v: _is_text(v, 12, 12, re.compile(r"[0-9a-f]{12}")), "12 hex digits"),
    "compute_profile": _NAME,
    "recovery_point": (lambda v: _is_text(v, 1, 32, re.compile(r"latest|step_[0-9]{1,18}")), "latest or step_N"),
    "stateful_io": (lambda v: isinstance(v, bool), "a boolean"),
    "notes": (lambda v: isinstance(v, list) and len(v) <= 16 and all(_is_text(n, 0, 300) for n in v), "short notes"),
    **{table: _ROWS for table in PLAN_TABLES},
}
MSRP_TABLES: dict[str, dict[str, _Check]] = {
    "gpus": {
        "bandwidth_bytes_per_s": _AMOUNT,
        "matmul_flops": _AMOUNT,
        "dtype": (lambda v: _is_text(v, 1, 16, re.compile(r"[a-z0-9]{1,16}")), "1-16 of [a-z0-9]"),
        "measured_at": _AMOUNT,
    },
    "mpus": {"flops_per_step": _AMOUNT, "achieved_flops": _AMOUNT, "memory_bytes": _AMOUNT},
}
_RANK: _Check = (lambda v: _is_int(v, 0, MAX_RANK), f"a rank in 0..{MAX_RANK}")
_HEAD: dict[str, _Check] = {
    "type": (lambda v: isinstance(v, str), "a string"),
    "job_id": (lambda v: isinstance(v, str) and bool(JOB_ID.fullmatch(v)), "1-128 of [A-Za-z0-9._:@/+-]"),
    "rank": _RANK,
}


def contract_plan(job_id: str, rank: int, plan: Mapping[str, Any]) -> dict:
    return {"type": CONTRACT, "job_id": job_id, "rank": rank, "plan": dict(plan)}


def msrp(job_id: str, rank: int, gpus: Mapping[str, Any], mpus: Mapping[str, Any]) -> dict:
    return {"type": MSRP, "job_id": job_id, "rank": rank, "gpus": dict(gpus), "mpus": dict(mpus)}


def _fields(d: Any, checks: Mapping[str, _Check], where: str, required: Iterable[str]) -> None:
    """`d` an object of only these fields, the required ones present, each passing its check."""
    _need(isinstance(d, dict), f"{where} must be an object")
    _no_unknown(d, frozenset(checks), where)
    for k in required:
        _need(k in d, f"{where}.{k} is missing")
    for k, v in d.items():
        test, what = checks[k]
        _need(test(v), f"{where}.{k} must be {what}")


def validate_contract(msg: dict) -> None:
    """A contract's plan, strictly: the fields `Plan.to_dict` writes, each of its type and range."""
    _fields(msg, {**_HEAD, "plan": (lambda v: isinstance(v, dict), "an object")}, "contract", ("rank", "plan"))
    plan = msg["plan"]
    _fields(plan, PLAN_FIELDS, "contract: plan", ("contract_id", "compute_profile"))
    for table, checks in PLAN_TABLES.items():
        for i, row in enumerate(plan.get(table, [])):
            _fields(row, checks, f"contract: plan.{table}[{i}]", checks)


def validate_msrp(msg: dict) -> None:
    """A job's MSRP: per GPU index its micro-probe results, per MPU its FLOP counts; numbers finite >= 0."""
    rows: _Check = (lambda v: isinstance(v, dict) and len(v) <= MAX_MPUS, f"an object of at most {MAX_MPUS}")
    _fields(msg, {**_HEAD, "gpus": rows, "mpus": rows}, "msrp", ("rank",))
    for table, checks in MSRP_TABLES.items():
        for key, row in msg.get(table, {}).items():
            where = f"msrp: {table}[{str(key)[:20]!r}]"
            if table == "gpus":
                _need(isinstance(key, str) and key.isdigit() and int(key) < MAX_GPU_INDEX, f"{where}: a GPU index")
            else:
                _need(_is_text(key, 1, 16, MPU_ID), f"{where}: an MPU id is 1-16 of [A-Za-z0-9._-]")
            _fields(row, checks, where, ())
