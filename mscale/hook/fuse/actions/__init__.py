"""The healing actions' executors (what each does to the model, in the training job): one
module each, registered here, one line per action. Their specs (what the engine and the
policy know) are in mscale.healing.actions; both registries list the same actions in the same
order (tests/test_healing_policy.py holds them to it)."""

from __future__ import annotations

from typing import Any

from mscale.healing import actions as specs
from mscale.hook.fuse.actions import (
    degrade,
    distill,
    emergency_snapshot,
    lr_cool,
    mark_suspect,
    quarantine,
    recover,
    restore_weights,
    rollback,
    swap,
)
from mscale.hook.fuse.actions.base import ActionFailed, Executor, FuseContext

# each action's executor checks against its own state type; the registry holds them all, so
# the state type of one taken from it is any of theirs (the fuse passes each the state it built)
_EXECUTORS: tuple[Executor[Any], ...] = (
    mark_suspect.EXECUTOR,
    swap.EXECUTOR,
    degrade.EXECUTOR,
    distill.EXECUTOR,
    recover.EXECUTOR,
    lr_cool.EXECUTOR,
    rollback.EXECUTOR,
    restore_weights.EXECUTOR,
    emergency_snapshot.EXECUTOR,
    quarantine.EXECUTOR,
)

REGISTRY = {e.name: e for e in _EXECUTORS}


def get(name: str) -> Executor[Any]:
    if name not in REGISTRY:
        raise KeyError(f"unknown healing action {name!r} (known: {', '.join(specs.NAMES)})")
    return REGISTRY[name]


def executors() -> list[Executor[Any]]:
    """Every executor, in registry order."""
    return list(_EXECUTORS)


__all__ = ["REGISTRY", "get", "executors", "Executor", "FuseContext", "ActionFailed"]
