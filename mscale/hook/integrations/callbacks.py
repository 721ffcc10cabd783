"""What the framework callbacks (Hugging Face Trainer: mscale/hook/integrations/hf.py, Lightning:
mscale/hook/integrations/lightning.py) share: refusing the attach arguments the framework owns, and putting
the fuse and the snapshots on a guard once the framework has built the model and optimizer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from mscale.hook.core.guard import Guard
from mscale.hook.core.protect import LoopData, protect

if TYPE_CHECKING:
    from mscale.hook.core.options import CallbackOptions
    from mscale.snapshot.config import SnapshotConfig
    from mscale.snapshot.values import Stateful


def refuse_owned(attach_kwargs: Mapping[str, object], owns: Mapping[str, str], *, under: str, owner: str) -> None:
    """TypeError for an attach argument that names something the framework keeps (its data
    loader, its schedulers, its own checkpoints)."""
    for key, what in owns.items():
        if key in attach_kwargs:
            raise TypeError(f"MscaleCallback: {key}= is not taken under {under} ({what} stays {owner})")


def protect_attached(
    guard: Guard,
    snapshots: SnapshotConfig,
    attach_kwargs: CallbackOptions,
    *,
    scheduler: Stateful | None = None,
    on_failure: Callable[[], None],
) -> None:
    """The fuse and the snapshot engine on a guard the callback attached. The framework owns the
    data loader and restarts, so the loop's data is a placeholder and nothing is resumed here.
    `on_failure` undoes the callback's attach before the error goes on."""
    try:
        protect(
            guard,
            snapshots,
            data=LoopData(),
            scheduler=scheduler,
            scaler=attach_kwargs.get("scaler"),
            resume=False,
            # healing= reaches attach (the gradient and replica checks) and protect (the fuse)
            healing=attach_kwargs.get("healing"),
        )
    except BaseException:
        on_failure()
        raise
