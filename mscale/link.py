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
                  device, gpu, gpu_uuid, fuse_level, params}]}              first, and on a rebind
                 {"type": "report", job_id, dropped, reports: [{step, time, loss, grad_norm,
                  skipped, mpus: {mpu_id: {forward_s, backward_s, grad_norm, gvc, clip_ratio,
                  ...}}, findings: [Finding.to_dict()]}]}                    batched per step
                 {"type": "reply", id, ok, ...}   a plugin's answer to a command
                 {"type": "pong", id}             the answer to a ping
                 {"type": "bye"}; any type a plugin registered on the agent (LinkServer.on_message)
  agent -> job   {"type": "registered", job_id, node}
                 {"type": "error", error}         the job's message was refused (and counted)
                 a command: {"type": one of Command, ...}; a plugin may take other types too

A message over the agent's `socket.max_message_bytes` (default MAX_MESSAGE_BYTES), a frame that
is not a JSON object with a string type, an unknown type, or a register or report that fails
its validator below is refused with an error frame; the connection and other jobs go on.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
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


def socket_path(explicit: str | None = None) -> str:
    """The socket a job connects to: `explicit`, else $MSCALE_SOCKET, else DEFAULT_SOCKET."""
    return explicit or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


# --- sizes -----------------------------------------------------------------------------------

MAX_MESSAGE_BYTES = 1 << 20  # default of the agent's socket.max_message_bytes
MAX_BATCH = 64  # reports per report message: each message stays far below the size limit
MAX_REPORTS = 4096  # reports in one message, at most
MAX_MPUS = 64  # MPUs in one registration, at most
MAX_GPU_INDEX = 4096  # a registered GPU index is below this
JOB_ID = re.compile(r"^[A-Za-z0-9._:@/+-]{1,128}$")
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


# the fields a heal command may carry besides type and action
HEAL_FIELDS = ("rule", "level", "mpu_id", "gpu", "gpu_uuid", "reason", "why", "fault_key", "decided_at", "end")

# chaos: the kinds `POST /api/v1/chaos` takes (`mscale chaos inject` spells them with "-"),
# its fields, the corruption modes, and the kinds a job's chaos command carries
CHAOS_KINDS = ("corrupt", "loss_spike", "nan_loss", "xid", "ecc", "hang", "agent_kill")
CHAOS_FIELDS = ("kind", "job_id", "mpu", "gpu", "mode", "steps", "factor", "code", "corrupt", "seconds")
CHAOS_MODES = ("bitflip", "noise", "nan")
CHAOS_JOB_KINDS = ("corrupt", "gpu_fault", "loss_spike", "nan_loss", "hang")


# --- building messages -----------------------------------------------------------------------


def register(*, job_id: str, rank: int, pid: int, step: int, mpus: list[dict]) -> dict:
    return {"type": Msg.REGISTER.value, "job_id": job_id, "rank": rank, "pid": pid, "step": step, "mpus": mpus}


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in ("nan", "inf", "-inf")


def decode(data: str, max_bytes: int | None = None) -> dict:
    """A text frame as a message: a JSON object with a string "type", at most max_bytes."""
    if max_bytes is not None and len(data.encode()) > max_bytes:
        raise BadMessage("oversized", f"message of {len(data)} bytes over socket.max_message_bytes")
    try:
        msg = json.loads(data)
    except ValueError as e:
        raise BadMessage("malformed", f"not JSON: {e}") from None
    _need(isinstance(msg, dict) and isinstance(msg.get("type"), str), "expected a JSON object with a string 'type'")
    return msg


def check_command(command: Any) -> None:
    """A command is a dict with a string type (plugins may understand types beyond Command)."""
    if not isinstance(command, dict) or not isinstance(command.get("type"), str):
        raise ValueError("command: expected a dict with a string 'type'")


def validate_register(msg: dict) -> None:
    _need(
        isinstance(msg.get("job_id"), str) and bool(JOB_ID.match(msg["job_id"])),
        "register: job_id must be 1-128 characters of [A-Za-z0-9._:@/+-]",
    )
    _need(_is_int(msg.get("rank")) and msg["rank"] >= 0, "register: rank must be an integer >= 0")
    _need(_is_int(msg.get("pid")) and msg["pid"] > 0, "register: pid must be an integer > 0")
    mpus = msg.get("mpus")
    if not isinstance(mpus, list) or not 1 <= len(mpus) <= MAX_MPUS:
        raise BadMessage("malformed", f"register: mpus must be a list of 1 to {MAX_MPUS} MPUs")
    seen = set()
    for i, m in enumerate(mpus):
        _need(isinstance(m, dict), f"register: mpus[{i}] must be an object")
        _need(
            isinstance(m.get("mpu_id"), str) and 1 <= len(m["mpu_id"]) <= 16,
            f"register: mpus[{i}].mpu_id must be a short string",
        )
        _need(m["mpu_id"] not in seen, f"register: mpus[{i}].mpu_id {m['mpu_id']!r} repeated")
        seen.add(m["mpu_id"])
        _need(
            isinstance(m.get("name"), str) and 1 <= len(m["name"]) <= 64, f"register: mpus[{i}].name must be a string"
        )
        _need(_is_int(m.get("gpu")) and 0 <= m["gpu"] < MAX_GPU_INDEX, f"register: mpus[{i}].gpu must be a GPU index")
        _need(isinstance(m.get("gpu_uuid", ""), str), f"register: mpus[{i}].gpu_uuid must be a string")


def validate_report(msg: dict) -> None:
    reports = msg.get("reports")
    if not isinstance(reports, list) or len(reports) > MAX_REPORTS:
        raise BadMessage("malformed", "report: reports must be a list")
    _need(_is_int(msg.get("dropped", 0)) and msg.get("dropped", 0) >= 0, "report: dropped must be an integer >= 0")
    for i, r in enumerate(reports):
        _need(isinstance(r, dict), f"report: reports[{i}] must be an object")
        _need(_is_int(r.get("step")) and r["step"] >= 0, f"report: reports[{i}].step must be an integer >= 0")
        _need(
            _is_num(r.get("loss")) and _is_num(r.get("grad_norm")),
            f"report: reports[{i}] loss/grad_norm must be numbers",
        )
        _need(isinstance(r.get("mpus", {}), dict), f"report: reports[{i}].mpus must be an object")
        for mid, mr in r.get("mpus", {}).items():
            _need(isinstance(mr, dict), f"report: reports[{i}].mpus[{mid!r}] must be an object")
            for k in ("forward_s", "backward_s", "grad_norm", "gvc", "clip_ratio"):
                _need(_is_num(mr.get(k)), f"report: reports[{i}].mpus[{mid!r}].{k} must be a number")
        _need(isinstance(r.get("findings", []), list), f"report: reports[{i}].findings must be a list")


_REASONS = {r.value: r for r in Reason}
_SEVERITIES = {s.value: s for s in Severity}


def finding(f: Any) -> Finding | None:
    """A reported finding (the job sends `Finding.to_dict()`) read back, clamped to the sizes
    above, its source prefixed "hook:"; None when its reason, severity or labels are not understood."""
    if not isinstance(f, dict):
        return None
    reason, severity = _REASONS.get(f.get("reason", "")), _SEVERITIES.get(f.get("severity", ""))
    labels = f.get("labels", {})
    if reason is None or severity is None or not isinstance(labels, dict):
        return None
    labels = {str(k)[:MAX_LABEL_NAME]: str(v)[:MAX_LABEL_VALUE] for k, v in list(labels.items())[:MAX_FINDING_LABELS]}
    t = f.get("time")
    kwargs = {"time": float(t)} if isinstance(t, (int, float)) and not isinstance(t, bool) else {}
    return Finding(
        f"hook:{str(f.get('source', ''))[:MAX_FINDING_SOURCE]}",
        reason,
        severity,
        str(f.get("message", ""))[:MAX_FINDING_MESSAGE],
        labels,
        **kwargs,
    )
