"""Count the crossings between the agent's rooms (mscale.daemon) and the decision core
(mscale.healing) on an alert's way from the webhook to its actions (issue 24 item 4).

    PYTHONPATH=. .venv/bin/python scripts/healing_crossings.py

An agent app (not served) with one job of two MPUs on GPU 3 takes, through the webhook's
own entry (`mscale.daemon.healing.alerts`), a firing MscaleGpuFatalXid for GPU 3, its repeat,
and a firing then resolved MscaleLossSpike for the job. `sys.setprofile` sees every Python
call: a call whose caller runs in a daemon module and whose callee runs in a healing module
is a crossing down; one from healing into daemon code (a callback) a crossing back. Calls
inside either room, and the returns of the calls counted, are not counted. Printed per alert:
the calls down into healing functions, the healing data built by daemon code (dataclass
constructors: the condition, the node view's rows), the callbacks back into daemon code, and
apart from them the calls of the engine's two sinks (the event log's `emit`, the snapshot
`publish`): every booked decision is an event by design, and those carry no decision back.
The script runs on any commit that has `mscale.daemon.healing.alerts`, so the figures before
a change can be taken the same way.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog  # noqa: E402

structlog.configure(logger_factory=structlog.ReturnLoggerFactory())  # the events, not their log lines

from mscale.daemon import healing as service  # noqa: E402
from mscale.daemon import keys  # noqa: E402
from mscale.daemon.app import create_app  # noqa: E402
from mscale.daemon.config import Config  # noqa: E402
from mscale.daemon.jobs import JobState  # noqa: E402
from mscale.link import MpuInfo, Register  # noqa: E402


def _room(frame: FrameType | None) -> str:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    for room in ("mscale.daemon", "mscale.healing"):
        if name == room or name.startswith(room + "."):
            return room
    return ""


class Crossings:
    def __init__(self) -> None:
        self.down: Counter[str] = Counter()
        self.back: Counter[str] = Counter()

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        caller, callee = _room(frame.f_back), _room(frame)
        where = f"{frame.f_globals.get('__name__', '')}.{frame.f_code.co_qualname}"
        if caller == "mscale.daemon" and callee == "mscale.healing":
            self.down[where] += 1
        elif caller == "mscale.healing" and callee == "mscale.daemon":
            self.back[where] += 1


SINKS = ("EventLog.emit", "setup.<locals>.<lambda>")  # the engine's emit and publish, as the service wires them


def alert(name: str, status: str, labels: dict[str, str], fingerprint: str) -> Any:
    """The alert as the webhook hands it over (an `Alert` where the agent has the type, the
    parsed dict on commits before it)."""
    entry = {
        "status": status,
        "labels": {"alertname": name, **labels},
        "startsAt": "2026-01-01T00:00:00Z",
        "fingerprint": fingerprint,
    }
    try:
        from mscale.daemon.alert import Alert
    except ImportError:
        return entry
    return Alert.from_payload(entry, "alert")


async def main() -> None:
    app = create_app(Config(), probes=[], features=("mscale.daemon.link", "mscale.daemon.healing"))
    state = app[keys.STATE]
    job = JobState(job_id="j")
    job.register(Register("j", 0, 10, mpus=(MpuInfo("001", "vision", 3), MpuInfo("002", "text", 3))))
    job.ranks[0] = 10
    state.jobs["j"] = job
    cases = [
        ("MscaleGpuFatalXid firing", alert("MscaleGpuFatalXid", "firing", {"gpu": "3", "severity": "critical"}, "x")),
        ("MscaleGpuFatalXid repeated", alert("MscaleGpuFatalXid", "firing", {"gpu": "3", "severity": "critical"}, "x")),
        ("MscaleLossSpike firing", alert("MscaleLossSpike", "firing", {"job_id": "j", "severity": "warning"}, "l")),
        ("MscaleLossSpike resolved", alert("MscaleLossSpike", "resolved", {"job_id": "j", "severity": "warning"}, "l")),
    ]
    for what, a in cases:
        count = Crossings()
        sys.setprofile(count)
        try:
            (out,) = [o async for o in service.alerts(app, [a], source="alertmanager")]
        finally:
            sys.setprofile(None)
        data = {k: n for k, n in count.down.items() if "__create_fn__" in k}
        calls = {k: n for k, n in count.down.items() if k not in data}
        sinks = {k: n for k, n in count.back.items() if k.endswith(SINKS)}
        back = {k: n for k, n in count.back.items() if k not in sinks}
        print(
            f"{what}: {out.result}, {len(out.actions)} actions; calls down {sum(calls.values())}, "
            f"callbacks back {sum(back.values())} (data built {sum(data.values())}, sink calls {sum(sinks.values())})"
        )
        for label, table in (("down", calls), ("back", back), ("data", data), ("sink", sinks)):
            for fn, n in sorted(table.items()):
                print(f"    {label} {n:3d}  {fn}")


if __name__ == "__main__":
    asyncio.run(main())
