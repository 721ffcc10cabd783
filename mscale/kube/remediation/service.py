"""The agent's remediation hand-off: the verdict book fed by the jobs' healing events and the GPU
probe, and the enabled filers kept in step with it.

Every turn (each batch of healing events that opens a fault, and every `remediation.interval_s`)
the service reconciles: each open fault not yet filed with a filer that takes its kind is filed,
the probe's fatal Xids first, each filing whose fault was undone is cleared. Per filer and fault
one filing (idempotent: the filers treat "already there" as filed); a failure is retried after
`retry_interval_s`; at most `max_filings_per_hour` filings per filer and source, the jobs'
proofs (`sdc`) apart from the GPU probe's fatal Xids (`xid`), so a fatal Xid never waits behind
the jobs' proofs (undos are not limited: they only give capacity back); the rest wait, counted.
Each file and clear is a finding (remediation_filing) and counted in
`mscale_remediation_filings_total`; the open faults and filings are written to
`remediation.state_file` once per turn that changed them (mscale.kube.remediation.ledger): the
events waiting when a turn begins (at most BATCH) are taken together, one write for all. A filer's calls are awaited on the agent's loop: the
Kubernetes calls run in a thread under the request deadline, the command as a subprocess
under its own; neither blocks the loop, nor can one stop the agent.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from mscale.findings import Finding, Reason, Severity
from mscale.kube.remediation import REGISTRY, ledger, spec
from mscale.kube.remediation.base import FilerContext, FilingFailed
from mscale.kube.remediation.verdicts import XID, Fault, VerdictBook, boot_id
from mscale.tasks import cancel_and_wait

log = structlog.get_logger("mscale.remediation")
SOURCE = "remediation"
SNAPSHOT = "remediation"  # AgentState.snapshots key of the RemediationStatus
_EVIDENCE = (Reason.HEAL_ACTION, Reason.FUSE_STATE)
BATCH = 4096  # events taken into the book before one reconcile (and one state write)


@dataclass(frozen=True)
class RemediationStatus:
    """What the exporter and the API read (immutable: a new one after every change)."""

    faults: tuple[Fault, ...] = ()
    filed: Mapping[str, tuple[Fault, ...]] = field(default_factory=dict)  # filer -> its filings
    filings: Mapping[tuple[str, str, str], int] = field(default_factory=dict)  # (filer, event, result) -> n
    command_exit: Mapping[str, int] = field(default_factory=dict)  # event -> last exit status
    filers_down: tuple[str, ...] = ()


class RemediationService:
    def __init__(
        self,
        state: Any,
        cfg: Any,
        filers: list[Any],
        *,
        clock: Callable[[], float] = time.time,
        boot: str | None = None,
    ) -> None:
        self.state, self.cfg, self.filers, self.clock = state, cfg, filers, clock
        self.book = VerdictBook(
            clear_healthy_checks=cfg.clear_healthy_checks,
            emit=state.events.emit,
            clock=clock,
            boot=boot_id() if boot is None else boot,
            admit=ledger.storable,  # the writer writes only what the reader takes back
        )
        self.filed: dict[str, dict[tuple[str, str], Fault]] = {f.name: {} for f in filers}
        self.retry_at: dict[tuple[str, str, tuple[str, str]], float] = {}
        # (filer, kind) -> its filings in the last hour: a budget per source (jobs' sdc, the probe's xid)
        self.file_times: dict[tuple[str, str], deque[float]] = {}
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.started: set[str] = set()
        self.deferred: dict[str, set[tuple[str, str]]] = {f.name: set() for f in filers}
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._queue: asyncio.Queue[Finding] | None = None
        self.command_exit: dict[str, int] = {}  # the command filer's last exit status by event
        self._saved: list[Any] | None = None  # what the state file holds now
        if cfg.state_file:
            self._restore(cfg.state_file)
        self.publish()

    # --- turns -----------------------------------------------------------------------------

    async def observe(self, f: Finding) -> None:
        """A finding: a job's healing event may open an SDC fault, filed at once."""
        if self.take(f):
            await self.reconcile()

    def take(self, f: Finding) -> bool:
        """Into the book, no reconcile: whether it opened a fault."""
        if f.reason not in _EVIDENCE:
            return False
        return self.book.observe(f, self.state.snapshots.get("gpu")) is not None

    async def turn(self) -> None:
        """A health check of the open faults (opens fatal-Xid ones, undoes reset-and-healthy ones), then reconcile."""
        snap = self.state.snapshots.get("gpu")
        if snap is not None:
            self.book.check(snap)
        await self.reconcile()

    async def reconcile(self) -> None:
        async with self._lock:
            # the probe's fatal Xids first: a filer's slow run for a job's proof never holds one back
            want = {f.key: f for f in sorted(self.book.faults(), key=lambda f: f.kind != XID)}
            for filer in self.filers:
                if filer.name not in self.started and not await self._start(filer):
                    continue
                filed = self.filed[filer.name]
                for key, fault in list(filed.items()):
                    if key not in want:
                        await self._do(filer, "clear", fault)
                for key, fault in want.items():
                    if fault.kind in filer.kinds and key not in filed:
                        await self._file(filer, fault)
                self.deferred[filer.name] &= set(want)
            await self._save()
            self.publish()

    def _restore(self, path: str) -> None:
        """Read the state file back; StateFileRefused (not a regular file) stops the agent."""
        try:
            faults, filed, dropped = ledger.load(path)
        except ledger.StateFileRefused:
            raise
        except ledger.LedgerError as e:  # not this agent's file at all: set aside, start empty
            log.error("remediation_state_unreadable", path=path, error=str(e)[:300])
            try:
                os.replace(path, path + ".bad")
            except OSError:
                pass
            return
        for why in dropped[:16]:  # one bad record costs that record, not the others
            log.error("remediation_state_record_dropped", path=path, error=why[:300])
        if dropped:
            self.counts[("state", "load", "dropped")] += len(dropped)
        for f in faults:
            self.book.adopt(f)
        for name, held in filed.items():
            if name in self.filed:
                self.filed[name] = {f.key: f for f in held}
            elif held:
                log.warning("remediation_filer_gone", filer=name, filings=len(held))
        self._saved = self._doc()
        log.info("remediation_state_restored", path=path, faults=len(faults))

    def _doc(self) -> list[Any]:
        return [ledger.to_dict(f) for f in self.book.faults()] + [
            (name, sorted(d)) for name, d in sorted(self.filed.items())
        ]

    async def _save(self) -> None:
        doc = self._doc()
        if not self.cfg.state_file or doc == self._saved:
            return
        faults, filed = self.book.faults(), {n: tuple(d.values()) for n, d in self.filed.items()}
        try:
            async with asyncio.timeout(10):
                await asyncio.to_thread(ledger.save, self.cfg.state_file, faults, filed)
        except (OSError, TimeoutError, ledger.LedgerError) as e:  # kept in memory; tried again after the next change
            self.counts[("state", "save", "failed")] += 1
            log.error("remediation_state_save_failed", path=self.cfg.state_file, error=str(e)[:300])
            return
        self._saved = doc

    async def _start(self, filer: Any) -> bool:
        try:
            await filer.start()
        except Exception as e:  # no API yet, no service account: tried again next turn
            self.counts[(filer.name, "start", "failed")] += 1
            log.error("remediation_filer_unavailable", filer=filer.name, error=str(e)[:300])
            return False
        self.started.add(filer.name)
        if getattr(filer, "in_memory", False):  # what it filed lives in this process: file again what was restored
            for fault in self.filed[filer.name].values():
                await filer.file(fault)
        return True

    async def _file(self, filer: Any, fault: Fault) -> None:
        now = self.clock()
        if self.retry_at.get((filer.name, "file", fault.key), 0.0) > now:
            return
        times = self.file_times.setdefault((filer.name, fault.kind), deque())
        while times and now - times[0] >= 3600:
            times.popleft()
        if len(times) >= self.cfg.max_filings_per_hour:
            if fault.key not in self.deferred[filer.name]:  # counted once per fault it holds back
                self.deferred[filer.name].add(fault.key)
                why = f"over remediation.max_filings_per_hour for {fault.kind} faults"
                self._record(filer.name, "file", "deferred", fault, why)
            return
        times.append(now)
        await self._do(filer, "file", fault)

    async def _do(self, filer: Any, event: str, fault: Fault) -> None:
        key = (filer.name, event, fault.key)
        try:
            result = await (filer.file(fault) if event == "file" else filer.clear(fault))
        except Exception as e:
            labels = e.labels if isinstance(e, FilingFailed) else {}
            if not isinstance(e, FilingFailed):
                log.exception("remediation_filer_error", filer=filer.name, filing=event)
            self.retry_at[key] = self.clock() + self.cfg.retry_interval_s
            self._record(filer.name, event, "failed", fault, str(e)[:500], labels)
            return
        finally:
            exits = getattr(filer, "last_exit", None)
            if exits:
                self.command_exit = dict(exits)
        self.retry_at.pop(key, None)
        self.deferred[filer.name].discard(fault.key)
        if event == "file":
            self.filed[filer.name][fault.key] = fault
        else:
            self.filed[filer.name].pop(fault.key, None)
        self._record(
            filer.name,
            event,
            result,
            fault,
            "",
            {"exit_code": str(self.command_exit[event])} if filer.name == "command" else None,
        )

    def _record(
        self, filer: str, event: str, result: str, fault: Fault, why: str, extra: Mapping[str, str] | None = None
    ) -> None:
        self.counts[(filer, event, result)] += 1
        failed = result in ("failed", "deferred")
        what = "filed" if event == "file" else "undone"
        self.state.events.emit(
            Finding(
                SOURCE,
                Reason.REMEDIATION_FILING,
                Severity.WARNING if failed else Severity.INFO,
                f"{filer}: GPU {fault.gpu} ({fault.gpu_uuid}) {fault.reason} "
                + (f"not {what}: {result}: {why}" if failed else f"{what} ({result})"),
                {
                    "filer": filer,
                    "event": event,
                    "result": result,
                    "gpu": str(fault.gpu),
                    "gpu_uuid": fault.gpu_uuid,
                    "kind": fault.kind,
                    **(extra or {}),
                },
                self.clock(),
            )
        )

    def publish(self) -> None:
        self.state.snapshots[SNAPSHOT] = RemediationStatus(
            faults=self.book.faults(),
            filed={name: tuple(d.values()) for name, d in self.filed.items()},
            filings=dict(self.counts),
            command_exit=dict(self.command_exit),
            filers_down=tuple(f.name for f in self.filers if f.name not in self.started),
        )

    # --- lifecycle -------------------------------------------------------------------------

    async def _events(self, queue: asyncio.Queue[Finding]) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            opened = False
            for f in batch:
                try:
                    opened = self.take(f) or opened
                except Exception:  # one bad event must not stop the hand-off
                    log.exception("remediation_event_failed", reason=f.reason.value)
            if opened:
                try:
                    await self.reconcile()
                except Exception:
                    log.exception("remediation_turn_failed")

    async def _ticks(self) -> None:
        while True:
            try:
                await self.turn()
            except Exception:
                log.exception("remediation_turn_failed")
            await asyncio.sleep(self.cfg.interval_s)

    async def start(self) -> None:
        self._queue = self.state.events.subscribe()
        self._tasks = [
            asyncio.create_task(self._events(self._queue), name="remediation-events"),
            asyncio.create_task(self._ticks(), name="remediation-ticks"),
        ]

    async def stop(self) -> None:
        if self._queue is not None:
            self.state.events.unsubscribe(self._queue)
        await cancel_and_wait(self._tasks)
        for filer in self.filers:
            await filer.stop()


def build_filers(config: Any, state: Any, clock: Callable[[], float]) -> list[Any]:
    """The enabled filers, in registry order; a filer whose factory finds it inert here (the
    node condition off the cluster) is left out. A ConfigError stops the agent."""
    rem = config.remediation
    node = config.kubernetes.node() or state.node
    ctx = FilerContext(state=state, config=config, node=node, clock=clock)
    out = []
    for name in REGISTRY:
        section = getattr(rem, name)
        if section.enabled:
            filer = spec(name).factory(section, ctx)
            if filer is not None:
                out.append(filer)
    return out
