"""The keyword arguments `mscale.attach` passes on, as typed dicts: the Guard's own options
(mscale.hook.core.guard.Guard), what the framework callbacks (mscale.hook.integrations) pass on
to `attach`, and `attach`'s own, for the helpers that wrap it (mscale.accelerate.attach). One
place that names each option's type, so `**kwargs` stays checked on its way through."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mscale.healing.settings import HealingSection
    from mscale.hook.checks.checksum import ChecksumConfig
    from mscale.hook.checks.cmsa import CmsaConfig
    from mscale.hook.checks.loss import LossConfig
    from mscale.snapshot.config import SnapshotConfig


class GuardOptions(TypedDict, total=False):
    """The Guard's keyword arguments besides `job_id` and `healing` (see Guard)."""

    rank: int | None
    mpus: Mapping[str, nn.Module | str] | None
    gpus: Mapping[str, int] | None
    checksum: ChecksumConfig | None
    loss: LossConfig | None
    cmsa: CmsaConfig | bool | None
    plugins: Iterable[object]
    socket_path: str | None
    connect: bool
    report_queue: int
    scaler: torch.amp.GradScaler | None


class CallbackOptions(GuardOptions, total=False):
    """What a framework callback passes on to `attach` (the framework owns the data, the
    schedulers and the resume)."""

    enabled: bool | None
    healing: HealingSection | None


class AttachOptions(CallbackOptions, total=False):
    """`attach`'s keyword arguments besides `job_id`, `data` and `scheduler`."""

    snapshots: str | os.PathLike[str] | bool | SnapshotConfig | None
    resume: bool
