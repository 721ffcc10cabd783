"""TRAINING JOB: the in-process hook library, in four rooms: core (the Guard, its MPUs and
families, attach, the plugin surface, the agent link client), checks (checksums, the batch,
gradient and weight checks, loss statistics, CMSA, the budget), fuse (the three-level fuse and the
healing actions' executors) and integrations (the Hugging Face callback, Accelerate, Lightning,
compiled graphs), each integration imported on its own.

May import: findings, options (the config machinery), link, healing (the decision core), snapshot,
contracts. Never imports daemon. Importing this package imports torch; `import mscale` does not (it re-exports lazily).
"""

from __future__ import annotations

from mscale.hook.checks.checksum import ChecksumConfig
from mscale.hook.checks.cmsa import Cmsa, CmsaConfig
from mscale.hook.checks.loss import LossConfig
from mscale.hook.core.attach import attach
from mscale.hook.core.guard import Guard, ModelInputs
from mscale.hook.core.mpu import KNOWN_NAMES, Mpu, MpuLayoutError, discover
from mscale.hook.core.null import NullGuard
from mscale.hook.core.plugin import Plugin
from mscale.hook.core.protect import SnapshotConfig

__all__ = [
    "attach",
    "Guard",
    "NullGuard",
    "ModelInputs",
    "Mpu",
    "MpuLayoutError",
    "discover",
    "KNOWN_NAMES",
    "Plugin",
    "SnapshotConfig",
    "Cmsa",
    "CmsaConfig",
    "ChecksumConfig",
    "LossConfig",
]
