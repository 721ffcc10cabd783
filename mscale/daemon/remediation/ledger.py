"""The hand-off's memory across agent restarts (`remediation.state_file`): the open faults and
what each filer holds filed, as one small JSON file written atomically after every change.

Without it a restart forgets an SDC verdict (the probe never saw anything wrong with the GPU):
the node condition would turn healthy and a filing would never be undone. A fault read back
keeps its boot id, so a reboot since (every GPU reset) counts as the reset its undo waits for.
The file is the agent's own (its state directory); still, what is read back is checked field by
field and bounded, and a file that does not pass is set aside (`.bad`) with a log line, never
trusted in part.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from mscale.daemon.remediation.verdicts import KINDS, MAX_FAULTS, Fault

VERSION = 1
MAX_BYTES = 4 << 20
_TEXT = 1024


class LedgerError(ValueError):
    """The state file is not one this agent wrote."""


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
    if (
        not isinstance(facts, dict)
        or len(facts) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 256 for k, v in facts.items()
        )
    ):
        raise LedgerError("facts: expected at most 16 short strings")
    uuid = _text(d, "gpu_uuid", 128)
    if not uuid:
        raise LedgerError("gpu_uuid: empty")
    return Fault(
        kind,
        gpu,
        uuid,
        _text(d, "reason", 64),
        _text(d, "action", 64),
        _text(d, "message"),
        float(since),
        _text(d, "boot_id", 64),
        0,
        dict(facts),
    )


def save(path: str, faults: tuple[Fault, ...], filed: dict[str, tuple[Fault, ...]]) -> None:
    """Write atomically (a temporary file renamed over the old one, fsynced): a crash leaves the old or the new."""
    doc = {
        "version": VERSION,
        "faults": [to_dict(f) for f in faults],
        "filed": {name: [to_dict(f) for f in held] for name, held in filed.items()},
    }
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def load(path: str) -> tuple[list[Fault], dict[str, list[Fault]]]:
    """(open faults, filer -> the faults it holds filed: an undo still owed is among them);
    nothing when there is no file yet."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return [], {}
    except OSError as e:
        raise LedgerError(f"cannot open: {e}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise LedgerError(f"larger than {MAX_BYTES} bytes")
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
    filed: dict[str, list[Fault]] = {}
    for name, held in filed_doc.items():
        if not isinstance(held, list) or len(held) > MAX_FAULTS:
            raise LedgerError(f"filed.{str(name)[:64]}: expected a list of at most {MAX_FAULTS} faults")
        filed[str(name)[:64]] = [from_dict(d) for d in held]
    return [from_dict(d) for d in items], filed
