"""A standby GPU the node agrees on: the agent answers a rank's request for an L1 swap target.

A rank of a job cannot see which GPUs the other ranks (of its job or of any other) use, nor
which GPUs the node found faulty: its own choice would be blind. The rank asks over the link
(`standby_request`: the MPU, the GPU it leaves, the GPUs the job avoids; mscale.hook.fuse.standby),
and the agent answers that rank only (`standby`: a GPU index and UUID, or null and why) from
its node view. A GPU qualifies when it is:

- healthy in the GPU probe's latest snapshot (not degraded or failed: a fatal Xid, an ECC
  double-bit error, a lost GPU), and there is a snapshot at all;
- not quarantined: the agent's healing engine applied or sent a quarantine_gpu for it on this
  node, or the agent showed it at fault (gpu_fault_verdict: an SDC the fuse proved, a fatal
  Xid), until the agent restarts. Only the agent's own decisions quarantine: a job's reports
  (source `hook:...`, a quarantine_gpu its fuse applied) never do, so one user's job cannot take
  the standbys away from another's;
- not in use by another rank of any job here, nor promised a moment ago to another rank (a
  grant is held RESERVE_S seconds, until the rank re-registers on it);
- not one this MPU of this rank left before (its history here: it failed there), nor one the
  job avoids.

Without GPU data (no GPU probe snapshot) the agent has no view: it says so and the job
chooses alone. The lowest such index no MPU uses is granted, else the lowest one only this rank's other MPUs
use (a rank whose GPU failed moves all its MPUs to one standby); none: the answer says why, and the job's fuse escalates
(L2, degraded in place). Every answer is an event (heal_action, action standby, result
granted or none) with the job, rank and MPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from mscale import link as protocol
from mscale.daemon import keys
from mscale.daemon.gpus import gpu_index
from mscale.daemon.state import AgentState
from mscale.findings import Finding, Reason, Severity
from mscale.healing.words import Result

log = structlog.get_logger("mscale.standby")
SOURCE = "standby"
RESERVE_S = 60.0
NO_VIEW = "the agent has no GPU data"  # not a "none": the job chooses alone
MAX_HISTORY = 4096  # (job, mpu) pairs remembered with the GPUs they left
_BOOK = web.AppKey("standby_book", object)


@dataclass
class StandbyBook:
    """What the agent remembers between requests: quarantined GPUs, recent grants, each
    (job, rank, MPU)'s GPUs left."""

    quarantined: set[int] = field(default_factory=set)
    reserved: dict[int, tuple[float, str, int, str]] = field(default_factory=dict)  # gpu -> (until, job, rank, mpu)
    left: dict[tuple[str, int, str], set[int]] = field(default_factory=dict)

    def observe(self, f: Finding) -> None:
        """Quarantines from the agent's own healing events and verdicts (never a job's report)."""
        lab = f.labels
        if f.source.startswith("hook:"):
            return
        if (
            f.reason is Reason.HEAL_ACTION
            and lab.get("action") == "quarantine_gpu"
            and gpu_index(lab.get("gpu", ""))
            and lab.get("result") in (Result.APPLIED, Result.SENT)
        ) or (f.reason is Reason.GPU_FAULT_VERDICT and gpu_index(lab.get("gpu", ""))):
            # a GPU the fuse proved computes wrong (mscale.kube.remediation) is no standby either
            self.quarantined.add(int(lab["gpu"]))

    def choose(
        self, state: AgentState, job_id: str, rank: int, msg: protocol.StandbyRequest, now: float
    ) -> tuple[int | None, str, str]:
        """(gpu or None, its uuid, why) for one request."""
        snap = state.snapshots.get("gpu")
        gpus = {g.index: g for g in getattr(snap, "gpus", ()) or ()}
        if not gpus:
            return None, "", NO_VIEW
        self.reserved = {g: r for g, r in self.reserved.items() if r[0] > now}
        others: set[int] = set()  # GPUs of other ranks (of any job): never shared
        own: set[int] = set()  # GPUs of this rank's other MPUs: shared only when nothing is free
        for jid, job in state.jobs.items():
            for rs, m in job.iter_mpus():
                if (jid, rs.rank) != (job_id, rank):
                    others.add(m.gpu)
                elif m.mpu_id != msg.mpu_id:
                    own.add(m.gpu)
        key = (job_id, rank, msg.mpu_id)
        history = self.left.get(key, set())
        out = {
            "unhealthy": {i for i, g in gpus.items() if getattr(g, "health", "healthy") != "healthy"},
            "quarantined": self.quarantined & set(gpus),
            "in use by another rank": others & set(gpus),
            "promised to another rank": {g for g, r in self.reserved.items() if r[1:3] != (job_id, rank)},
            "left before by this MPU": history,
            "avoided by the job": set(msg.avoid) | {msg.gpu},
        }
        usable = set(gpus) - set().union(*out.values())
        free = sorted(usable - own) or sorted(usable & own)
        if not free:
            why = "; ".join(f"{what}: {', '.join(map(str, sorted(g)))}" for what, g in out.items() if g)
            return None, "", f"no standby among {len(gpus)} GPUs ({why})"
        gpu = free[0]
        self.reserved[gpu] = (now + RESERVE_S, job_id, rank, msg.mpu_id)
        if key in self.left or len(self.left) < MAX_HISTORY:
            self.left.setdefault(key, set()).add(msg.gpu)
        return gpu, str(getattr(gpus[gpu], "uuid", "") or ""), "healthy, not quarantined, not in use"


def setup(app: web.Application) -> None:
    book = StandbyBook()
    app[_BOOK] = book
    state: AgentState = app[keys.STATE]
    state.events.on_emit(book.observe)
    link = app.get(keys.LINK)
    if link is None:
        return

    async def handle(job: Any, wire: dict[str, Any], rank: int) -> None:
        msg = protocol.StandbyRequest.from_wire(wire)
        gpu, uuid, why = book.choose(state, job.job_id, rank, msg, time.monotonic())
        granted = gpu is not None
        state.events.emit(
            Finding(
                SOURCE,
                Reason.HEAL_ACTION,
                Severity.INFO if granted else Severity.WARNING,
                f"standby for job {job.job_id} rank {rank} MPU {msg.mpu_id} leaving GPU {msg.gpu}: "
                + (f"GPU {gpu}" if granted else "none")
                + f" ({why})",
                {
                    "action": "standby",
                    "result": "granted" if granted else "none",
                    "job_id": job.job_id,
                    "rank": str(rank),
                    "mpu_id": msg.mpu_id,
                    "gpu": str(msg.gpu),
                    **({"standby_gpu": str(gpu)} if granted else {}),
                },
            )
        )
        reply = protocol.Standby(msg.id, gpu, uuid, why, decided=why != NO_VIEW)
        await link.send(job.job_id, reply, ranks=[rank])

    link.on_message(protocol.STANDBY_REQUEST, handle, with_rank=True)
