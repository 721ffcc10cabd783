"""The snapshot engine as a Guard plugin: snapshots at step ends, rollback on a fault."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

from mscale.contracts.msrp import msrp_binding
from mscale.findings import Finding, Reason, Severity
from mscale.snapshot.engine import SnapshotEngine
from mscale.snapshot.format import SnapshotError
from mscale.snapshot.values import StateDict

__all__ = ["SnapshotPlugin"]


class SnapshotPlugin:
    """The engine as a Guard plugin, for jobs that use the guard without the fuse plugin
    (`FusePlugin` drives the engine itself: give it the engine, not this plugin;
    `mscale.attach(..., snapshots=...)` does that for you).

        plugin = SnapshotPlugin(config=SnapshotConfig(directory="/ckpt"), scheduler=sched, data=loader)
        guard.add_plugin(plugin)          # builds the engine from the guard's model and MPUs
        plugin.resume()                   # start-up: newest valid snapshot, guard step set

    - on_step_end: `engine.step_end(step)`, or, when a finding in `rollback_on` came during
      the step (its update was dropped with guard.request_skip), a rollback with the batch
      skipped; the guard continues at the restored step + 1. With several ranks this is the
      collective `agree_rollback` on every rank at every step end.
    - Commands: none. The agent asks for an emergency snapshot or a rollback with its heal
      commands ({"type": "heal", "action": "emergency_snapshot" | "rollback"}), which the
      fuse plugin carries out on the engine it is given; a job that wants them uses it.
    - Findings the writer thread makes reach guard.emit in the training thread (at the next
      hook call), as the guard expects; ROLLBACK and SNAPSHOT_RESUMED carry the labels
      `tag` and `recovery_seconds` (checkpoint_recovery_time_seconds{tag}).
    """

    def __init__(
        self,
        engine: SnapshotEngine | None = None,
        *,
        rollback_on: Iterable[Reason] = (),
        skip_batch: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        if engine is not None and engine_kwargs:
            raise TypeError("give either an engine or the engine's keyword arguments, not both")
        self.engine, self._kwargs = engine, engine_kwargs
        self.rollback_on, self.skip_batch = frozenset(rollback_on), skip_batch
        self.guard: Any = None
        self._thread: threading.Thread | None = None
        self._pending: deque[Finding] = deque()
        self._fault: Finding | None = None
        self.rollbacks: list[StateDict] = []

    def on_attach(self, guard: Any) -> None:
        self.guard, self._thread = guard, threading.current_thread()
        if self.engine is None:
            mpus = {m.name: (m.mpu_id, m.module) for m in guard.mpus}
            self.engine = SnapshotEngine(
                guard.model,
                guard.optimizer,
                mpus=mpus,
                job_id=guard.job_id,
                emit=self._emit,
                binding=self._binding,
                **self._kwargs,
            )
        else:
            self.engine._emit_fn = self.engine._emit_fn or self._emit
            self.engine._binding_fn = self.engine._binding_fn or self._binding
        if self.engine.scaler is not None and hasattr(guard, "watch_scaler"):
            guard.watch_scaler(self.engine.scaler)  # a step the scaler skips (NaN) must still end here

    def on_detach(self, guard: Any) -> None:
        self._drain()

    @property
    def _engine(self) -> SnapshotEngine:
        """The engine, given or built by `on_attach`."""
        if self.engine is None:
            raise RuntimeError("the snapshot plugin is not attached to a guard")
        return self.engine

    def _binding(self) -> dict[str, dict[str, object]]:
        g = self.guard
        return {m.mpu_id: {"gpu": m.gpu, "gpu_uuid": m.gpu_uuid or None, **msrp_binding(g, m)} for m in g.mpus}

    def _emit(self, finding: Finding) -> None:
        if threading.current_thread() is self._thread:
            self.guard.emit(finding)
        else:
            self._pending.append(finding)

    def _drain(self) -> None:
        while self._pending:
            self.guard.emit(self._pending.popleft())

    def on_step_begin(self, step: int, batch: Any) -> None:
        self._drain()

    def on_finding(self, finding: Finding) -> None:
        if finding.reason in self.rollback_on and finding.source != "snapshot" and self._fault is None:
            self._fault = finding
            self.guard.request_skip(f"{finding.reason.value}: rollback")

    def on_step_end(self, step: int, loss: Any = None) -> None:
        self._drain()
        fault, self._fault = self._fault, None
        if self._engine.world_size > 1:  # a collective every step: all ranks roll back, or none
            try:
                to = self._engine.agree_rollback(fault is not None, skip_batch=self.skip_batch)
            except SnapshotError as e:
                self.rollbacks.append(
                    {"step": step, "to": None, "why": fault.reason.value if fault else "another rank", "error": str(e)}
                )
                return
            if to is not None:
                self.guard.set_step(to + 1)
                self.rollbacks.append({"step": step, "to": to, "why": fault.reason.value if fault else "another rank"})
                return
        elif fault is not None:
            self.rollback(skip_batch=self.skip_batch, why=fault.reason.value, at_step=step)
            return
        self._engine.step_end(step)

    def rollback(self, *, skip_batch: bool | None = None, why: str = "", at_step: int | None = None) -> int | None:
        """Rolls back to the newest in-memory snapshot; the guard goes on at its step + 1."""
        try:
            to = self._engine.rollback(skip_batch=self.skip_batch if skip_batch is None else skip_batch)
        except SnapshotError as e:
            self.rollbacks.append({"step": at_step, "to": None, "why": why, "error": str(e)})
            self._engine.emit(Reason.ROLLBACK, Severity.CRITICAL, f"rollback ({why}) failed: {e}")
            return None
        self.guard.set_step(to + 1)
        self.rollbacks.append({"step": at_step, "to": to, "why": why})
        return to

    def resume(self) -> int | None:
        step = self._engine.resume()
        if step is not None:
            self.guard.set_step(step + 1)
        self._drain()
        return step
