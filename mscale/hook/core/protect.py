"""One-line protection: what `mscale.attach(..., snapshots=...)` puts on a guard.

    guard = mscale.attach(model, optimizer, job_id="run-42", snapshots="/ckpt/run-42", data=loader)

The guard gets the fuse plugin (the in-process healing: MPU swap, degradation, distillation,
LR cooling, rollback) and a snapshot engine the fuse drives: an in-memory snapshot every
`memory_every` steps (and one of the state before the first step), a disk snapshot every
`disk_every` steps when a directory is given. A non-finite loss or gradient drops the step's
update (the guard does that on its own) and rolls back to the newest in-memory snapshot.

What a rollback does with the data depends on the loader given as `data`:

- one that can be rewound in place and can step over one batch (`state_dict`,
  `load_state_dict`, `last_batch_position`, `skip_batch_at`: `mscale.ResumableLoader`,
  `ResumableFileStream`): the position is rewound with the rest, the steps since the snapshot
  are re-run on the same batches and the faulty batch is stepped over: step-exact.
- one with only `state_dict`/`load_state_dict` (torchdata's `StatefulDataLoader`): its position
  is snapshotted and restored at start-up (resume), but a rollback does not rewind it (a
  StatefulDataLoader applies a loaded state at the next `iter()`, not to the iterator the loop
  holds): the loop goes on with the batch after the faulty one, so the steps since the snapshot
  are undone, not re-run. `memory_every=1` makes that one step.
- none (`data` left out, or under the Hugging Face Trainer, which owns its loader): the same,
  and a restart starts the data from its beginning.
- an object without `state_dict`/`load_state_dict` (a plain torch `DataLoader`): refused with
  a TypeError, since its position cannot be snapshotted.

With several ranks (a torch.distributed process group) `agree` adds the step agreement
(mscale.hook.core.agree) and the rollback is collective: every rank restores the same step. A
sharded model (FSDP2) is snapshotted shard by shard, through mscale.snapshot.sharded.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import structlog

from mscale.contracts.msrp import msrp_binding
from mscale.findings import Reason
from mscale.snapshot.config import SnapshotConfig

if TYPE_CHECKING:
    import torch

    from mscale.findings import Finding
    from mscale.healing.settings import HealingSection
    from mscale.hook.core.guard import Guard
    from mscale.snapshot.engine import SnapshotEngine
    from mscale.snapshot.values import Stateful

log = structlog.get_logger("mscale.hook")


def snapshot_config(snapshots: object) -> SnapshotConfig | None:
    """`attach`'s `snapshots` argument as a SnapshotConfig (None: no snapshots)."""
    if snapshots is None or snapshots is False:
        return None
    if snapshots is True:
        cfg = SnapshotConfig()
    elif isinstance(snapshots, SnapshotConfig):
        cfg = snapshots
    elif isinstance(snapshots, (str, os.PathLike)):
        cfg = SnapshotConfig(directory=snapshots)
    else:
        raise TypeError(
            f"snapshots: expected a directory, True (in memory only) or a mscale.SnapshotConfig, "
            f"got {type(snapshots).__name__}"
        )
    if cfg.memory_every < 1:  # the fuse rolls back to in-memory snapshots: it needs a schedule of them
        raise ValueError(f"memory_every: expected >= 1 (rollbacks need in-memory snapshots), got {cfg.memory_every}")
    return cfg


class LoopData:
    """The data position for a loop whose iterator cannot be rewound in place (see the module
    docstring): the loader's own `state_dict()` is snapshotted (nothing when there is none);
    it is loaded back at start-up only. A rollback leaves the loader alone: the loop has
    already drawn the faulty batch and goes on with the next one."""

    rewinds = False  # the step mark (a step run again from its start) leaves it alone: its batch is lost

    def __init__(self, loader: Stateful | None = None) -> None:
        self.loader = loader
        self.restoring = False  # set around the start-up resume
        self.last_batch_position: dict[str, object] = {}  # a rollback's "skip the faulty batch": the loop already did

    def state_dict(self) -> dict[str, object]:
        return self.loader.state_dict() if self.loader is not None else {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if self.restoring and self.loader is not None:
            self.loader.load_state_dict(state)
        elif not self.restoring:
            log.info(
                "data_not_rewound",
                loader=type(self.loader).__name__ if self.loader is not None else None,
                why="the loop's iterator cannot be rewound: it goes on with the batch after the faulty one",
            )

    def skip_batch_at(self, position: dict[str, object]) -> None:
        pass


def data_position(data: object) -> Stateful:
    """What the snapshot engine gets as `data` for `attach`'s `data` argument: a LoopData, or `data`
    itself when it rewinds in place (ResumableLoader)."""
    if data is None:
        return LoopData()
    if not (callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))):
        raise TypeError(
            f"data: {type(data).__name__} has no state_dict()/load_state_dict(), so its position "
            "cannot be snapshotted; use mscale.ResumableLoader or torchdata's StatefulDataLoader, or "
            "leave data out (then a rollback does not rewind the data and a restart starts it afresh)"
        )
    loader = cast("Stateful", data)  # its state_dict()/load_state_dict(), checked just above
    if hasattr(data, "last_batch_position") and callable(getattr(data, "skip_batch_at", None)):
        return loader  # rewound in place, the faulty batch stepped over on the replay
    return LoopData(loader)


# Findings that put the state of the step in flight, and of the one before it (whose snapshot
# may have been taken after the fault struck), in doubt: those snapshots are never restored from.
_DOUBT = frozenset(
    {
        Reason.CHECKSUM_FAILURE,
        Reason.CHECKSUM_L1_TRIGGER,
        Reason.GRADIENT_CORRUPTION,
        Reason.GRAD_NORM_NONFINITE,
        Reason.WEIGHT_CORRUPTION,
        Reason.REPLICA_DIVERGED,
    }
)


class Protection:
    """The plugin that owns the snapshot engine attach made: closes it (finishing queued disk
    writes) when the guard detaches, and flags the snapshots a checksum, gradient or weight
    finding puts in doubt (engine.flag_steps: never restored from, in any tier)."""

    def __init__(self, engine: SnapshotEngine) -> None:
        self.engine = engine

    def on_finding(self, finding: Finding) -> None:
        if finding.reason not in _DOUBT:
            return
        try:
            step = int(finding.labels.get("step", self.engine.step))
        except ValueError:
            step = self.engine.step
        self.engine.flag_steps(step - 1, step, f"{finding.reason.value} at step {step}")

    def on_detach(self, guard: Guard) -> None:
        self.engine.close()


def agree(guard: Guard, healing: HealingSection | None = None) -> None:
    """The gradient check (mscale.hook.checks.gradcheck, `guard.gradients`), and with several ranks in
    the process group: the step agreement (mscale.hook.core.agree) and the replica check
    (mscale.hook.checks.replicas, every healing.replica_check_steps steps), kept as `guard.agreement`
    and `guard.replicas` (None with one rank). healing: the HealingSection (None: the guard's)."""
    from mscale.hook.checks.gradcheck import GradCheck
    from mscale.hook.checks.replicas import ReplicaCheck
    from mscale.hook.core.agree import Agreement
    from mscale.snapshot.sharded import is_sharded

    cfg = healing or guard.healing
    gradients = GradCheck(cfg.gradient_groups)
    guard.add_plugin(gradients)  # ahead of the agreement: its verdict is in the agreement's count
    setattr(guard, "gradients", gradients)  # noqa: B010 (not Guard's own attribute)
    agreement = Agreement()
    several = agreement.world_size > 1
    # replicas only: the ranks of a sharded (FSDP2) model hold different shards, not copies
    replicated = several and not is_sharded(guard.model)
    replicas = ReplicaCheck(cfg.replica_check_steps) if replicated else None
    if several:
        guard.add_plugin(agreement)
    if replicas is not None:
        guard.add_plugin(replicas)
    setattr(guard, "agreement", agreement if several else None)  # noqa: B010 (not Guard's own attributes)
    setattr(guard, "replicas", replicas)  # noqa: B010


def _step_scheduler_past(scheduler: object) -> None:
    """A disk snapshot is taken at the optimizer's step (the guard's commit point), before the
    loop's `scheduler.step()` of that step; a rollback is followed by that call, a start-up
    resume is not (the loop begins with the next step): make it here, as the loop would have."""
    step = getattr(scheduler, "step", None)
    if callable(step):
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
            warnings.simplefilter("ignore", UserWarning)
            step()


def protect(
    guard: Guard,
    cfg: SnapshotConfig,
    *,
    data: Stateful | None = None,
    scheduler: Stateful | None = None,
    scaler: torch.amp.GradScaler | None = None,
    resume: bool = True,
    healing: HealingSection | None = None,
) -> None:
    """Put the fuse and the snapshot engine on `guard` (see the module docstring). `data` is
    what `data_position` made. resume: restore the newest valid disk snapshot now; False refuses
    a directory that already holds snapshots (an older run's would outlive this one's). healing:
    the fuse's mscale.healing.settings.HealingSection (None: the guard's, `guard.healing`)."""
    from mscale.hook.fuse.fuse import FusePlugin

    fuse: FusePlugin | None = None
    early: list[Finding] = []  # the engine's findings before the fuse exists (its tiers, said at start-up)

    def emit(finding: Finding) -> None:  # the writer thread's findings reach the guard through the fuse
        if fuse is None:
            early.append(finding)
        else:
            fuse.snapshot_emit(finding)

    engine = _engine(guard, cfg, data=data, scheduler=scheduler, scaler=scaler, emit=emit)
    fuse = FusePlugin(snapshot_engine=engine, config=healing or guard.healing)
    for finding in early:
        fuse.snapshot_emit(finding)
    if guard.link is not None:  # an L1 swap's standby from the agent's node view
        from mscale.hook.fuse.standby import AgentStandby

        fuse.ask_standby = AgentStandby(guard)
    try:
        step = _resume(engine, cfg, data=data, scheduler=scheduler, resume=resume)
        # the fuse fingerprints the weights when added: after the resume
        guard.add_plugin(fuse)
        guard.add_plugin(Protection(engine))
        if step is not None:
            guard.set_step(step + 1)
        else:  # the state before the first step: a rollback target from the start
            engine.snapshot(step=guard.current_step - 1)
    except BaseException:
        engine.close()
        raise
    guard.fuse, guard.snapshots = fuse, engine
    log.info(
        "protection_attached",
        job_id=guard.job_id,
        directory=str(cfg.directory) if cfg.directory else None,
        memory_every=cfg.memory_every,
        disk_every=cfg.disk_every,
        node_every=engine.node.every if engine.node is not None else 0,
        resumed_step=step,
        data=type(data.loader if isinstance(data, LoopData) else data).__name__,
    )


def _engine(
    guard: Guard,
    cfg: SnapshotConfig,
    *,
    data: Stateful | None,
    scheduler: Stateful | None,
    scaler: torch.amp.GradScaler | None,
    emit: Callable[[Finding], None],
) -> SnapshotEngine:
    """The snapshot engine over the guard's model (each rank's shard, for FSDP2) and MPUs,
    holding CMSA's fitted state as an extra."""
    from mscale.hook.checks.cmsa import CmsaState
    from mscale.snapshot.engine import SnapshotEngine
    from mscale.snapshot.sharded import LocalView, ShardingMarker, is_sharded

    model, module_of = guard.model, (lambda m: m)
    optimizer = guard.optimizer
    extra: dict[str, Stateful] = {CmsaState.SNAPSHOT_NAME: CmsaState(guard.cmsa, guard._grad_stats)}
    if is_sharded(model):  # FSDP2: the engine holds each rank's shard, through local views
        view = LocalView(model, optimizer)
        # (a LocalOptimizer: the optimizer's surface the engine reads, over the local shards)
        model, optimizer, module_of = view.model, view.optimizer, view.module  # type: ignore[assignment]
        extra["sharding"] = ShardingMarker(guard.world_size, guard.model)
    return SnapshotEngine(
        model,
        optimizer,
        mpus={m.name: (m.mpu_id, module_of(m.module)) for m in guard.mpus},
        scaler=scaler,
        scheduler=scheduler,
        data=data,
        config=cfg,
        emit=emit,
        job_id=guard.job_id,
        extra=extra,
        binding=lambda: {
            m.mpu_id: {"gpu": m.gpu, "gpu_uuid": m.gpu_uuid or None, **msrp_binding(guard, m)} for m in guard.mpus
        },
    )


def _resume(
    engine: SnapshotEngine, cfg: SnapshotConfig, *, data: Stateful | None, scheduler: Stateful | None, resume: bool
) -> int | None:
    """Start-up: the step restored from the newest valid disk snapshot (None: none); with
    `resume` False, a directory that holds snapshots is refused."""
    from mscale.snapshot.format import list_snapshots

    held = list_snapshots(cfg.directory) if cfg.directory is not None else []
    if engine.node is not None:  # the node tier's alone (killed before the first disk write)
        held += list_snapshots(engine.node.rank_dir)
    if held and not resume:
        raise ValueError(
            f"snapshots: {cfg.directory} already holds snapshots (newest step "
            f"{max(i.step for i in held)}); resume from them, or give an empty directory"
        )
    step = None
    if held or (resume and engine.world_size > 1):  # with several ranks resume is collective
        loop = data if isinstance(data, LoopData) else None
        if loop is not None:
            loop.restoring = True
        try:
            step = engine.resume()
        finally:
            if loop is not None:
                loop.restoring = False
        if step is not None:
            _step_scheduler_past(scheduler)
    return step
