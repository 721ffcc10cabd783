"""`mscale.attach`: the one line that guards a training loop. It builds the Guard
(mscale.hook.core.guard), adds the step agreement across ranks (mscale.hook.core.agree), the goodput
accountant (mscale.hook.core.goodput) and the contract in force (mscale.hook.core.contract), and with `snapshots=` the fuse and snapshots
(mscale.hook.core.protect). Kept apart from the Guard, which it composes."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Unpack

import torch
from torch import nn

from mscale.healing.settings import HealingSection
from mscale.hook.core.contract import join as contract_join
from mscale.hook.core.goodput import account
from mscale.hook.core.guard import Guard
from mscale.hook.core.null import NullGuard
from mscale.hook.core.protect import SnapshotConfig, agree, data_position, protect, snapshot_config
from mscale.options import parse_bool

if TYPE_CHECKING:
    from mscale.hook.core.options import GuardOptions
    from mscale.snapshot.values import Stateful


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    job_id: str,
    snapshots: str | os.PathLike[str] | bool | SnapshotConfig | None = None,
    data: object = None,
    scheduler: Stateful | None = None,
    resume: bool = True,
    enabled: bool | None = None,
    healing: HealingSection | None = None,
    **kwargs: Unpack[GuardOptions],
) -> Guard | NullGuard:
    """Guard `model` (and `optimizer`); other keyword arguments are `Guard`'s. snapshots: None
    drops the update of a step with a non-finite loss or gradient; a directory, True (in memory
    only) or a SnapshotConfig adds the fuse and snapshots, and such a step is rolled back. data:
    the loader whose position they hold; scheduler: snapshotted too; resume: go on from the
    directory's newest snapshot (False refuses one that holds any). See mscale.hook.core.protect.
    healing: the HealingSection (mscale.healing.settings) of the fuse, the gradient check and the
    replica check (None: the defaults).
    Disabled (enabled=False, or MSCALE_GUARD=0) returns a NullGuard and changes nothing."""
    if enabled is None:
        enabled = parse_bool(os.environ.get("MSCALE_GUARD", "1"))
    if not enabled:
        return NullGuard(model, optimizer)
    cfg = snapshot_config(snapshots)  # bad arguments are refused before anything is hooked
    if cfg is None and (data is not None or scheduler is not None):
        given = " and ".join(n for n, v in (("data=", data), ("scheduler=", scheduler)) if v is not None)
        raise TypeError(
            f"{given} without snapshots=: their positions are what snapshots hold, and without "
            "snapshots nothing uses them. Add snapshots=True (in memory) or snapshots=DIR, or leave "
            f"{given} out (the guard then only watches)"
        )
    if healing is not None and type(healing).__name__ != "HealingSection":
        raise TypeError(f"healing: expected a mscale.healing.settings.HealingSection, got {type(healing).__name__}")
    position = data_position(data) if cfg is not None else None
    guard = Guard(model, optimizer, job_id=job_id, healing=healing, **kwargs)
    healing = guard.healing  # with the one L1 threshold (checksum_config.one_l1)
    agree(guard, healing)  # the gradient check; several ranks: decisions agreed at each step (mscale.hook.core.agree)
    account(guard)  # the rank's wall time by cause, in its step reports (mscale.hook.core.goodput)
    contract_join(guard)  # the contract in force in this process, if any (mscale.hook.core.contract)
    if cfg is not None:
        try:
            protect(
                guard,
                cfg,
                data=position,
                scheduler=scheduler,
                scaler=kwargs.get("scaler"),
                resume=resume,
                healing=healing,
            )
        except BaseException:
            guard.detach()
            raise
    return guard
