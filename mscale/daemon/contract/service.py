"""The agent's side of resource contracts: plans and MSRP from jobs, compliance checks, the API.

A job whose contract is in force sends its plan over the link ({"type": "contract"},
mscale.link.Contract.from_wire) and, with MSRP on, its measured profiles ({"type": "msrp"}).
Every `contract.check_interval_s` (and at once when a plan arrives) the agent reads the job's
tasks in /proc (mscale.daemon.compliance, in a worker thread under `contract.check_timeout_s`)
and publishes an immutable `ContractSnapshot` at state.snapshots["contract"], which the
exporters read. A thread leaving its CPUs is a `contract_violated` finding, coming back a
`contract_compliant` one. A plan goes with its job (when the link expires it). At most
`contract.max_contracts` plans are kept; past that a new one is refused (contract_limit).

GET /api/v1/contracts lists them, GET /api/v1/contracts/{id} one (contract id or job id):
`mscale contract status [ID]`. The density and thermal guard (mscale.daemon.density) runs
here too, over the MSRP the jobs report; its results ride in the snapshot's `extra["density"]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import structlog
from aiohttp import web

from mscale import link as protocol
from mscale.daemon import compliance, keys
from mscale.daemon.density import DensityGuard
from mscale.daemon.gpus import gpus_by_index
from mscale.daemon.jobs import JobState
from mscale.findings import Finding, Reason, Severity
from mscale.link import BadMessage
from mscale.tasks import cancel_and_wait

log = structlog.get_logger("mscale.contract")


@dataclass(frozen=True)
class ContractRecord:
    """One (job, rank)'s plan and what the agent last saw of it. Replaced, never changed."""

    job_id: str
    rank: int
    pid: int
    plan: dict[str, Any]
    received_at: float
    checked_at: float = 0.0
    threads: tuple[compliance.ThreadCompliance, ...] = ()
    msrp: dict[str, Any] | None = None
    msrp_at: float = 0.0

    @property
    def contract_id(self) -> str:
        return str(self.plan.get("contract_id", ""))

    @property
    def compliant(self) -> bool | None:
        """True: every thread where its plan says; False: one is not; None: not checked yet
        or a thread not started."""
        if not self.checked_at or any(t.state == "absent" for t in self.threads):
            return False if any(t.state == "violated" for t in self.threads) else None
        return all(t.state == "compliant" for t in self.threads)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "rank": self.rank,
            "pid": self.pid,
            "contract_id": self.contract_id,
            "compute_profile": self.plan.get("compute_profile", ""),
            "compliant": self.compliant,
            "checked_at": self.checked_at or None,
            "threads": [t.to_dict() for t in self.threads],
            "plan": self.plan,
            "msrp": self.msrp,
        }


@dataclass(frozen=True)
class ContractSnapshot:
    time: float
    records: tuple[ContractRecord, ...] = ()
    checks_total: int = 0
    check_errors_total: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # what other guards publish beside (density)


CONTRACTS: web.AppKey[ContractService] = web.AppKey("contracts")


class ContractService:
    def __init__(self, app: web.Application, proc_root: str = "/proc") -> None:
        self.config = app[keys.CONFIG].contract
        self.state = app[keys.STATE]
        self.clock = app[keys.CLOCK]
        self.proc_root = proc_root
        self.records: dict[tuple[str, int], ContractRecord] = {}
        self.checks_total = 0
        self.check_errors_total = 0
        self.extra: dict[str, Any] = {}
        self.density = DensityGuard(self.config, self.state.events.emit)
        self._wake = asyncio.Event()

    # --- link messages ------------------------------------------------------------------

    def on_contract(self, job: JobState, wire: dict[str, Any]) -> None:
        msg = protocol.Contract.from_wire(wire)
        self._own(job, msg)
        key = (job.job_id, msg.rank)
        if key not in self.records and len(self.records) >= self.config.max_contracts:
            raise BadMessage("contract_limit", f"contract: {len(self.records)} plans kept (contract.max_contracts)")
        pid = job.ranks.get(msg.rank, job.pid)
        self.records[key] = ContractRecord(job.job_id, msg.rank, pid, dict(msg.plan), self.clock())
        log.info("contract_received", job_id=job.job_id, rank=msg.rank, contract_id=msg.plan["contract_id"])
        self._publish()
        self._wake.set()

    def on_msrp(self, job: JobState, wire: dict[str, Any]) -> None:
        msg = protocol.Msrp.from_wire(wire)
        self._own(job, msg)
        key = (job.job_id, msg.rank)
        profile = {"gpus": dict(msg.gpus), "mpus": dict(msg.mpus)}
        old = self.records.get(key)
        if old is None:  # MSRP without a contract: kept under an empty plan, so it is exported too
            if len(self.records) >= self.config.max_contracts:
                raise BadMessage("contract_limit", "msrp: contract.max_contracts reached")
            old = ContractRecord(job.job_id, msg.rank, job.pid, {}, self.clock())
        self.records[key] = replace(old, msrp=profile, msrp_at=self.clock())
        self._publish()

    @staticmethod
    def _own(job: JobState, msg: protocol.Contract | protocol.Msrp) -> None:
        if msg.job_id != job.job_id:
            kind = protocol.CONTRACT if isinstance(msg, protocol.Contract) else protocol.MSRP
            raise BadMessage("malformed", f"{kind}: job_id is not this connection's job")

    # --- checks ----------------------------------------------------------------------------

    def _forget_gone(self) -> None:
        for key in [k for k in self.records if k[0] not in self.state.jobs]:
            del self.records[key]

    def _read(self, records: list[ContractRecord]) -> dict[tuple[str, int], tuple[Any, ...]]:
        return {
            (r.job_id, r.rank): tuple(compliance.check(r.plan, r.pid, self.proc_root))
            for r in records
            if r.plan.get("threads")
        }

    async def check_once(self) -> None:
        self._forget_gone()
        records = list(self.records.values())
        try:
            async with asyncio.timeout(self.config.check_timeout_s):  # not wait_for: see ProbeRunner.sample_once
                results = await asyncio.to_thread(self._read, records)
        except TimeoutError:
            self.check_errors_total += 1
            log.warning("contract_check_timeout", timeout_s=self.config.check_timeout_s)
            return
        self.checks_total += 1
        now = self.clock()
        read = {(r.job_id, r.rank): r for r in records}
        for key, threads in results.items():
            old = self.records.get(key)
            if old is None or old.plan is not read[key].plan:
                continue  # replaced or gone while read
            new = replace(old, threads=threads, checked_at=now)
            self.records[key] = new
            self._transition(old, new)
        self._publish()

    def _transition(self, old: ContractRecord, new: ContractRecord) -> None:
        was, now = old.compliant, new.compliant
        if now is False and was is not False:
            bad = [t for t in new.threads if t.state == "violated"]
            detail = "; ".join(
                f"{t.name} should run on {t.expected}, "
                + ", ".join(f"task {tid} runs on {cpus}" for tid, cpus in t.violations[:4])
                for t in bad
            )
            self._emit(new, Reason.CONTRACT_VIOLATED, Severity.WARNING, f"contract {new.contract_id}: {detail}")
        elif now is True and was is not True:
            self._emit(
                new, Reason.CONTRACT_COMPLIANT, Severity.INFO, f"contract {new.contract_id}: every thread pinned"
            )

    def _emit(self, r: ContractRecord, reason: Reason, severity: Severity, message: str) -> None:
        labels = {"job_id": r.job_id, "rank": str(r.rank), "contract_id": r.contract_id}
        self.state.events.emit(Finding("contract", reason, severity, message[:1000], labels))

    def _publish(self) -> None:
        self.state.publish(
            "contract",
            ContractSnapshot(
                self.clock(),
                tuple(self.records.values()),
                self.checks_total,
                self.check_errors_total,
                dict(self.extra),
            ),
        )

    async def run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception as e:  # a check must never stop the agent's other work
                self.check_errors_total += 1
                log.error("contract_check_failed", error=f"{type(e).__name__}: {e}"[:300])
            self._wake.clear()
            try:
                async with asyncio.timeout(self.config.check_interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def run_density(self) -> None:
        """The density and thermal guard (mscale.daemon.density), every contract.density_interval_s."""
        while True:
            await asyncio.sleep(self.config.density_interval_s)
            try:
                self.extra["density"] = self.density.evaluate(
                    list(self.records.values()), self.state.jobs, gpus_by_index(self.state), self.clock()
                )
                self.extra["density_findings_total"] = self.density.findings_total
            except Exception as e:  # the guard must never stop the agent's other work
                log.error("density_check_failed", error=f"{type(e).__name__}: {e}"[:300])
            self._publish()

    def find(self, key: str) -> list[ContractRecord]:
        return [r for r in self.records.values() if key in (r.contract_id, r.job_id)]


def _view(service: ContractService, records: list[ContractRecord]) -> dict[str, Any]:
    """The records as the API shows them, each with its MPUs' latest density comparison."""
    density = service.extra.get("density", ())
    out = []
    for r in records:
        d = r.to_dict()
        d["density"] = [asdict(m) for m in density if (m.job_id, m.rank) == (r.job_id, r.rank)]
        out.append(d)
    return {"contracts": out}


async def list_contracts(request: web.Request) -> web.Response:
    service = request.app[CONTRACTS]
    return web.json_response(_view(service, list(service.records.values())))


async def one_contract(request: web.Request) -> web.Response:
    key = request.match_info["id"][:140]
    service = request.app[CONTRACTS]
    found = service.find(key)
    if not found:
        raise web.HTTPNotFound(text=f"no contract or job {protocol.printable(key, 140)!r}\n")
    return web.json_response(_view(service, found))


def setup(app: web.Application) -> None:
    service = ContractService(app)
    app[CONTRACTS] = service
    link = app.get(keys.LINK)
    if link is not None:
        link.on_message(protocol.CONTRACT, service.on_contract)
        link.on_message(protocol.MSRP, service.on_msrp)
    app.router.add_get("/api/v1/contracts", list_contracts)
    app.router.add_get("/api/v1/contracts/{id}", one_contract)
    app.cleanup_ctx.append(_run)


async def _run(app: web.Application) -> AsyncIterator[None]:
    tasks = [asyncio.ensure_future(app[CONTRACTS].run()), asyncio.ensure_future(app[CONTRACTS].run_density())]
    yield
    await cancel_and_wait(tasks)
