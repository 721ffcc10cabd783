"""TRAINING JOB: snapshots of the whole training state and their restore.

    format.py       the on-disk format without torch: names, manifest, listing, verifying,
                    reading the train state, inspecting (all `mscale snapshot` uses)
    manifest.py     the manifest's strict schema and completeness; files opened safely
    train_state.py  `train_state.pt` read without torch (a restricted unpickler)
    tensors.py      the torch side of the format: tensors to safetensors, load_snapshot
    memory.py       snapshots in host memory and the copies that fill them; RNG states
    trust.py        live weights against the in-memory copies: which to trust, what they explain
    verify.py       each in-memory snapshot verified on the copier's thread; restored once it passed
    optim.py        optimizer state keyed by parameter name
    writer.py       the background thread that writes snapshots to disk
    config.py       SnapshotConfig: the snapshots' settings, validated once
    capture.py      what a snapshot takes and where it goes: MPU files, binding, directories
    store.py        the kept in-memory snapshots, pinned while read, their buffers reused
    mark.py         the step mark: what a step's rerun puts back without a rollback
    restore.py      a snapshot into the live objects; the start-up resume
    engine.py       SnapshotEngine: holds the parts above; snapshot, rollback, resume
    values.py       the opaque values passed around (StateDict, JSONObject) and their checked reads
    plugin.py       SnapshotPlugin: the engine as a Guard plugin
    data.py         resumable data positions; distributed.py: the collectives of agreed rollback
    cli.py          `mscale snapshot list|verify|inspect`

The public names are importable from here (`from mscale.snapshot import SnapshotEngine`);
importing this package or `mscale.snapshot.format` does not import torch.

May import: findings, logs, version, contracts.msrp (the binding's MSRP fields). Never imports
daemon, nor the hook library (which drives the engine).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = [
    "SnapshotConfig",
    "SnapshotEngine",
    "SnapshotPlugin",
    "SnapshotError",
    "SnapshotInvalid",
    "RollbackUnavailable",
    "SnapshotInfo",
    "list_snapshots",
    "verify_snapshot",
    "read_manifest",
    "load_snapshot",
    "ResumableLoader",
    "ResumableFileStream",
]


def __getattr__(name: str) -> Any:
    # On first use, so that the format module and the CLI never load torch.
    module: ModuleType
    if name in (
        "SnapshotError",
        "SnapshotInvalid",
        "SnapshotInfo",
        "list_snapshots",
        "verify_snapshot",
        "read_manifest",
    ):
        from mscale.snapshot import format as module
    elif name == "SnapshotConfig":
        from mscale.snapshot import config as module
    elif name in ("SnapshotEngine", "RollbackUnavailable"):
        from mscale.snapshot import engine as module
    elif name == "SnapshotPlugin":
        from mscale.snapshot import plugin as module
    elif name == "load_snapshot":
        from mscale.snapshot import tensors as module
    elif name in ("ResumableLoader", "ResumableFileStream"):
        from mscale.snapshot import data as module
    else:
        raise AttributeError(f"module 'mscale.snapshot' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
