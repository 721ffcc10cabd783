"""MegaScale-Omni: observability and self-healing for multimodal LLM training.

Importing `mscale` has no side effects and does not import torch: the hook library's public
API is re-exported lazily (module `__getattr__`), so the agent never loads it.

    import mscale
    guard = mscale.attach(model, optimizer, job_id="run-42")            # watch; NaN updates dropped
    guard = mscale.attach(model, optimizer, job_id="run-42",            # + fuse, snapshots, rollback
                          snapshots="/ckpt/run-42", data=loader)
"""

from __future__ import annotations

import importlib
from typing import Any

from mscale.version import __version__

# public name -> module defining it (imported on first use)
_LAZY: dict[str, str] = {
    "attach": "mscale.hook.core.attach",
    "Guard": "mscale.hook.core.guard",
    "NullGuard": "mscale.hook.core.null",
    "ModelInputs": "mscale.hook.core.guard",
    "Mpu": "mscale.hook.core.mpu",
    "MpuLayoutError": "mscale.hook.core.mpu",
    "Plugin": "mscale.hook.core.plugin",
    "CmsaConfig": "mscale.hook.checks.cmsa",
    "ChecksumConfig": "mscale.hook.checks.checksum",
    "LossConfig": "mscale.hook.checks.loss",
    "MscaleCallback": "mscale.hook.integrations.hf",
    "SnapshotConfig": "mscale.snapshot.config",
    "ResumableLoader": "mscale.snapshot.data",
    "ResumableFileStream": "mscale.snapshot.data",
    "contract": "mscale.contracts.declare",
    "ContractRefused": "mscale.contracts.spec",
    "ProgressBoundExceeded": "mscale.healing.progress",
    "Finding": "mscale.findings",
    "Reason": "mscale.findings",
    "Severity": "mscale.findings",
}

# integrations, as submodules: mscale.accelerate.attach, mscale.lightning.MscaleCallback
_SUBMODULES = ("accelerate", "lightning")

__all__: list[str] = ["__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"mscale.{name}")  # the import binds it in globals()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mscale' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
