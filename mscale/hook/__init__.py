"""TRAINING JOB: the in-process hook library: the Guard, its MPUs, the checksum and loss
detectors, CMSA, the fuse plugin and the healing actions' executors (actions/), the agent link
client, and the integrations, each imported on its own: the Hugging Face callback (hf),
Accelerate (accelerate), Lightning (lightning).

May import: findings, options (the config machinery), link, healing (the decision core), snapshot,
contracts, families (torch-free). Never imports daemon. Importing this package imports torch; `import mscale` does not (it re-exports lazily).
"""

from __future__ import annotations

from mscale.hook.attach import attach
from mscale.hook.checksum import ChecksumConfig
from mscale.hook.cmsa import Cmsa, CmsaConfig
from mscale.hook.guard import Guard, ModelInputs
from mscale.hook.loss import LossConfig
from mscale.hook.mpu import KNOWN_NAMES, Mpu, MpuLayoutError, discover
from mscale.hook.null import NullGuard
from mscale.hook.plugin import Plugin
from mscale.hook.protect import SnapshotConfig

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
