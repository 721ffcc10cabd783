"""Healing actions: one module each, registered here (one line per action). What the engine
and the fuse need to know about an action is declared on its spec (base.ActionSpec)."""

from __future__ import annotations

import importlib

from mscale.healing.actions.base import ActionFailed, ActionSpec

REGISTRY: dict[str, str] = {
    "mark_suspect": "mscale.healing.actions.mark_suspect",
    "l1_swap": "mscale.healing.actions.swap",
    "l2_degrade": "mscale.healing.actions.degrade",
    "l3_distill": "mscale.healing.actions.distill",
    "recover": "mscale.healing.actions.recover",
    "lr_cool": "mscale.healing.actions.lr_cool",
    "rollback": "mscale.healing.actions.rollback",
    "restore_weights": "mscale.healing.actions.restore_weights",
    "emergency_snapshot": "mscale.healing.actions.emergency_snapshot",
    "quarantine_gpu": "mscale.healing.actions.quarantine",
}

NAMES: tuple[str, ...] = tuple(REGISTRY)


def get(name: str) -> ActionSpec:
    if name not in REGISTRY:
        raise KeyError(f"unknown healing action {name!r} (known: {', '.join(NAMES)})")
    return importlib.import_module(REGISTRY[name]).ACTION


def specs() -> list[ActionSpec]:
    """Every registered action, in registry order."""
    return [get(name) for name in NAMES]


def recovery() -> ActionSpec:
    """The action the fuse runs when an MPU with measures in force comes clean."""
    (spec,) = [s for s in specs() if s.on_recovery]
    return spec


__all__ = ["REGISTRY", "NAMES", "get", "specs", "recovery", "ActionSpec", "ActionFailed"]
