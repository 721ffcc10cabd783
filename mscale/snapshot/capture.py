"""What a snapshot takes and where it goes, set up once by the engine (engine.py) and called by
it: which file each model key and optimizer state goes to (`MpuLayout`), the live state to copy
(`live_state`), the MPU-to-device binding (`binding`), and the directory set-up: this rank's
directory and its writer, the node tier and its writer (`open_directory`, `open_node_tier`).
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

import mscale.snapshot.distributed as mdist
from mscale.findings import Reason, Severity
from mscale.snapshot import worlds
from mscale.snapshot.format import FORMAT, NONMPU_FILE, NONMPU_OPTIM_FILE, mpu_file, optim_file
from mscale.snapshot.manifest import Identity
from mscale.snapshot.memory import rng_state, to_host
from mscale.snapshot.node_tier import NodeTier
from mscale.snapshot.ownership import dir_refused
from mscale.snapshot.values import JSONObject, StateDict
from mscale.snapshot.writer import DiskWriter

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine

__all__ = ["MpuLayout", "binding", "live_state", "open_directory", "open_node_tier"]


class MpuLayout:
    """The MPUs' places in the model: mpu_id -> (module prefix, file name) in `files`, their
    names and modules. ValueError: an MPU not a submodule of the model, or an id used twice."""

    def __init__(self, model: nn.Module, mpus: Mapping[str, tuple[str, nn.Module]]) -> None:
        prefix_of = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.files: dict[str, tuple[str, str]] = {}
        self.names: dict[str, str] = {}
        for name, (mpu_id, module) in mpus.items():
            if id(module) not in prefix_of:
                raise ValueError(f"MPU {name!r} ({mpu_id}) is not a submodule of the model")
            if mpu_id in self.files:
                raise ValueError(f"MPU id {mpu_id!r} used twice")
            self.files[mpu_id] = (prefix_of[id(module)], mpu_file(mpu_id, name))
            self.names[mpu_id] = name
        self.modules = {mpu_id: module for name, (mpu_id, module) in mpus.items()}
        self._prefixes = sorted(self.files.values(), key=lambda pf: -len(pf[0]))

    def file_of(self, key: str, *, optim: bool = False) -> str:
        """The file a model key (or, optim, the optimizer state of a parameter) goes to.
        Model and optimizer state are separate files: more files hash in parallel."""
        for prefix, fname in self._prefixes:
            if prefix == "" or key == prefix or key.startswith(prefix + "."):
                return optim_file(fname) if optim else fname
        return NONMPU_OPTIM_FILE if optim else NONMPU_FILE


def live_state(engine: SnapshotEngine) -> tuple[dict[str, dict[str, torch.Tensor]], StateDict]:
    """References to the live tensors per file, and a host copy of everything else."""
    layout = engine.layout
    files: dict[str, dict[str, torch.Tensor]] = {}
    for _, f in [*layout.files.values(), ("", NONMPU_FILE)]:
        files[f] = {}
        if engine.optimizer is not None:
            files[optim_file(f)] = {}
    for key, t in engine.model.state_dict().items():
        files[layout.file_of(key)]["model/" + key] = t
    objects: StateDict = {"format": FORMAT, "step": engine.step}
    if engine.named_optimizer is not None:
        objects["optimizer"] = engine.named_optimizer.capture(files, lambda fqn: layout.file_of(fqn, optim=True))
    if engine.scaler is not None:
        objects["scaler"] = to_host(engine.scaler.state_dict())
    if engine.scheduler is not None:
        objects["scheduler"] = to_host(engine.scheduler.state_dict())
    if engine.data is not None:
        objects["data"] = to_host(engine.data.state_dict())
    objects["extra"] = {name: to_host(obj.state_dict()) for name, obj in engine.extra.items()}
    objects["rng"] = rng_state()
    return files, objects


def binding(engine: SnapshotEngine) -> JSONObject:
    """The MPU-to-device binding a snapshot records: read from the device of each MPU's first
    parameter, overridden by the engine's binding function where it gives one."""
    custom = dict(engine._binding_fn() or {}) if engine._binding_fn else {}
    mpus = {}
    for mpu_id, module in engine.layout.modules.items():
        p = next(module.parameters(), None)
        dev = p.device if p is not None else torch.device("cpu")
        entry: JSONObject = {"name": engine.layout.names[mpu_id], "device": str(dev), "gpu": None, "gpu_uuid": None}
        if dev.type == "cuda":
            entry["gpu"] = gpu = dev.index if dev.index is not None else torch.cuda.current_device()
            entry["gpu_uuid"] = str(getattr(torch.cuda.get_device_properties(gpu), "uuid", "")) or None
        entry.update({k: v for k, v in dict(custom.get(mpu_id, {})).items()})
        mpus[mpu_id] = entry
    return {
        "rank": engine.rank,
        "world_size": engine.world_size,
        "host": platform.node(),
        "job_id": engine.job_id,
        "mpus": mpus,
    }


def open_node_tier(engine: SnapshotEngine, disk: DiskWriter) -> tuple[NodeTier, DiskWriter] | None:
    """The node tier and its own writer thread, where NodeTier.open says it is on."""
    tier = NodeTier.open(engine)
    if tier is None:
        return None
    writer = DiskWriter(
        tier.rank_dir,
        keep=engine.config.node_keep,
        identity=disk.identity,
        emit=engine.emit,
        unpin=engine.store.unpin,
        tier="node",
        private=True,
        # the cap is weighed in the writer thread, as the write comes up
        admit=lambda snap: not tier.past_cap(snap, writer),
    )
    return tier, writer


def open_directory(engine: SnapshotEngine, directory: Path) -> tuple[Path, DiskWriter] | None:
    """This rank's directory under `directory` (made), and the writer thread that fills it.
    None (no disk tier, on every rank alike) where a rank's directory is another user's."""
    if engine.world_size > 1 and engine.rank == 0:
        worlds.adopt_single(directory)  # before any rank lists it: worlds.plan waits for this
    rank_dir = worlds.rank_dir(directory, engine.rank, engine.world_size)
    try:
        rank_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # a rank directory must be this uid's; the root may be shared (sticky, like /tmp)
        why = dir_refused(rank_dir) if rank_dir != directory else ""
    except OSError as e:
        why = f"not made ({e.strerror or e})"
    # every rank alike: resume and rollback to disk are collective
    if mdist.any_flag(bool(why), engine.group):
        message = (
            f"{rank_dir} is {why}: never written to, listed or resumed from; this job keeps no disk "
            f"snapshots (in-memory ones go on). Remove it or give a directory of your own"
            if why
            else f"another rank's snapshot directory under {directory} is refused: this job keeps no "
            "disk snapshots, since every rank must resume the same step"
        )
        engine.emit(Reason.SNAPSHOT_REFUSED, Severity.CRITICAL, message, file=rank_dir.name)
        return None
    _report_foreign(engine, directory)
    identity: Identity = {
        "rank": engine.rank,
        "world_size": engine.world_size,
        "job_id": engine.job_id,
        "optimizer": engine.optimizer is not None,  # so the manifest's completeness can be checked
        "mpus": {
            mpu_id: {"name": engine.layout.names[mpu_id], "file": f, "optim_file": optim_file(f)}
            for mpu_id, (_, f) in engine.layout.files.items()
        },
    }
    writer = DiskWriter(rank_dir, keep=engine.disk_keep, identity=identity, emit=engine.emit, unpin=engine.store.unpin)
    return rank_dir, writer


def _report_foreign(engine: SnapshotEngine, directory: Path, most: int = 8) -> None:
    """One finding naming the rank directories of `directory` that are not this uid's (at most
    `most` named): ignored, never written to, listed or resumed from (ownership.py)."""
    try:
        names = sorted(p.name for p in directory.iterdir() if worlds.RANK_DIR.match(p.name))
    except OSError:
        return
    foreign = [(n, why) for n in names if (why := dir_refused(directory / n))]
    if foreign:
        named = "; ".join(f"{n} is {why}" for n, why in foreign[:most])
        more = f" (and {len(foreign) - most} more)" if len(foreign) > most else ""
        engine.emit(
            Reason.SNAPSHOT_REFUSED,
            Severity.WARNING,
            f"{named}{more}: ignored, never written to, listed or resumed from by this run",
            file=foreign[0][0],
        )
