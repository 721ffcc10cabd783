"""The hand-off's memory across agent restarts (`remediation.state_file`): the open faults and
what each filer holds filed, as one small JSON file written atomically after every change.

Without it a restart forgets an SDC verdict (the probe never saw anything wrong with the GPU):
the node condition would turn healthy and a filing would never be undone. A fault read back
keeps its boot id, so a reboot since (every GPU reset) counts as the reset its undo waits for.
The file is the agent's own (its state directory); still:

- the writer writes only what the reader accepts (`storable`: the verdict book opens no fault
  that would not read back, and `save` leaves out any that would not);
- what is read back is checked record by record and bounded: a record that does not pass is
  dropped with a log line, the others kept; a file that is not this agent's at all (not JSON,
  another version, oversized) is set aside (`.bad`);
- the path must be a regular file (or absent): a FIFO, a device, a directory or a link there
  is refused (StateFileRefused: the agent does not start), never opened for long, read,
  renamed or replaced.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import structlog

from mscale.kube.remediation.verdicts import (
    FACT_KEYS,
    FACT_VALUE,
    GPU_UUID,
    KINDS,
    MAX_FAULTS,
    MAX_MESSAGE,
    Fault,
)

log = structlog.get_logger("mscale.remediation")

VERSION = 1
MAX_BYTES = 4 << 20
_TEXT = 1024


class LedgerError(ValueError):
    """The state file is not one this agent wrote."""


class StateFileRefused(LedgerError):
    """Something other than a regular file is at the state file's path."""


def to_dict(f: Fault) -> dict[str, Any]:
    return {
        "kind": f.kind,
        "gpu": f.gpu,
        "gpu_uuid": f.gpu_uuid,
        "reason": f.reason,
        "action": f.action,
        "message": f.message,
        "since": f.since,
        "boot_id": f.boot_id,
        "facts": dict(f.facts),
    }


def _text(d: dict[str, Any], key: str, limit: int = _TEXT) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > limit:
        raise LedgerError(f"{key}: expected a string of at most {limit} characters")
    return v


def from_dict(d: Any) -> Fault:
    if not isinstance(d, dict):
        raise LedgerError("a fault: expected an object")
    kind = _text(d, "kind", 8)
    if kind not in KINDS:
        raise LedgerError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    gpu, since, facts = d.get("gpu"), d.get("since"), d.get("facts")
    if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < 4096:
        raise LedgerError("gpu: expected a GPU index")
    if not isinstance(since, (int, float)) or isinstance(since, bool) or not math.isfinite(since):
        raise LedgerError("since: expected a time")
    if not isinstance(facts, dict) or not all(
        k in FACT_KEYS and isinstance(v, str) and FACT_VALUE.fullmatch(v) for k, v in facts.items()
    ):
        raise LedgerError(f"facts: expected {', '.join(sorted(FACT_KEYS))}, each a short name")
    uuid = _text(d, "gpu_uuid", 128)
    if not GPU_UUID.fullmatch(uuid):
        raise LedgerError("gpu_uuid: expected a GPU UUID")
    message = _text(d, "message", MAX_MESSAGE)
    if not message.isprintable():
        raise LedgerError("message: expected printable text")
    return Fault(
        kind,
        gpu,
        uuid,
        _text(d, "reason", 64),
        _text(d, "action", 64),
        message,
        float(since),
        _text(d, "boot_id", 64),
        0,
        dict(facts),
    )


def storable(f: Fault) -> bool:
    """Whether the reader takes this fault back (what the writer may write)."""
    try:
        from_dict(json.loads(json.dumps(to_dict(f))))
    except (LedgerError, ValueError):
        return False
    return True


def _kept(faults: tuple[Fault, ...]) -> list[dict[str, Any]]:
    out = []
    for f in faults:
        if storable(f):
            out.append(to_dict(f))
        else:
            log.error("remediation_state_record_left_out", gpu=f.gpu, kind=f.kind)
    return out


def check(path: str) -> None:
    """StateFileRefused when something other than a regular file (or nothing) is at `path`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise StateFileRefused(f"remediation.state_file: {path}: cannot stat: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StateFileRefused(f"remediation.state_file: {path}: {_kind(st.st_mode)}, not a regular file: refused")


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def save(path: str, faults: tuple[Fault, ...], filed: dict[str, tuple[Fault, ...]]) -> None:
    """Write atomically (a temporary file renamed over the old one, fsynced): a crash leaves the
    old or the new. Only records the reader takes are written; nothing replaces a path that is
    not a regular file (StateFileRefused)."""
    doc = {
        "version": VERSION,
        "faults": _kept(faults),
        "filed": {name: _kept(held) for name, held in filed.items()},
    }
    check(path)
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise StateFileRefused(f"remediation.state_file: {tmp} is not a regular file")
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def _read(path: str) -> bytes | None:
    """The file's bytes (None: no file); never blocks on a FIFO, never reads a device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        check(path)  # a link (ELOOP) is refused as such
        raise LedgerError(f"cannot open: {e}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise StateFileRefused(f"remediation.state_file: {path}: {_kind(mode)}, not a regular file: refused")
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise LedgerError(f"larger than {MAX_BYTES} bytes")
    return raw


def _records(items: list[Any], where: str, dropped: list[str]) -> list[Fault]:
    """The records that pass; each one that does not is named in `dropped`."""
    out = []
    for i, d in enumerate(items):
        try:
            out.append(from_dict(d))
        except LedgerError as e:
            dropped.append(f"{where}[{i}]: {e}")
    return out


def load(path: str) -> tuple[list[Fault], dict[str, list[Fault]], list[str]]:
    """(open faults, filer -> the faults it holds filed: an undo still owed is among them,
    the records dropped and why); nothing when there is no file yet. LedgerError: the file as a
    whole is not one this agent wrote; StateFileRefused: not a regular file."""
    raw = _read(path)
    if raw is None:
        return [], {}, []
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise LedgerError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise LedgerError(f"expected a version {VERSION} state file")
    items, filed_doc = doc.get("faults"), doc.get("filed")
    if not isinstance(items, list) or len(items) > MAX_FAULTS:
        raise LedgerError(f"faults: expected a list of at most {MAX_FAULTS}")
    if not isinstance(filed_doc, dict) or len(filed_doc) > 64:
        raise LedgerError("filed: expected an object of at most 64 filers")
    dropped: list[str] = []
    filed: dict[str, list[Fault]] = {}
    for name, held in filed_doc.items():
        if not isinstance(held, list) or len(held) > MAX_FAULTS:
            raise LedgerError(f"filed.{str(name)[:64]}: expected a list of at most {MAX_FAULTS} faults")
        filed[str(name)[:64]] = _records(held, f"filed.{str(name)[:64]}", dropped)
    return _records(items, "faults", dropped), filed, dropped
