"""TRAINING JOB: the guard that watches nothing, what `attach(..., enabled=False)` (or
MSCALE_GUARD=0) returns: the Guard's calls a training loop makes, no hooks, nothing changed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mscale.findings import Finding
from mscale.hook.core.mpu import Mpu

if TYPE_CHECKING:
    from mscale.hook.fuse.fuse import FusePlugin
    from mscale.snapshot.engine import SnapshotEngine


class NullGuard:
    """What `attach(..., enabled=False)` returns: the same calls, no hooks, nothing changed."""

    enabled = False
    fuse: FusePlugin | None = None
    snapshots: SnapshotEngine | None = None

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, **_: object) -> None:
        self.model, self.optimizer = model, optimizer
        self.mpus: list[Mpu] = []
        self.plugins: list[object] = []
        self.link = None
        self.cmsa = None
        self.current_step = 0

    def step(self, loss: object = None) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def observe(self, loss: object) -> None:
        pass

    def add_plugin(self, plugin: object) -> None:
        self.plugins.append(plugin)

    def emit(self, finding: Finding) -> None:
        pass

    def poll_commands(self) -> int:
        return 0

    def detach(self) -> None:
        pass
