"""The link protocol: what the hook library and the node agent say to each other, in one place.

SHARED: imported by the agent's socket server (mscale.daemon.link), the job's client
(mscale.hook.core.link), the guard and the plugins that take commands, and by the CLIs for the
agent's default address. Pure Python, no torch, no aiohttp. May import: findings.

Its modules, each at a seam: `wire` (frames, sizes, the message types, the field readers),
`messages` (register, step report, MPU report and the small answers), `commands` (heal,
chaos, standby), `contract` (contract and MSRP). Every message is one dataclass with
`to_wire()` and `from_wire(msg)`; `from_wire` checks and reads in one pass. This package
names them all; the agent's default address is here.

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
its `from_wire` is refused with an error frame; the connection and other jobs go on. (A
frame over twice the limit cannot be read: the agent closes the connection, code 1009.)

The readers are a strict schema: the fields each message may carry (REGISTER_FIELDS,
MPU_FIELDS, REPORT_FIELDS, STEP_FIELDS, MPU_REPORT_FIELDS) and no others; steps, counters and
sizes integers in 0..MAX_INT, ranks, pids and GPU indexes in their ranges, other numbers finite
(non-finite ones only as the strings "nan", "inf", "-inf"); strings bounded, identifiers in a
fixed charset, names printable (`printable` escapes what a CLI prints anyway).
"""

from __future__ import annotations

import os

from mscale.link.commands import (
    CHAOS_FIELDS,
    CHAOS_JOB_KINDS,
    CHAOS_KINDS,
    CHAOS_MODES,
    HEAL_FIELDS,
    MAX_AVOID,
    STANDBY,
    STANDBY_REQUEST,
    STANDBY_REQUEST_FIELDS,
    Chaos,
    Heal,
    Ping,
    Standby,
    StandbyRequest,
    check_command,
)
from mscale.link.contract import CONTRACT, MSRP, PLAN_FIELDS, PLAN_TABLES, Contract, Msrp
from mscale.link.messages import (
    CHECK_FIGURES,
    MPU_FIELDS,
    MPU_REPORT_FIELDS,
    NAMESPACE,
    POD_FIELDS,
    POD_NAME,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    REGISTER_FIELDS,
    REPORT_FIELDS,
    STEP_FIELDS,
    TIME_CAUSES,
    Error,
    MpuInfo,
    MpuReport,
    Pod,
    Pong,
    Register,
    Registered,
    Reply,
    Report,
    StepReport,
    pod_from_env,
)
from mscale.link.wire import (
    ACCEPTED_SILENTLY,
    FUSE_LEVEL,
    GPU_UUID,
    JOB_ID,
    MAX_BATCH,
    MAX_FINDING_LABELS,
    MAX_FINDING_MESSAGE,
    MAX_FINDING_SOURCE,
    MAX_FINDINGS,
    MAX_GPU_INDEX,
    MAX_INT,
    MAX_LABEL_NAME,
    MAX_LABEL_VALUE,
    MAX_MESSAGE_BYTES,
    MAX_MPUS,
    MAX_PID,
    MAX_RANK,
    MAX_REPORTS,
    MAX_TYPE,
    MPU_ID,
    RESERVED,
    BadMessage,
    Command,
    Msg,
    Wire,
    decode,
    encode,
    finding,
    number,
    printable,
)

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


__all__ = [
    "ACCEPTED_SILENTLY",
    "AGENT_UID_ENV",
    "CHAOS_FIELDS",
    "CHAOS_JOB_KINDS",
    "CHAOS_KINDS",
    "CHAOS_MODES",
    "CHECK_FIGURES",
    "CONTRACT",
    "DEFAULT_HOST",
    "DEFAULT_LISTEN",
    "DEFAULT_PORT",
    "DEFAULT_SOCKET",
    "DEFAULT_URL",
    "FUSE_LEVEL",
    "GPU_UUID",
    "HEAL_FIELDS",
    "JOB_ID",
    "MAX_AVOID",
    "MAX_BATCH",
    "MAX_FINDINGS",
    "MAX_FINDING_LABELS",
    "MAX_FINDING_MESSAGE",
    "MAX_FINDING_SOURCE",
    "MAX_GPU_INDEX",
    "MAX_INT",
    "MAX_LABEL_NAME",
    "MAX_LABEL_VALUE",
    "MAX_MESSAGE_BYTES",
    "MAX_MPUS",
    "MAX_PID",
    "MAX_RANK",
    "MAX_REPORTS",
    "MAX_TYPE",
    "MAX_UID",
    "MPU_FIELDS",
    "MPU_ID",
    "MPU_REPORT_FIELDS",
    "MSRP",
    "NAMESPACE",
    "PATH",
    "PLAN_FIELDS",
    "PLAN_TABLES",
    "POD_FIELDS",
    "POD_NAME",
    "POD_NAMESPACE_ENV",
    "POD_NAME_ENV",
    "REGISTER_FIELDS",
    "REPORT_FIELDS",
    "RESERVED",
    "SOCKET_ENV",
    "STANDBY",
    "STANDBY_REQUEST",
    "STANDBY_REQUEST_FIELDS",
    "STEP_FIELDS",
    "TIME_CAUSES",
    "BadMessage",
    "Chaos",
    "Command",
    "Contract",
    "Error",
    "Heal",
    "MpuInfo",
    "MpuReport",
    "Msg",
    "Msrp",
    "Ping",
    "Pod",
    "Pong",
    "Register",
    "Registered",
    "Reply",
    "Report",
    "Standby",
    "StandbyRequest",
    "StepReport",
    "Wire",
    "agent_uids",
    "check_command",
    "decode",
    "encode",
    "finding",
    "number",
    "pod_from_env",
    "printable",
    "socket_path",
]
