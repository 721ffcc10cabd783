"""The in-process hook library: the Guard, its MPUs, detectors, CMSA and the agent link.

Importing this package imports torch; `import mscale` does not (it re-exports lazily).
"""
from __future__ import annotations

from mscale.hook.cmsa import Cmsa, CmsaConfig
from mscale.hook.guard import Guard, ModelInputs, NullGuard, attach
from mscale.hook.mpu import KNOWN_NAMES, Mpu, MpuLayoutError, discover
from mscale.hook.plugin import Plugin
from mscale.probes.checksum import ChecksumConfig
from mscale.probes.loss import LossConfig

__all__ = ["attach", "Guard", "NullGuard", "ModelInputs", "Mpu", "MpuLayoutError", "discover", "KNOWN_NAMES",
           "Plugin", "Cmsa", "CmsaConfig", "ChecksumConfig", "LossConfig"]
