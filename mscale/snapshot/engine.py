"""Snapshot and restore of the whole training state, in memory and on disk.

A snapshot at step N is the state after step N's optimizer step: model and optimizer state
split per MPU, grad scaler, LR scheduler, RNG states (python, numpy, torch CPU, every CUDA
device), the data position, the step counter and the MPU-to-device binding. Restoring it and
running step N+1 continues exactly as the uninterrupted run would have.

- In memory, every `memory_every` steps: a copy into reused host buffers (pinned, on a side
  CUDA stream, when the state is on a GPU), the last `memory_keep` kept. Rollbacks use these.
- On disk, every `disk_every` steps, on demand and in an emergency: a background thread writes
  the in-memory copy to `.tmp-step_N-...`, fsyncs every file and the directory, and renames it
  to `step_N` (then fsyncs the parent), so a crash at any point leaves only complete
  snapshots. A failed write (disk full) is a Finding; training and the in-memory copy go on.
- Loading never unpickles code: tensors are safetensors files, the rest `train_state.pt` read
  with `torch.load(weights_only=True)`; each file is checked against `manifest.json` (size,
  SHA-256) first, and a snapshot that fails is refused, naming the file, for the next older.

Layout of a snapshot directory (`DIR/step_00000120`, or `DIR/rank_00003/step_00000120` when
several ranks share DIR):

    mpu_<id>_<name>_state.safetensors   model tensors of the MPU ("model/<fqn>")
    mpu_<id>_<name>_optim.safetensors   optimizer tensors of its parameters ("optim/<fqn>/<key>")
    nonmpu_state.safetensors            the same two for parameters and buffers outside any MPU
    nonmpu_optim.safetensors
    train_state.pt                      optimizer groups and scalars, scaler, scheduler, RNG,
                                        data position, step (weights_only-loadable objects)
    resource_binding.json               MPU -> device index and UUID
    manifest.json                       every file above with size and SHA-256; step, versions
"""
from __future__ import annotations

import copy
import errno
import hashlib
import io
import json
import os
import platform
import random
import re
import shutil
import signal
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import structlog
import torch
from torch import nn

from mscale import __version__
from mscale.findings import Finding, Reason, Severity
from mscale.snapshot import distributed as mdist

__all__ = [
    "SnapshotEngine",
    "SnapshotError",
    "SnapshotInvalid",
    "RollbackUnavailable",
    "SnapshotInfo",
    "list_snapshots",
    "verify_snapshot",
    "read_manifest",
    "load_snapshot",
    "SnapshotPlugin",
]

FORMAT = "mscale-snapshot/1"
MANIFEST = "manifest.json"
BINDING = "resource_binding.json"
TRAIN_STATE = "train_state.pt"
NONMPU_FILE = "nonmpu_state.safetensors"
NONMPU_OPTIM_FILE = "nonmpu_optim.safetensors"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
RANK_DIR = re.compile(r"^rank_(\d{5,})$")
TEMP_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
_REF = "__mscale_tensor__"
_CHUNK = 16 << 20  # write and hash granularity: large enough for syscall overhead to vanish
_WRITERS = 2  # files written (and hashed) at once

log = structlog.get_logger("mscale.snapshot")

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


class SnapshotError(RuntimeError):
    """A snapshot could not be taken, written or restored."""


class SnapshotInvalid(SnapshotError):
    """A snapshot on disk is refused: `file` is the file at fault (relative to `path`)."""

    def __init__(self, path: Path, file: str, why: str) -> None:
        self.path, self.file, self.why = Path(path), file, why
        super().__init__(f"snapshot {path} refused: {file}: {why}")


class RollbackUnavailable(SnapshotError):
    """No in-memory snapshot to roll back to (on every rank)."""


# ---------------------------------------------------------------------------------------
# On-disk format: writing, listing, verifying, reading. Listing and verifying need no torch
# state and are what `mscale snapshot` uses.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotInfo:
    path: Path
    step: int
    rank: int | None  # None: a single-process directory without rank subdirectories
    complete: bool  # manifest present (written last, so present means the rename happened)
    manifest: dict | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(f["size"]) for f in (self.manifest or {}).get("files", {}).values())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_file(path: Path, parts: Iterable[memoryview | bytes], hasher_pool: ThreadPoolExecutor, *, fsync: bool = True) -> tuple[int, str]:
    """Writes parts to a new file (and fsyncs it unless told not to); returns (size, sha256).
    The hash of each chunk runs in a helper thread while the chunk is written (both release
    the GIL)."""
    sha = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            for i in range(0, len(view), _CHUNK):
                chunk = view[i : i + _CHUNK]
                pending = hasher_pool.submit(sha.update, chunk)
                _write_all(fd, chunk)
                pending.result()
                size += len(chunk)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size, sha.hexdigest()


def _safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> list:
    """The safetensors encoding of `tensors`, as a header plus zero-copy views of the data.

    Larger element sizes first, so every tensor lands aligned (the header is padded to 8).
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {}
    offset = 0
    for key in order:
        t = tensors[key]
        if t.dtype not in _ST_DTYPES:
            raise SnapshotError(f"tensor {key!r} has dtype {t.dtype}, which the snapshot format cannot store")
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw] + [_byte_view(tensors[k]) for k in order]


def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        text = (path / MANIFEST).read_text()
    except FileNotFoundError:
        raise SnapshotInvalid(path, MANIFEST, "missing (the snapshot was never completed)") from None
    except OSError as e:
        raise SnapshotInvalid(path, MANIFEST, f"unreadable: {e.strerror}") from None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise SnapshotInvalid(path, MANIFEST, f"not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotInvalid(path, MANIFEST, f"not an {FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise SnapshotInvalid(path, MANIFEST, "lists no files")
    for name, meta in files.items():
        if "/" in name or name in (".", "..") or not isinstance(meta, dict) or not {"size", "sha256"} <= meta.keys():
            raise SnapshotInvalid(path, MANIFEST, f"bad file entry {name!r}")
    return manifest


def verify_snapshot(path: str | os.PathLike, *, progress: Callable[[int], None] | None = None, workers: int | None = None) -> dict:
    """Checks every file of a snapshot against its manifest (size, then SHA-256); returns the
    manifest, or raises SnapshotInvalid naming the first file at fault. `progress(n)` is called
    with each number of bytes hashed, from worker threads."""
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    for name, meta in sorted(files.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            raise SnapshotInvalid(path, name, "missing") from None
        if size != int(meta["size"]):
            raise SnapshotInvalid(path, name, f"size {size} bytes, manifest says {meta['size']} (partial or altered)")

    def digest(name: str) -> tuple[str, str]:
        sha = hashlib.sha256()
        with open(path / name, "rb", buffering=0) as f:
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                sha.update(view[:n])
                if progress:
                    progress(n)
        return name, sha.hexdigest()

    # Largest first, so the longest hash starts at once; files hash in parallel.
    names = sorted(files, key=lambda n: -int(files[n]["size"]))
    with ThreadPoolExecutor(max_workers=workers or min(len(names), os.cpu_count() or 1)) as pool:
        digests = dict(pool.map(digest, names))
    for name in sorted(files):
        if digests[name] != files[name]["sha256"]:
            raise SnapshotInvalid(path, name, "SHA-256 differs from the manifest (corrupted)")
    return manifest


def list_snapshots(root: str | os.PathLike, *, include_incomplete: bool = False) -> list[SnapshotInfo]:
    """Snapshots under `root`: a snapshot directory, a directory of them, or one of rank
    subdirectories. Sorted by (rank, step). Incomplete ones (temporary names left by a crash)
    only with include_incomplete."""
    root = Path(root)
    if (root / MANIFEST).exists() or STEP_DIR.match(root.name):
        return [_info(root, None)]
    out: list[SnapshotInfo] = []
    if not root.is_dir():
        return out
    ranks = sorted(p for p in root.iterdir() if p.is_dir() and RANK_DIR.match(p.name))
    for base, rank in ([(p, int(RANK_DIR.match(p.name).group(1))) for p in ranks] or [(root, None)]):
        for p in base.iterdir():
            if not p.is_dir():
                continue
            if STEP_DIR.match(p.name):
                out.append(_info(p, rank))
            elif include_incomplete and p.name.startswith(TEMP_PREFIX):
                m = re.match(r"^\.tmp-step_(\d+)-", p.name)
                out.append(SnapshotInfo(p, int(m.group(1)) if m else -1, rank, False))
    return sorted(out, key=lambda i: (i.rank or 0, i.step, i.complete))


def _info(path: Path, rank: int | None) -> SnapshotInfo:
    m = STEP_DIR.match(path.name)
    try:
        manifest = read_manifest(path)
    except SnapshotInvalid:
        return SnapshotInfo(path, int(m.group(1)) if m else -1, rank, False)
    return SnapshotInfo(path, int(manifest.get("step", m.group(1) if m else -1)), manifest.get("rank", rank), True, manifest)


def load_snapshot(path: str | os.PathLike, *, verify: bool = True) -> tuple[dict[str, dict[str, torch.Tensor]], dict, dict]:
    """(tensors per file, train-state objects, manifest) of a snapshot, verified first."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest = verify_snapshot(path) if verify else read_manifest(path)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name in manifest["files"]:
        if not name.endswith(".safetensors"):
            continue
        try:  # a private mapping of the file: model tensors are copied into the model from it
            loaded = load_file(path / name)
        except Exception as e:  # a file that passed its hash but does not parse: refuse it
            raise SnapshotInvalid(path, name, f"not a readable safetensors file: {e}") from None
        # optimizer tensors become the optimizer's state: fresh memory, not the file's pages
        # (measured: as fast as torch.load, twice as fast as safetensors' pread backend here)
        tensors[name] = {k: (v.clone() if k.startswith("optim/") else v) for k, v in loaded.items()}
    try:
        objects = torch.load(path / TRAIN_STATE, weights_only=True, map_location="cpu")
    except Exception as e:
        raise SnapshotInvalid(path, TRAIN_STATE, f"not loadable with weights_only=True: {e}") from None
    if not isinstance(objects, dict) or objects.get("format") != FORMAT:
        raise SnapshotInvalid(path, TRAIN_STATE, f"not an {FORMAT} train state")
    if objects.get("step") != manifest.get("step"):
        raise SnapshotInvalid(path, TRAIN_STATE, f"step {objects.get('step')} differs from the manifest's {manifest.get('step')}")
    return tensors, objects, manifest


# ---------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class MemorySnapshot:
    """One snapshot held in host memory. Buffers are reused by later snapshots once this one
    is neither kept nor being written."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # file name -> key -> host tensor
    objects: dict  # everything else, weights_only-serialisable
    binding: dict
    nbytes: int
    created: float = field(default_factory=time.time)
    ready: list = field(default_factory=list)  # CUDA events the copies complete at
    pins: int = 0  # disk writes in progress or queued
    retired: bool = False  # no longer kept; buffers free once unpinned
    disk_path: Path | None = None

    def wait_ready(self) -> None:
        for ev in self.ready:
            ev.synchronize()

    def is_ready(self) -> bool:
        """Whether its device-to-host copies have completed (never blocks)."""
        return all(ev.query() for ev in self.ready)


def _to_host(obj: Any) -> Any:
    """A deep copy of obj with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if type(obj) is dict:
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, dict):  # OrderedDict, Counter (MultiStepLR milestones): keep the type
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _to_host(v)
        return out
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


def _rng_state() -> dict:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    try:
        import numpy as np
    except ImportError:  # numpy is optional for the hook library
        return state
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _as_tuple(obj: Any) -> Any:
    return tuple(_as_tuple(v) for v in obj) if isinstance(obj, (list, tuple)) else obj


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)


class SnapshotEngine:
    """Snapshots and restores a training job's state; see the module docstring.

    mpus: name -> (mpu_id, module), modules being submodules of `model`.
    data: an object with state_dict()/load_state_dict() (mscale.snapshot.data.ResumableLoader,
    ResumableFileStream, or e.g. torchdata's StatefulDataLoader); skip_batch rollbacks need its
    `last_batch_position` and `skip_batch_at(position)`.
    extra: name -> object with state_dict()/load_state_dict(), snapshotted alongside.
    binding: returns mpu_id -> {"gpu": index, "gpu_uuid": uuid} (e.g. the simulated binding);
    by default read from the device of each MPU's first parameter.
    emit: called with every Finding (from the training thread or the writer thread).
    group: the torch.distributed process group (default: the world, when initialised).
    copy_threads: threads for host copies (default: min(4, CPUs)).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        mpus: Mapping[str, tuple[str, nn.Module]] | None = None,
        scaler: Any = None,
        scheduler: Any = None,
        data: Any = None,
        extra: Mapping[str, Any] | None = None,
        directory: str | os.PathLike | None = None,
        memory_every: int = 10,
        memory_keep: int = 2,
        disk_every: int = 100,
        disk_keep: int = 3,
        binding: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
        emit: Callable[[Finding], None] | None = None,
        job_id: str = "",
        group: Any = None,
        copy_threads: int | None = None,
    ) -> None:
        if memory_every < 0 or disk_every < 0:
            raise ValueError("memory_every and disk_every must be >= 0 (0: never)")
        if memory_keep < 1 or disk_keep < 1:
            raise ValueError("memory_keep and disk_keep must be >= 1")
        self.model, self.optimizer = model, optimizer
        self.scaler, self.scheduler, self.data = scaler, scheduler, data
        self.extra = dict(extra or {})
        self.memory_every, self.memory_keep = memory_every, memory_keep
        self.disk_every, self.disk_keep = disk_every, disk_keep
        self.job_id, self.group = job_id, group
        self._binding_fn, self._emit_fn = binding, emit
        self.rank, self.world_size = mdist.rank_and_size(group)
        self.step = 0
        self.findings: deque[Finding] = deque(maxlen=256)
        self.recovery_seconds: dict[str, float] = {}  # checkpoint_recovery_time_seconds{tag}
        self.recoveries: deque[dict] = deque(maxlen=64)
        self.last_capture_seconds = 0.0
        self.last_write: dict = {}
        self._mpus = self._check_mpus(mpus or {})
        self._prefixes = sorted(self._mpus.values(), key=lambda pf: -len(pf[0]))
        self._opt_names = self._optimizer_names() if optimizer is not None else []
        self._lock = threading.Lock()
        self._kept: list[MemorySnapshot] = []  # oldest first
        self._spare: list[MemorySnapshot] = []  # retired, unpinned: buffers to reuse
        self._streams: dict[torch.device, Any] = {}
        self.directory = Path(directory) if directory is not None else None
        self.rank_dir = None
        if self.directory is not None:
            self.rank_dir = self.directory / f"rank_{self.rank:05d}" if self.world_size > 1 else self.directory
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            self._clean_leftovers()
        self._jobs: deque = deque()
        self._wake_r = self._wake_w = -1
        self._writer: threading.Thread | None = None
        self._hasher: ThreadPoolExecutor | None = None
        self._closed = False
        self._prev_handler: Any = None
        self._resumed: tuple[int, Path] | None = None
        self.copy_threads = copy_threads if copy_threads is not None else min(4, os.cpu_count() or 1)
        self._copy_pool: ThreadPoolExecutor | None = None
        if self.directory is not None:
            self._start_writer()

    # -- set-up -----------------------------------------------------------------------
    def _check_mpus(self, mpus: Mapping[str, tuple[str, nn.Module]]) -> dict[str, tuple[str, str]]:
        """mpu_id -> (module prefix in the model, file name)."""
        prefix_of = {id(m): name for name, m in self.model.named_modules(remove_duplicate=False)}
        out: dict[str, tuple[str, str]] = {}
        self.mpu_names: dict[str, str] = {}
        for name, (mpu_id, module) in mpus.items():
            if id(module) not in prefix_of:
                raise ValueError(f"MPU {name!r} ({mpu_id}) is not a submodule of the model")
            if mpu_id in out:
                raise ValueError(f"MPU id {mpu_id!r} used twice")
            out[mpu_id] = (prefix_of[id(module)], f"mpu_{_safe_name(mpu_id)}_{_safe_name(name)}_state.safetensors")
            self.mpu_names[mpu_id] = name
        self._mpu_modules = {mpu_id: module for name, (mpu_id, module) in mpus.items()}
        return out

    def _file_of(self, key: str, *, optim: bool = False) -> str:
        """The file a model key (or, optim, the optimizer state of a parameter) goes to.
        Model and optimizer state are separate files: more files hash in parallel."""
        for prefix, fname in self._prefixes:
            if prefix == "" or key == prefix or key.startswith(prefix + "."):
                return fname.replace("_state.safetensors", "_optim.safetensors") if optim else fname
        return NONMPU_OPTIM_FILE if optim else NONMPU_FILE

    def _optimizer_names(self) -> list[str]:
        """Fully qualified name of each optimizer parameter, in state_dict index order."""
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        names = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in name_of:
                    raise ValueError("the optimizer holds a parameter that is not in the model")
                names.append(name_of[id(p)])
        return names

    def _refresh_names(self) -> None:
        # Parameter groups added after the engine was made (add_param_group) join the names.
        if len(self._opt_names) != sum(len(g["params"]) for g in self.optimizer.param_groups):
            self._opt_names = self._optimizer_names()

    def _clean_leftovers(self) -> None:
        # Temporary directories of writers that died (kill -9, power loss): never complete.
        for p in self.rank_dir.iterdir():
            if p.is_dir() and (p.name.startswith(TEMP_PREFIX) or p.name.startswith(ASIDE_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)

    # -- findings ---------------------------------------------------------------------
    def _emit(self, reason: Reason, severity: Severity, message: str, **labels: Any) -> Finding:
        base = {"rank": str(self.rank)}
        if self.job_id:
            base["job_id"] = self.job_id
        finding = Finding("snapshot", reason, severity, message, {**base, **{k: str(v) for k, v in labels.items()}})
        self.findings.append(finding)
        level = {Severity.CRITICAL: "error", Severity.WARNING: "warning"}.get(severity, "info")
        getattr(log, level)(message, reason=reason.value, rank=self.rank, **labels)
        if self._emit_fn is not None:
            try:
                self._emit_fn(finding)
            except Exception:  # a broken consumer must not stop snapshots
                log.exception("finding consumer failed", reason=reason.value)
        return finding

    # -- capture ----------------------------------------------------------------------
    def _live_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """References to the live tensors per file, and a host copy of everything else."""
        files: dict[str, dict[str, torch.Tensor]] = {}
        for _, f in [*self._mpus.values(), ("", NONMPU_FILE)]:
            files[f] = {}
            if self.optimizer is not None:
                files[f.replace("_state.safetensors", "_optim.safetensors")] = {}
        for key, t in self.model.state_dict().items():
            files[self._file_of(key)]["model/" + key] = t
        objects: dict[str, Any] = {"format": FORMAT, "step": self.step}
        if self.optimizer is not None:
            self._refresh_names()
            osd = self.optimizer.state_dict()
            scalars: dict[str, dict] = {}
            for idx, st in osd["state"].items():
                fqn = self._opt_names[idx]
                f = self._file_of(fqn, optim=True)
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        files[f][f"optim/{fqn}/{k}"] = v
                    else:
                        scalars.setdefault(fqn, {})[k] = copy.deepcopy(v)
            groups = [{**{k: _to_host(v) for k, v in g.items() if k != "params"}, "params": [self._opt_names[i] for i in g["params"]]} for g in osd["param_groups"]]
            objects["optimizer"] = {"class": type(self.optimizer).__name__, "param_groups": groups, "scalars": scalars}
        if self.scaler is not None:
            objects["scaler"] = _to_host(self.scaler.state_dict())
        if self.scheduler is not None:
            objects["scheduler"] = _to_host(self.scheduler.state_dict())
        if self.data is not None:
            objects["data"] = _to_host(self.data.state_dict())
        objects["extra"] = {name: _to_host(obj.state_dict()) for name, obj in self.extra.items()}
        objects["rng"] = _rng_state()
        return files, objects

    def _binding(self) -> dict:
        custom = dict(self._binding_fn() or {}) if self._binding_fn else {}
        mpus = {}
        for mpu_id, module in self._mpu_modules.items():
            p = next(module.parameters(), None)
            dev = p.device if p is not None else torch.device("cpu")
            entry: dict[str, Any] = {"name": self.mpu_names[mpu_id], "device": str(dev), "gpu": None, "gpu_uuid": None}
            if dev.type == "cuda":
                entry["gpu"] = dev.index if dev.index is not None else torch.cuda.current_device()
                entry["gpu_uuid"] = str(getattr(torch.cuda.get_device_properties(entry["gpu"]), "uuid", "")) or None
            entry.update({k: v for k, v in dict(custom.get(mpu_id, {})).items()})
            mpus[mpu_id] = entry
        return {"rank": self.rank, "world_size": self.world_size, "host": platform.node(), "job_id": self.job_id, "mpus": mpus}

    def _buffers_for(self, files: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Host buffers shaped like `files`, reused where they fit: those of the oldest kept
        snapshot when keeping this one would evict it anyway (so `memory_keep` sets of buffers
        suffice), else of a retired one. Fresh host memory costs page faults on first touch,
        often more than the copy itself."""
        with self._lock:
            old = None
            if len(self._kept) >= self.memory_keep and self._kept[0].pins == 0:
                old = self._kept.pop(0)
                old.retired = True
            elif self._spare:
                old = self._spare.pop()
        pin = any(t.is_cuda for d in files.values() for t in d.values())
        out: dict[str, dict[str, torch.Tensor]] = {}
        for fname, d in files.items():
            prev = old.tensors.get(fname, {}) if old else {}
            out[fname] = {}
            for key, t in d.items():
                b = prev.get(key)
                if b is None or b.shape != t.shape or b.dtype != t.dtype:
                    b = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                out[fname][key] = b
        return out

    def _copy_state(self, files: dict[str, dict[str, torch.Tensor]], bufs: dict[str, dict[str, torch.Tensor]]) -> list:
        """Copies live tensors into host buffers; on GPU, enqueued on a side stream per device
        (the default stream waits for it before touching the sources again). Returns the
        CUDA events marking completion (none on CPU)."""
        started: set = set()
        host: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for fname, d in files.items():
                for key, src in d.items():
                    dst = bufs[fname][key]
                    if src.is_cuda:
                        stream = self._streams.get(src.device)
                        if stream is None:
                            stream = self._streams[src.device] = torch.cuda.Stream(src.device)
                        if src.device not in started:
                            stream.wait_stream(torch.cuda.current_stream(src.device))
                            started.add(src.device)
                        with torch.cuda.stream(stream):
                            dst.copy_(src, non_blocking=True)
                    else:
                        host.append((dst, src))
        self._parallel_copy(host)
        events = []
        for dev in started:
            ev = torch.cuda.Event()
            ev.record(self._streams[dev])
            torch.cuda.current_stream(dev).wait_event(ev)
            events.append(ev)
        return events

    def _parallel_copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for every pair, spread over a few threads by bytes (copy_ releases
        the GIL). Measured here: steadier than torch's intra-op threads, which degrade badly
        when other processes hold the cores."""
        n = min(self.copy_threads, len(pairs))
        if n <= 1:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
            return
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(max_workers=self.copy_threads, thread_name_prefix="mscale-snapshot-copy")
        buckets: list[list] = [[] for _ in range(n)]
        loads = [0] * n
        for dst, src in sorted(pairs, key=lambda p: -p[0].numel() * p[0].element_size()):
            i = loads.index(min(loads))
            buckets[i].append((dst, src))
            loads[i] += dst.numel() * dst.element_size()

        def run(bucket: list) -> None:
            with torch.no_grad():
                for dst, src in bucket:
                    dst.copy_(src)

        list(self._copy_pool.map(run, buckets))

    def snapshot(self, step: int | None = None) -> MemorySnapshot:
        """Takes an in-memory snapshot of the current state now (at a step boundary)."""
        if step is not None:
            self.step = step
        t0 = time.perf_counter()
        files, objects = self._live_state()
        bufs = self._buffers_for(files)
        events = self._copy_state(files, bufs)
        nbytes = sum(t.numel() * t.element_size() for d in bufs.values() for t in d.values())
        snap = MemorySnapshot(self.step, bufs, objects, self._binding(), nbytes, ready=events)
        with self._lock:
            self._kept = [s for s in self._kept if s.step != snap.step]
            self._kept.append(snap)
            while len(self._kept) > self.memory_keep:
                self._retire(self._kept.pop(0))
        self.last_capture_seconds = time.perf_counter() - t0
        log.debug("memory snapshot", step=self.step, bytes=nbytes, seconds=round(self.last_capture_seconds, 6))
        return snap

    def _retire(self, snap: MemorySnapshot) -> None:
        # With the lock held. Keep at most one spare set of buffers: bounded memory.
        snap.retired = True
        if snap.pins == 0 and not self._spare:
            self._spare.append(snap)

    def _unpin(self, snap: MemorySnapshot) -> None:
        with self._lock:
            snap.pins -= 1
            if snap.retired and snap.pins == 0 and not self._spare:
                self._spare.append(snap)

    @property
    def memory_steps(self) -> list[int]:
        with self._lock:
            return [s.step for s in self._kept]

    def latest(self) -> MemorySnapshot | None:
        with self._lock:
            return self._kept[-1] if self._kept else None

    # -- the per-step hook --------------------------------------------------------------
    def step_end(self, step: int) -> None:
        """Call after step `step` completed (optimizer and scheduler stepped)."""
        self.step = step
        to_disk = self.directory is not None and self.disk_every and step % self.disk_every == 0
        if (self.memory_every and step % self.memory_every == 0) or to_disk:
            snap = self.snapshot()
            if to_disk:
                self._queue_write(snap, why="schedule")

    # -- disk -------------------------------------------------------------------------
    def _start_writer(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # Two files are written at once, each hashed chunk by chunk in a helper thread while
        # the chunk is written: SHA-256 (~1.5 GB/s a core) would otherwise bound the write.
        self._hasher = ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="mscale-snapshot-hash")
        self._file_writers = ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="mscale-snapshot-write")
        self._writer = threading.Thread(target=self._writer_loop, name="mscale-snapshot-writer", daemon=True)
        self._writer.start()

    def _post(self, job: tuple) -> None:
        # Lock-free, so it is safe from a signal handler: deque.append is atomic, and the
        # pipe write end is non-blocking (a full pipe already means a wake-up is pending).
        if self._closed:
            job[2].set_exception(SnapshotError("the snapshot engine is closed"))
            return
        self._jobs.append(job)
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass

    def _queue_write(self, snap: MemorySnapshot, *, why: str) -> Future:
        fut: Future = Future()
        if self.directory is None:
            fut.set_exception(SnapshotError("no snapshot directory configured"))
            return fut
        with self._lock:
            snap.pins += 1
        self._post(("write", snap, fut, why))
        return fut

    def save(self, *, wait: bool = False, timeout: float | None = None) -> Future:
        """On demand: snapshot the current state and write it to disk in the background."""
        latest = self.latest()
        snap = latest if latest is not None and latest.step == self.step else self.snapshot()
        fut = self._queue_write(snap, why="demand")
        if wait:
            fut.result(timeout)
        return fut

    def emergency(self, why: str = "command") -> Future:
        """Writes the newest in-memory snapshot to disk now (it is not re-taken: the live state
        may be what failed). Safe to call from any thread and from a signal handler."""
        fut: Future = Future()
        if self.directory is None:
            fut.set_exception(SnapshotError("no snapshot directory configured"))
            return fut
        self._post(("emergency", None, fut, why))
        return fut

    def install_signal_handler(self, signum: int = signal.SIGUSR1) -> None:
        """SIGUSR1 (by default) writes the newest in-memory snapshot. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        self._prev_handler = (signum, signal.signal(signum, lambda s, f: self.emergency(why=f"signal {signal.Signals(s).name}")))

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every disk write queued so far is finished (written or failed)."""
        if self._writer is None:
            return
        fut: Future = Future()
        self._post(("barrier", None, fut, ""))
        fut.result(timeout)

    def _writer_loop(self) -> None:
        while True:
            if not self._jobs:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    return
                continue
            kind, snap, fut, why = self._jobs.popleft()
            if kind == "stop":
                fut.set_result(None)
                return
            if kind == "barrier":
                fut.set_result(None)
                continue
            if kind == "prune_after":
                try:
                    self._prune_after(snap)
                except OSError as e:
                    log.error("could not remove snapshots of the abandoned timeline", error=str(e))
                fut.set_result(None)
                continue
            if kind == "emergency":
                with self._lock:
                    # The newest whose copies have landed: a GPU that stopped answering never
                    # completes the copy in flight, and waiting for it would hang the writer.
                    ready = [s for s in self._kept if s.is_ready()]
                    snap = ready[-1] if ready else None
                    if snap is not None:
                        snap.pins += 1
                if snap is None and self._resumed is not None:  # the newest state saved is on disk already
                    fut.set_result(self._resumed[1])
                    continue
                if snap is None:
                    self._emit(Reason.SNAPSHOT_FAILED, Severity.CRITICAL, f"emergency snapshot ({why}): no in-memory snapshot to write", why=why)
                    fut.set_exception(SnapshotError("no in-memory snapshot to write"))
                    continue
                if snap.disk_path is not None and (snap.disk_path / MANIFEST).exists():
                    self._unpin(snap)
                    log.info("emergency snapshot already on disk", step=snap.step, path=str(snap.disk_path))
                    fut.set_result(snap.disk_path)
                    continue
            elif why == "schedule" and any(j[0] == "write" for j in list(self._jobs)):
                # A newer scheduled write is queued behind: the disk is slower than the schedule.
                self._unpin(snap)
                log.warning("scheduled disk snapshot superseded before it was written", step=snap.step)
                fut.set_result(None)
                continue
            try:
                fut.set_result(self._write(snap, why))
            except BaseException as e:  # reported as a Finding by _write; never kill the writer
                fut.set_exception(e)
            finally:
                self._unpin(snap)

    def _write(self, snap: MemorySnapshot, why: str) -> Path:
        t0 = time.perf_counter()
        name = f"step_{snap.step:08d}"
        final = self.rank_dir / name
        tmp = self.rank_dir / f"{TEMP_PREFIX}{name}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            snap.wait_ready()
            train_state = io.BytesIO()
            torch.save(snap.objects, train_state)
            try:  # refuse at write time what could not be loaded safely later
                torch.load(io.BytesIO(train_state.getvalue()), weights_only=True)
            except Exception as e:
                raise SnapshotError(f"the training state holds objects that weights_only loading refuses: {e}") from None
            tmp.mkdir()
            files: dict[str, dict] = {}
            meta = {"format": FORMAT, "step": str(snap.step)}
            def write(fname: str) -> tuple[str, tuple[int, str]]:
                # fsync in the writer: the device flushes one file while the other writer
                # thread is still hashing and copying the next.
                return fname, _write_file(tmp / fname, _safetensors_parts(snap.tensors[fname], meta), self._hasher)

            by_size = sorted(snap.tensors, key=lambda f: -sum(t.numel() * t.element_size() for t in snap.tensors[f].values()))
            futures = [self._file_writers.submit(write, f) for f in by_size]
            wait_futures(futures)  # all of them, even when one failed: then the cleanup is whole
            for fname, (size, sha) in sorted(f.result() for f in futures):
                files[fname] = {"size": size, "sha256": sha}
            size, sha = _write_file(tmp / TRAIN_STATE, [train_state.getbuffer()], self._hasher)
            files[TRAIN_STATE] = {"size": size, "sha256": sha}
            raw = json.dumps(snap.binding, indent=2, sort_keys=True).encode()
            size, sha = _write_file(tmp / BINDING, [raw], self._hasher)
            files[BINDING] = {"size": size, "sha256": sha}
            manifest = {
                "format": FORMAT,
                "step": snap.step,
                "rank": self.rank,
                "world_size": self.world_size,
                "job_id": self.job_id,
                "created_unix": snap.created,
                "why": why,
                "versions": {"mscale": __version__, "torch": torch.__version__, "python": platform.python_version()},
                "mpus": {mpu_id: {"name": self.mpu_names[mpu_id], "file": f, "optim_file": f.replace("_state.", "_optim.")}
                         for mpu_id, (_, f) in self._mpus.items()},
                "files": files,
            }
            # Written last: a directory with a manifest had every other file fsynced first.
            _write_file(tmp / MANIFEST, [json.dumps(manifest, indent=2, sort_keys=True).encode()], self._hasher)
            _fsync_dir(tmp)
            aside = None
            if final.exists():  # the same step again (after a rollback): replace it whole
                aside = self.rank_dir / f"{ASIDE_PREFIX}{name}-{os.urandom(4).hex()}"
                os.rename(final, aside)
            os.rename(tmp, final)
            _fsync_dir(self.rank_dir)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                code = errno.errorcode.get(e.errno or 0, str(e.errno))
                msg = f"snapshot of step {snap.step} not written to {self.rank_dir}: {e.strerror or e} ({code}); training continues, the in-memory snapshot is kept"
                self._emit(Reason.SNAPSHOT_FAILED, Severity.CRITICAL, msg, step=snap.step, errno=code, why=why)
            else:
                self._emit(Reason.SNAPSHOT_FAILED, Severity.CRITICAL, f"snapshot of step {snap.step} not written: {e}", step=snap.step, why=why)
            raise
        snap.disk_path = final
        seconds = time.perf_counter() - t0
        total = sum(f["size"] for f in files.values())
        self.last_write = {"step": snap.step, "bytes": total, "seconds": seconds, "path": str(final)}
        self._emit(Reason.SNAPSHOT_WRITTEN, Severity.INFO, f"snapshot of step {snap.step} written to {final} ({total} bytes, {seconds:.3f} s)",
                   step=snap.step, why=why, bytes=total, seconds=f"{seconds:.6f}")  # the agent's snapshot metrics
        try:
            self._prune()
        except OSError as e:
            log.error("could not remove old snapshots", error=str(e), keep=self.disk_keep)
        return final

    def _remove(self, path: Path) -> None:
        # Renamed away first (atomic), so a crash mid-delete never leaves a step_ directory
        # with some files gone; leftovers are removed at the next start.
        aside = self.rank_dir / f"{ASIDE_PREFIX}{path.name}-{os.urandom(4).hex()}"
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)

    def _prune(self) -> None:
        complete = [i for i in list_snapshots(self.rank_dir) if i.path.parent == self.rank_dir and i.complete]
        for info in sorted(complete, key=lambda i: i.step)[: -self.disk_keep]:
            self._remove(info.path)
        _fsync_dir(self.rank_dir)

    def _prune_after(self, step: int) -> None:
        # Snapshots newer than a rollback target belong to the abandoned timeline.
        for info in list_snapshots(self.rank_dir):
            if info.step > step and info.path.parent == self.rank_dir:
                self._remove(info.path)
                log.info("removed snapshot of the abandoned timeline", step=info.step, path=str(info.path))
        _fsync_dir(self.rank_dir)

    def disk_snapshots(self) -> list[SnapshotInfo]:
        if self.rank_dir is None:
            return []
        return [i for i in list_snapshots(self.rank_dir) if i.complete and i.path.parent == self.rank_dir]

    # -- restore ----------------------------------------------------------------------
    def _check_fits(self, tensors: dict[str, dict[str, torch.Tensor]], objects: dict, where: str) -> None:
        model_keys = {k[6:]: t for d in tensors.values() for k, t in d.items() if k.startswith("model/")}
        live = self.model.state_dict()
        missing, unexpected = live.keys() - model_keys.keys(), model_keys.keys() - live.keys()
        if missing or unexpected:
            raise SnapshotError(f"{where} does not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        for k, t in live.items():
            if tuple(model_keys[k].shape) != tuple(t.shape):
                raise SnapshotError(f"{where} does not fit the model: {k} has shape {tuple(model_keys[k].shape)}, the model {tuple(t.shape)}")
        if self.optimizer is not None:
            self._refresh_names()
            saved = objects.get("optimizer")
            if saved is None:
                raise SnapshotError(f"{where} holds no optimizer state")
            ours = []
            i = 0
            for g in self.optimizer.param_groups:
                ours.append(self._opt_names[i : i + len(g["params"])])
                i += len(g["params"])
            theirs = [g["params"] for g in saved["param_groups"]]
            if ours != theirs:
                raise SnapshotError(f"{where}: the optimizer's parameter groups differ from the snapshot's")
        for name, obj in (("scaler", self.scaler), ("scheduler", self.scheduler), ("data", self.data)):
            if obj is not None and name not in objects:
                raise SnapshotError(f"{where} holds no {name} state")
        for name in self.extra:
            if name not in objects.get("extra", {}):
                raise SnapshotError(f"{where} holds no state for {name!r}")

    def _apply(self, tensors: dict[str, dict[str, torch.Tensor]], objects: dict, *, where: str, owned: bool = False) -> None:
        """Restores the live objects from a snapshot's tensors and objects. owned: the tensors
        are fresh (read from disk) and may become the optimizer's state without a copy."""
        self._check_fits(tensors, objects, where)
        if self.data is not None:  # first: it validates before it changes anything
            self.data.load_state_dict(copy.deepcopy(objects["data"]))
        model_sd: dict[str, torch.Tensor] = {}
        opt_tensors: dict[str, dict[str, torch.Tensor]] = {}
        for d in tensors.values():
            for k, t in d.items():
                if k.startswith("model/"):
                    model_sd[k[6:]] = t
                elif k.startswith("optim/"):
                    fqn, _, name = k[6:].rpartition("/")
                    opt_tensors.setdefault(fqn, {})[name] = t
        if any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in self.model.modules()):
            with torch.no_grad():  # the model customises loading: go through it
                self.model.load_state_dict(model_sd, strict=True)
        else:  # keys and shapes were checked: copy in place, in parallel
            live = self.model.state_dict()
            self._parallel_copy([(live[k], t) for k, t in model_sd.items()])
        if self.optimizer is not None:
            self._restore_optimizer(opt_tensors, objects["optimizer"], owned=owned)
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(objects["scaler"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(objects["scheduler"]))
        for name, obj in self.extra.items():
            obj.load_state_dict(copy.deepcopy(objects["extra"][name]))
        _set_rng_state(objects["rng"])
        self.step = int(objects["step"])

    def _restore_optimizer(self, opt_tensors: dict[str, dict[str, torch.Tensor]], saved: dict, *, owned: bool = False) -> None:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        wanted = {}
        for fqn in self._opt_names:  # index order, as the optimizer itself would hold it
            if fqn in opt_tensors or fqn in saved["scalars"]:
                wanted[fqn] = {**saved["scalars"].get(fqn, {}), **opt_tensors.get(fqn, {})}
        # In place when the live state has the same structure (a rollback): no allocation, and
        # the snapshot's buffers are never aliased by the optimizer.
        in_place = True
        for p, fqn in zip(params, self._opt_names):
            cur, want = opt.state.get(p, {}), wanted.get(fqn, {})
            if cur.keys() != want.keys() or any(
                isinstance(v, torch.Tensor) != isinstance(cur[k], torch.Tensor)
                or (isinstance(v, torch.Tensor) and (v.shape != cur[k].shape or v.dtype != cur[k].dtype))
                for k, v in want.items()
            ):
                in_place = False
                break
        with torch.no_grad():
            if in_place:
                pairs = []
                for p, fqn in zip(params, self._opt_names):
                    cur = opt.state.get(p)
                    for k, v in wanted.get(fqn, {}).items():
                        if isinstance(v, torch.Tensor):
                            pairs.append((cur[k], v))
                        else:
                            cur[k] = copy.deepcopy(v)
                self._parallel_copy(pairs)
                for g, sg in zip(opt.param_groups, saved["param_groups"]):
                    for k, v in sg.items():
                        if k != "params":
                            g[k] = copy.deepcopy(v) if not isinstance(v, torch.Tensor) else v.clone()
                return
        index = {fqn: i for i, fqn in enumerate(self._opt_names)}
        # In-memory buffers are cloned (the optimizer would otherwise update them in place).
        state = {index[fqn]: {k: ((v if owned else v.clone()) if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in want.items()}
                 for fqn, want in wanted.items()}
        groups = [{**copy.deepcopy({k: v for k, v in sg.items() if k != "params"}), "params": [index[n] for n in sg["params"]]} for sg in saved["param_groups"]]
        opt.load_state_dict({"state": state, "param_groups": groups})

    def rollback(self, step: int | None = None, *, skip_batch: bool = False) -> int:
        """Restores the newest in-memory snapshot (or the one at `step`) into the live objects;
        training continues at the returned step + 1. skip_batch: the batch last drawn (the one
        that caused the fault) is stepped over when the replay reaches it."""
        t0 = time.perf_counter()
        with self._lock:
            candidates = [s for s in self._kept if step is None or s.step == step]
            snap = candidates[-1] if candidates else None
            if snap is not None:
                snap.pins += 1
        resumed = self._resumed if snap is None and self._resumed and step in (None, self._resumed[0]) else None
        if snap is None and resumed is None:
            raise RollbackUnavailable(f"no in-memory snapshot{'' if step is None else f' of step {step}'} (held: {self.held_steps})")
        from_step = self.step
        bad = getattr(self.data, "last_batch_position", None) if skip_batch else None
        if skip_batch and (bad is None or not hasattr(self.data, "skip_batch_at")):
            if snap is not None:
                self._unpin(snap)
            raise SnapshotError("skip_batch needs a data object with last_batch_position and skip_batch_at()")
        if snap is not None:
            tag, target = "memory", snap.step
            try:
                snap.wait_ready()
                self._apply(snap.tensors, snap.objects, where=f"in-memory snapshot of step {snap.step}")
            finally:
                self._unpin(snap)
        else:  # no in-memory copy yet since the start-up resume: back to that disk snapshot
            tag, (target, path) = "disk", resumed
            tensors, objects, _ = load_snapshot(path)
            self._apply(tensors, objects, where=str(path), owned=True)
        if bad is not None:
            self.data.skip_batch_at(bad)
        with self._lock:  # snapshots newer than the target belong to the abandoned timeline
            for s in [s for s in self._kept if s.step > target]:
                self._kept.remove(s)
                self._retire(s)
        if self.directory is not None:
            self._post(("prune_after", target, Future(), ""))
        seconds = time.perf_counter() - t0
        self._record_recovery(tag, seconds, target)
        self._emit(
            Reason.ROLLBACK, Severity.WARNING,
            f"rolled back to the {'in-memory' if tag == 'memory' else 'disk'} snapshot of step {target} (last completed step {from_step}) in {seconds:.3f} s"
            + (", the faulty batch will be skipped" if bad is not None else ""),
            step=target, from_step=from_step, tag=tag, recovery_seconds=f"{seconds:.6f}",
        )
        return target

    @property
    def held_steps(self) -> list[int]:
        """Steps a rollback can go to: the in-memory snapshots, and the disk snapshot resumed
        from until the first in-memory one replaces it."""
        steps = self.memory_steps
        if self._resumed and not steps:
            steps = [self._resumed[0]]
        return steps

    def agree_rollback(self, fault: bool, *, skip_batch: bool = False) -> int | None:
        """Collective commit point: every rank calls it at the same point of each step with its
        own fault flag. If any rank has a fault, all ranks restore the newest step every rank
        holds in memory, or none does (RollbackUnavailable on every rank). None: no fault."""
        if self.world_size == 1:
            return self.rollback(skip_batch=skip_batch) if fault else None
        if not mdist.any_flag(fault, self.group):
            return None
        target = mdist.newest_common(self.held_steps, self.group)
        if target is None:
            self._emit(Reason.ROLLBACK, Severity.CRITICAL, "a rank reported a fault but no in-memory snapshot is held by every rank: no rank rolls back", step=self.step)
            raise RollbackUnavailable("no in-memory snapshot common to every rank")
        return self.rollback(target, skip_batch=skip_batch)

    def _record_recovery(self, tag: str, seconds: float, step: int) -> None:
        self.recovery_seconds[tag] = seconds
        self.recoveries.append({"tag": tag, "seconds": seconds, "step": step, "time": time.time()})

    def resume(self) -> int | None:
        """Start-up: restores the newest valid snapshot on disk (a corrupted or partial one is
        refused with the file named, and the next older used). Returns its step (training goes
        on at step + 1), or None when there is none. Collective when several ranks: all ranks
        resume the same step."""
        if self.rank_dir is None:
            return None
        t0 = time.perf_counter()
        # Every step_ directory counts, a bad manifest included: it exists only after the
        # rename, so a bad one is corruption to report, not an interrupted write.
        mine = sorted({i.step for i in list_snapshots(self.rank_dir) if i.path.parent == self.rank_dir}, reverse=True)
        steps = mdist.common_steps(mine, self.group) if self.world_size > 1 else mine
        for step in steps:
            path = self.rank_dir / f"step_{step:08d}"
            loaded, problem = None, None
            try:
                tensors, objects, _ = load_snapshot(path)
                self._check_fits(tensors, objects, str(path))
                loaded = (tensors, objects)
            except SnapshotInvalid as e:
                problem = e
                self._emit(Reason.SNAPSHOT_REFUSED, Severity.WARNING, f"{e}; trying an older snapshot", step=step, file=e.file)
            except SnapshotError as e:
                problem = e
                self._emit(Reason.SNAPSHOT_REFUSED, Severity.WARNING, f"{e}; trying an older snapshot", step=step)
            if self.world_size > 1 and mdist.any_flag(problem is not None, self.group):
                continue
            if loaded is None:
                continue
            self._apply(*loaded, where=str(path), owned=True)
            loaded = tensors = objects = None
            # Until the first in-memory snapshot, a rollback goes back to this one on disk:
            # copying 3x the parameter bytes again at start-up would double the restore time.
            self._resumed = (step, path)
            seconds = time.perf_counter() - t0
            self._record_recovery("disk", seconds, step)
            self._emit(Reason.SNAPSHOT_RESUMED, Severity.INFO, f"resumed from {path} (step {step}) in {seconds:.3f} s; training continues at step {step + 1}",
                       step=step, tag="disk", recovery_seconds=f"{seconds:.6f}")
            return step
        if steps:
            self._emit(Reason.SNAPSHOT_REFUSED, Severity.CRITICAL, f"no valid snapshot in {self.rank_dir}: starting from scratch")
        return None

    # -- shutdown ---------------------------------------------------------------------
    def close(self, timeout: float | None = 60.0) -> None:
        """Finishes queued writes and stops the writer thread."""
        if self._closed:
            return
        if self._prev_handler is not None:
            signum, prev = self._prev_handler
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, prev)
        if self._writer is not None:
            fut: Future = Future()
            self._post(("stop", None, fut, ""))
            self._closed = True
            self._writer.join(timeout)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._hasher.shutdown(wait=False)
            self._file_writers.shutdown(wait=False)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=False)
        self._closed = True

    def __enter__(self) -> "SnapshotEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict:
        return {
            "step": self.step,
            "memory_steps": self.memory_steps,
            "last_capture_seconds": self.last_capture_seconds,
            "last_write": dict(self.last_write),
            "recovery_seconds": dict(self.recovery_seconds),
        }


class SnapshotPlugin:
    """The engine as a Guard plugin, for jobs that use the guard without the Fuse (the Fuse
    drives the engine itself: give it the engine, not this plugin).

        plugin = SnapshotPlugin(directory="/ckpt", scheduler=sched, data=loader)
        guard.add_plugin(plugin)          # builds the engine from the guard's model and MPUs
        plugin.resume()                   # start-up: newest valid snapshot, guard step set

    - on_step_end: `engine.step_end(step)`, or, when a finding in `rollback_on` came during
      the step (its update was dropped with guard.request_skip), a rollback with the batch
      skipped; the guard continues at the restored step + 1. With several ranks this is the
      collective `agree_rollback` on every rank at every step end.
    - on_command: {"type": "emergency_snapshot"}, {"type": "snapshot"} (on demand),
      {"type": "rollback", "skip_batch": bool}; each answers {"ok": ..., ...}.
    - Findings the writer thread makes reach guard.emit in the training thread (at the next
      hook call), as the guard expects; ROLLBACK and SNAPSHOT_RESUMED carry the labels
      `tag` and `recovery_seconds` (checkpoint_recovery_time_seconds{tag}).
    """

    def __init__(self, engine: SnapshotEngine | None = None, *, rollback_on: Iterable[Reason] = (), skip_batch: bool = True,
                 **engine_kwargs: Any) -> None:
        if engine is not None and engine_kwargs:
            raise TypeError("give either an engine or the engine's keyword arguments, not both")
        self.engine, self._kwargs = engine, engine_kwargs
        self.rollback_on, self.skip_batch = frozenset(rollback_on), skip_batch
        self.guard: Any = None
        self._thread: threading.Thread | None = None
        self._pending: deque[Finding] = deque()
        self._fault: Finding | None = None
        self.rollbacks: list[dict] = []

    def on_attach(self, guard: Any) -> None:
        self.guard, self._thread = guard, threading.current_thread()
        if self.engine is None:
            mpus = {m.name: (m.mpu_id, m.module) for m in guard.mpus}
            self.engine = SnapshotEngine(guard.model, guard.optimizer, mpus=mpus, job_id=guard.job_id, emit=self._emit,
                                         binding=self._binding, **self._kwargs)
        else:
            self.engine._emit_fn = self.engine._emit_fn or self._emit
            self.engine._binding_fn = self.engine._binding_fn or self._binding
        if self.engine.scaler is not None and hasattr(guard, "watch_scaler"):
            guard.watch_scaler(self.engine.scaler)  # a step the scaler skips (NaN) must still end here

    def on_detach(self, guard: Any) -> None:
        self._drain()

    def _binding(self) -> dict:
        return {m.mpu_id: {"gpu": m.gpu, "gpu_uuid": m.gpu_uuid or None} for m in self.guard.mpus}

    def _emit(self, finding: Finding) -> None:
        if threading.current_thread() is self._thread:
            self.guard.emit(finding)
        else:
            self._pending.append(finding)

    def _drain(self) -> None:
        while self._pending:
            self.guard.emit(self._pending.popleft())

    def on_step_begin(self, step: int, batch: Any) -> None:
        self._drain()

    def on_finding(self, finding: Finding) -> None:
        if finding.reason in self.rollback_on and finding.source != "snapshot" and self._fault is None:
            self._fault = finding
            self.guard.request_skip(f"{finding.reason.value}: rollback")

    def on_step_end(self, step: int, loss: Any = None) -> None:
        self._drain()
        fault, self._fault = self._fault, None
        if self.engine.world_size > 1:  # a collective every step: all ranks roll back, or none
            try:
                to = self.engine.agree_rollback(fault is not None, skip_batch=self.skip_batch)
            except SnapshotError as e:
                self.rollbacks.append({"step": step, "to": None, "why": fault.reason.value if fault else "another rank", "error": str(e)})
                return
            if to is not None:
                self.guard.set_step(to + 1)
                self.rollbacks.append({"step": step, "to": to, "why": fault.reason.value if fault else "another rank"})
                return
        elif fault is not None:
            self.rollback(skip_batch=self.skip_batch, why=fault.reason.value, at_step=step)
            return
        self.engine.step_end(step)

    def rollback(self, *, skip_batch: bool | None = None, why: str = "", at_step: int | None = None) -> int | None:
        """Rolls back to the newest in-memory snapshot; the guard goes on at its step + 1."""
        try:
            to = self.engine.rollback(skip_batch=self.skip_batch if skip_batch is None else skip_batch)
        except SnapshotError as e:
            self.rollbacks.append({"step": at_step, "to": None, "why": why, "error": str(e)})
            self.engine._emit(Reason.ROLLBACK, Severity.CRITICAL, f"rollback ({why}) failed: {e}")
            return None
        self.guard.set_step(to + 1)
        self.rollbacks.append({"step": at_step, "to": to, "why": why})
        return to

    def resume(self) -> int | None:
        step = self.engine.resume()
        if step is not None:
            self.guard.set_step(step + 1)
        self._drain()
        return step

    def on_command(self, command: Mapping[str, Any]) -> dict | None:
        self._drain()
        kind = command.get("type")
        if kind == "emergency_snapshot":
            latest = self.engine.latest()
            self.engine.emergency(why=str(command.get("reason") or "agent command"))
            return {"ok": latest is not None, "step": latest.step if latest else None}
        if kind == "snapshot":
            self.engine.save()
            return {"ok": True, "step": self.engine.step}
        if kind == "rollback":
            to = self.rollback(skip_batch=bool(command.get("skip_batch", self.skip_batch)), why="agent command")
            return {"ok": to is not None, "step": to}
        return None
