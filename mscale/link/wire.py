"""The link's frames and checks: sizes, identifiers, the message types, encoding and decoding,
and the field readers every message's `from_wire` is built from (each checks a field and
returns it typed, in one pass: no message is checked and then read again).

Numbers: JSON has no non-finite numbers, so NaN and the infinities travel as the strings
"nan", "inf" and "-inf" (`number` writes them, `read_num` reads them back as floats).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from mscale.findings import Finding, Reason, Severity

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
# a reported finding is clamped to these on the agent
MAX_FINDING_LABELS, MAX_LABEL_NAME, MAX_LABEL_VALUE = 32, 64, 256
MAX_FINDING_MESSAGE, MAX_FINDING_SOURCE = 1000, 32

Wire = dict[str, Any]  # one message as JSON has it


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
    HEAL = "heal"  # a healing decision for the fuse plugin (mscale.hook.fuse.fuse)
    CHAOS = "chaos"  # a fault for the chaos plugin (mscale.sim.chaos_job)


# --- frames ------------------------------------------------------------------------------------


class BadMessage(ValueError):
    """A message the protocol refuses; `why` is the refusal counter's label."""

    def __init__(self, why: str, detail: str) -> None:
        super().__init__(detail)
        self.why = why


def encode(message: Mapping[str, Any]) -> str:
    """One text frame."""
    return json.dumps(message)


def decode(data: str, max_bytes: int | None = None) -> Wire:
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
    need(isinstance(msg, dict) and isinstance(msg.get("type"), str), "expected a JSON object with a string 'type'")
    need(len(msg["type"]) <= MAX_TYPE, f"type: at most {MAX_TYPE} characters")
    return dict(msg)


def number(v: float | int | None) -> float | str | None:
    """A number as a report carries it: NaN and the infinities as "nan", "inf" and "-inf"."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else str(v)


def printable(text: object, limit: int | None = None) -> str:
    """`text` made safe to print on a terminal: every character that is not printable (escape,
    other control and format characters, line breaks) shown as its Python escape (\\x1b,
    \\u202e); cut to `limit` characters first. For strings a job sent, where a CLI prints them."""
    text = str(text)
    if limit is not None:
        text = text[:limit]
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# --- checks ------------------------------------------------------------------------------------


def need(cond: bool, detail: str, why: str = "malformed") -> None:
    if not cond:
        raise BadMessage(why, detail)


def is_int(v: object, lo: int = 0, hi: int = MAX_INT) -> bool:
    """An integer (not a bool) in lo..hi."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_num(v: object) -> bool:
    """A report number: null, a finite float, an integer within +-MAX_INT, or "nan"/"inf"/"-inf"
    (how `number` sends non-finite values). `1e400` arrives as a float infinity and is refused."""
    if v is None or isinstance(v, str):
        return v in (None, "nan", "inf", "-inf")
    if isinstance(v, float):
        return math.isfinite(v)
    return is_int(v, -MAX_INT, MAX_INT)


def is_text(v: object, lo: int, hi: int, pattern: re.Pattern[str] | None = None) -> bool:
    """A string of lo..hi characters, printable (no control, format or separator characters
    other than space, so nothing that drives a terminal), matching `pattern` if given."""
    return (
        isinstance(v, str)
        and lo <= len(v) <= hi
        and (v.isprintable() if pattern is None else bool(pattern.fullmatch(v)))
    )


def no_unknown(d: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(k)[:40] for k in d if k not in allowed)
    need(not unknown, f"{where}: unknown field(s) {', '.join(map(repr, unknown[:5]))}")


def obj(v: object, detail: str) -> Mapping[str, Any]:
    """`v` as a JSON object, else refused with `detail`."""
    need(isinstance(v, dict), detail)
    assert isinstance(v, dict)  # (for the type checker: need raised otherwise)
    return v


# --- field readers: check one field and return it typed -----------------------------------------


def read_num(d: Mapping[str, Any], k: str, detail: str, default: float = math.nan) -> float:
    """A report number as a float: NaN for null and "nan"; `default` when absent."""
    if k not in d:
        return default
    v = d[k]
    need(is_num(v), detail)
    return math.nan if v is None else float(v)


def read_amount(d: Mapping[str, Any], k: str, detail: str) -> float | None:
    """A number that may be absent (None); NaN for null and "nan"."""
    return read_num(d, k, detail) if k in d else None


def read_int(d: Mapping[str, Any], k: str, detail: str, lo: int = 0, hi: int = MAX_INT, default: int = 0) -> int:
    v = d.get(k, default)
    need(is_int(v, lo, hi), detail)
    return int(v)


def read_opt_int(d: Mapping[str, Any], k: str, detail: str, lo: int = 0, hi: int = MAX_INT) -> int | None:
    return read_int(d, k, detail, lo, hi) if k in d else None


def read_bool(d: Mapping[str, Any], k: str, detail: str, default: bool = False) -> bool:
    v = d.get(k, default)
    need(isinstance(v, bool), detail)
    return bool(v)


def read_text(
    d: Mapping[str, Any],
    k: str,
    detail: str,
    lo: int,
    hi: int,
    pattern: re.Pattern[str] | None = None,
    default: str = "",
) -> str:
    v = d.get(k, default)
    need(is_text(v, lo, hi, pattern), detail)
    return str(v)


# --- findings ----------------------------------------------------------------------------------

# what only the agent sees or decides: the GPU probe's findings, its verdicts and filings, its
# own books. A job that reports one is refused (the finding is not understood): a job's
# "gpu_xid on GPU 3" must not make the agent quarantine GPU 3 and swap other users' MPUs off it
AGENT_REASONS = frozenset(
    {
        Reason.GPU_XID,
        Reason.GPU_ECC_DBE,
        Reason.GPU_ECC_SBE_STORM,
        Reason.GPU_TEMPERATURE,
        Reason.GPU_NVLINK_DOWN,
        Reason.GPU_PCIE_REPLAY,
        Reason.GPU_LOST,
        Reason.GPU_HEALTH_CHANGED,
        Reason.GPU_RECOVERED,
        Reason.GPU_RESET_REQUIRED,
        Reason.NODE_DRAIN_REQUIRED,
        Reason.GPU_FAULT_VERDICT,
        Reason.GPU_FAULT_CLEARED,
        Reason.REMEDIATION_FILING,
        Reason.PROBE_DOWN,
        Reason.PROBE_UP,
        Reason.JOB_REGISTERED,
        Reason.JOB_GONE,
        Reason.ALERT_FIRING,
        Reason.ALERT_RESOLVED,
        Reason.CHAOS_INJECTED,
    }
)
_REASONS = {r.value: r for r in Reason if r not in AGENT_REASONS}
_SEVERITIES = {s.value: s for s in Severity}


def finding(f: object) -> Finding | None:
    """A reported finding (the job sends `Finding.to_dict()`) read back, clamped to the sizes
    above, its source prefixed "hook:"; None when its reason (one of AGENT_REASONS among
    them), severity, source (1-32 of [a-z0-9_.-]) or labels are not understood. A time that is not a finite number >= 0 is
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
    if not is_text(source, 1, MAX_FINDING_SOURCE, SOURCE):
        return None
    labels = {str(k)[:MAX_LABEL_NAME]: str(v)[:MAX_LABEL_VALUE] for k, v in list(labels.items())[:MAX_FINDING_LABELS]}
    t = f.get("time")
    kwargs = {"time": float(t)} if is_num(t) and isinstance(t, (int, float)) and t >= 0 else {}
    return Finding(f"hook:{source}", reason, severity, message[:MAX_FINDING_MESSAGE], labels, **kwargs)
