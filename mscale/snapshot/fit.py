"""Whether a loaded snapshot fits what it is restored into: every model and optimizer tensor's
shape and dtype against the live ones (nothing is cast or reshaped on the way in), the optimizer
state complete, and every state object the engine holds present. Checked before any byte is
applied, by both restore paths (the engine's and the in-place one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mscale.snapshot.format import SnapshotError
from mscale.snapshot.optim import fits
from mscale.snapshot.values import StateDict, as_dict

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine


def check_fits(
    engine: SnapshotEngine, tensors: dict[str, dict[str, torch.Tensor]], objects: StateDict, where: str
) -> None:
    """Refuse (SnapshotError naming the tensor, both shapes or dtypes) a snapshot that does not fit
    `engine`'s live model, optimizer and state objects, before any byte of it is applied."""
    model_keys = {k[6:]: t for d in tensors.values() for k, t in d.items() if k.startswith("model/")}
    live = engine.model.state_dict()
    missing, unexpected = live.keys() - model_keys.keys(), model_keys.keys() - live.keys()
    if missing or unexpected:
        raise SnapshotError(
            f"{where} does not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    for k, t in live.items():  # shape and dtype: nothing is cast or reshaped on the way in
        fits(f"model/{k}", model_keys[k], t, f"{where} does not fit the model", "the model's")
    if engine.named_optimizer is not None:
        optim = {k[6:]: t for d in tensors.values() for k, t in d.items() if k.startswith("optim/")}
        saved = objects.get("optimizer")
        engine.named_optimizer.check(None if saved is None else as_dict(saved, "the optimizer state"), where, optim)
    for name, obj in (("scaler", engine.scaler), ("scheduler", engine.scheduler), ("data", engine.data)):
        if obj is not None and name not in objects:
            raise SnapshotError(f"{where} holds no {name} state")
    for name, obj in engine.extra.items():  # one marked snapshot_optional may be missing (None)
        if name not in as_dict(objects.get("extra", {}), "the extras' state") and not getattr(
            obj, "snapshot_optional", False
        ):
            raise SnapshotError(f"{where} holds no state for {name!r}")
