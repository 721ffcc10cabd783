"""Healing actions as the engine and the policy see them: one spec each, registered here (one
entry per action, registry order). What an action does in the training job is its executor,
mscale.hook.fuse.actions.<module> (registered in mscale.hook.fuse.actions), which this room never
imports: the agent loads every spec without torch."""

from __future__ import annotations

from mscale.healing.actions.base import ActionSpec
from mscale.healing.fsm import Level
from mscale.healing.words import FuseLevel, TargetKind

_SPECS: tuple[ActionSpec, ...] = (
    # a checksum failure below the L1 threshold: nothing moves, the state machine remembers
    ActionSpec("mark_suspect", FuseLevel.NONE, Level.SUSPECT, "mark the MPU suspect", scope=TargetKind.MPU),
    ActionSpec(
        "l1_swap",
        FuseLevel.L1,
        Level.L1_SWAPPED,
        "move the MPU to a standby GPU and re-run its forward",
        scope=TargetKind.MPU,
        reruns_forward=True,
        drift=True,
        escalates_to="l2_degrade",
        escalate_on_failure=True,
        new_placement=True,
    ),
    ActionSpec(
        "l2_degrade",
        FuseLevel.L2,
        Level.L2_DEGRADED,
        "run the MPU degraded (CPU or bf16 fallback, reduced resolution, raised clip)",
        scope=TargetKind.MPU,
        reruns_forward=True,
        escalates_to="l3_distill",
        new_placement=True,
    ),
    ActionSpec(
        "l3_distill",
        FuseLevel.L3,
        Level.L3_DISTILLING,
        "distill the failing MPU from the text MPU",
        scope=TargetKind.MPU,
        new_placement=True,
    ),
    ActionSpec(
        "recover",
        FuseLevel.NONE,
        Level.RECOVERED,
        "undo the L2/L3 measures after a clean stretch",
        scope=TargetKind.MPU,
        on_recovery=True,
    ),
    ActionSpec(
        "lr_cool", FuseLevel.NONE, None, "cool the learning rate for a window", scope=TargetKind.JOB, cools_job=True
    ),
    ActionSpec(
        "rollback",
        FuseLevel.NONE,
        None,
        "drop the step, restore the last good snapshot, skip the batch",
        scope=TargetKind.JOB,
    ),
    ActionSpec(
        "restore_weights",
        FuseLevel.NONE,
        None,
        "restore corrupted weights from the newest in-memory snapshot (in place, or roll back to it)",
        scope=TargetKind.JOB,
    ),
    ActionSpec(
        "emergency_snapshot", FuseLevel.NONE, None, "write the in-memory snapshot to disk now", scope=TargetKind.JOB
    ),
    ActionSpec("quarantine_gpu", FuseLevel.NONE, None, "mark the GPU unusable for the job", scope=TargetKind.GPU),
)

REGISTRY: dict[str, ActionSpec] = {s.name: s for s in _SPECS}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def get(name: str) -> ActionSpec:
    if name not in REGISTRY:
        raise KeyError(f"unknown healing action {name!r} (known: {', '.join(NAMES)})")
    return REGISTRY[name]


def specs() -> list[ActionSpec]:
    """Every registered action, in registry order."""
    return list(_SPECS)


def recovery() -> ActionSpec:
    """The action the fuse runs when an MPU with measures in force comes clean."""
    (spec,) = [s for s in _SPECS if s.on_recovery]
    return spec


__all__ = ["REGISTRY", "NAMES", "get", "specs", "recovery", "ActionSpec"]
