"""The snapshot format on disk, read and written without torch or numpy.

Listing, verifying and inspecting snapshots need nothing but the standard library, so
`mscale snapshot list|verify|inspect` starts in milliseconds and runs where torch is not
installed: a manifest is JSON, digests are BLAKE3 (or hashlib's SHA-256), a safetensors file is an 8-byte
little-endian header length, a JSON header and then the data, and `train_state.pt` (a
torch.save zip archive) is read by train_state.py's unpickler, which builds only plain values
and refuses every other global.

Layout of a snapshot directory (`DIR/step_00000120`, or `DIR/rank_00003/step_00000120` when
several ranks share DIR):

    mpu_<id>_<name>_state.safetensors   model tensors of the MPU ("model/<fqn>")
    mpu_<id>_<name>_optim.safetensors   optimizer tensors of its parameters ("optim/<fqn>/<key>")
    nonmpu_state.safetensors            the same two for parameters and buffers outside any MPU
    nonmpu_optim.safetensors
    train_state.pt                      optimizer groups and scalars, scaler, scheduler, RNG,
                                        data position, step (weights_only-loadable objects)
    resource_binding.json               MPU -> device index and UUID
    manifest.json                       every file above with size and digest (digest.py); step, versions

A snapshot is written to `.tmp-step_N-...` and renamed to `step_N` once every file and the
manifest (written last) are fsynced, so a `step_` directory with a manifest is complete.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from mscale.snapshot.digest import Into, TreeHasher, read_and_verify
from mscale.snapshot.manifest import (
    BINDING,
    FORMAT,
    MANIFEST,
    MAX_BINDING_BYTES,
    MAX_MANIFEST_BYTES,
    NONMPU_FILE,
    NONMPU_OPTIM_FILE,
    TRAIN_STATE,
    FileMeta,
    Manifest,
    SnapshotError,
    SnapshotInvalid,
    check_binding,
    mpu_file,
    open_dir,
    open_file,
    optim_file,
    parse_manifest,
    rank_dir_name,
    read_small,
    step_dir_name,
)
from mscale.snapshot.train_state import TensorInfo, read_train_state
from mscale.snapshot.values import JSONObject, as_dict, as_list

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = [
    "SnapshotError",
    "SnapshotInvalid",
    "SnapshotInfo",
    "TensorInfo",
    "list_snapshots",
    "verify_snapshot",
    "read_manifest",
    "read_train_state",
    "summarize",
    "open_verified",
    "Verified",
    "FORMAT",
    "MANIFEST",
    "BINDING",
    "TRAIN_STATE",
    "NONMPU_FILE",
    "NONMPU_OPTIM_FILE",
    "step_dir_name",
    "rank_dir_name",
    "mpu_file",
    "optim_file",
]

STEP_DIR = re.compile(r"^step_(\d{8,})$")
RANK_DIR = re.compile(r"^rank_(\d{5,})$")
TEMP_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
CHUNK = 16 << 20  # write and hash granularity: large enough for syscall overhead to vanish


@dataclass(frozen=True)
class SnapshotInfo:
    path: Path
    step: int
    rank: int | None  # None: a single-process directory without rank subdirectories
    complete: bool  # manifest present and valid (written last: present means the rename happened)
    manifest: Manifest | None = None
    problem: str | None = None  # why a step_ directory's manifest is refused

    @property
    def nbytes(self) -> int:
        return sum(f["size"] for f in self.manifest["files"].values()) if self.manifest is not None else 0


# -- writing ------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
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


def write_file(
    path: Path,
    parts: Iterable[memoryview | bytes],
    hasher_pool: ThreadPoolExecutor,
    *,
    fsync: bool = True,
    mode: int = 0o644,
) -> tuple[int, FileMeta]:
    """Writes parts to a new file of `mode` (and fsyncs it unless told not to); returns (size,
    its entry for the manifest: size and digest). The hash of each chunk runs in a helper
    thread while the chunk is written (both release the GIL)."""
    sha = TreeHasher()
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            for i in range(0, len(view), CHUNK):
                chunk = view[i : i + CHUNK]
                pending = hasher_pool.submit(sha.update, chunk)
                _write_all(fd, chunk)
                pending.result()
                size += len(chunk)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size, {"size": size, "blake3_tree": sha.hexdigest()}


def safetensors_header(entries: Sequence[tuple[str, str, Sequence[int], int]], metadata: dict[str, str]) -> bytes:
    """The first bytes of a safetensors file whose tensors follow in the order of `entries`,
    each (key, dtype name such as "F32", shape, size in bytes): the header's length as 8
    little-endian bytes, then the JSON header, padded with spaces to a multiple of 8."""
    header: JSONObject = {}
    offset = 0
    for key, dtype, shape, nbytes in entries:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


# -- listing and verifying --------------------------------------------------------------


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the snapshot at `path`, checked (manifest.py), or SnapshotInvalid."""
    path = Path(path)
    dirfd = open_dir(path)
    try:
        return _read_manifest_at(dirfd, path)
    finally:
        os.close(dirfd)


def _read_manifest_at(dirfd: int, path: Path) -> Manifest:
    try:
        raw = read_small(dirfd, path, MANIFEST, MAX_MANIFEST_BYTES)
    except SnapshotInvalid as e:
        if e.why == "missing":
            raise SnapshotInvalid(path, MANIFEST, "missing (the snapshot was never completed)") from None
        raise
    manifest = parse_manifest(raw, path)
    m = STEP_DIR.match(path.name)
    if m and int(m.group(1)) != manifest["step"]:
        raise SnapshotInvalid(path, MANIFEST, f"says step {manifest['step']}, its directory step {int(m.group(1))}")
    return manifest


class Verified:
    """An open snapshot whose every file was checked against its manifest. The files were
    read once, hashed as they were read: what the caller asked to keep (`contents`, always
    the train state and the binding) is exactly the bytes verified. A context manager:
    closing it closes the descriptors."""

    def __init__(self, path: Path, dirfd: int, manifest: Manifest) -> None:
        self.path, self.dirfd, self.manifest = path, dirfd, manifest
        self.fds: dict[str, int] = {}
        self.contents: dict[str, WriteableBuffer | list[WriteableBuffer]] = {}  # file name -> where it was read
        self.binding: JSONObject = {}
        self.objects: JSONObject = {}  # the train state, read without torch (read_train_state)

    def reader(self, name: str) -> IO[bytes]:
        """A binary file over the verified contents of `name` (close it after use)."""
        kept = self.contents[name]
        return io.BytesIO(b"".join(kept) if isinstance(kept, list) else kept)

    def close(self) -> None:
        for fd in [*self.fds.values(), self.dirfd]:
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> Verified:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_verified(
    path: str | os.PathLike[str],
    *,
    hashes: bool = True,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
    into: Callable[[str, int], Into] | None = None,
    pool: ThreadPoolExecutor | None = None,
    opened: Callable[[dict[str, int]], None] | None = None,
) -> Verified:
    """Opens every file of the snapshot at `path` (regular files in it only, no symbolic
    links) and checks it against the manifest: size, then the digest unless hashes=False
    (read and hashed in one pass, in parallel: digest.py), then the binding names the
    manifest's MPUs. into(name, size): a writable buffer to read the file `name` into and
    keep (None: not kept). pool: threads to read with (default: new ones). opened(fds): called
    with each file's descriptor once all are opened and their sizes checked, before any read.
    Raises SnapshotInvalid naming the first file at fault.
    `progress(n)` is called with each number of bytes read, from worker threads."""
    path = Path(path)
    dirfd = open_dir(path)
    try:
        manifest = _read_manifest_at(dirfd, path)
    except BaseException:
        os.close(dirfd)
        raise
    v = Verified(path, dirfd, manifest)
    try:
        files = manifest["files"]
        for name, meta in sorted(files.items()):
            fd, st = open_file(v.dirfd, path, name)
            v.fds[name] = fd
            if st.st_size != meta["size"]:
                why = f"size {st.st_size} bytes, manifest says {meta['size']} (partial or altered)"
                raise SnapshotInvalid(path, name, why)
        if files[BINDING]["size"] > MAX_BINDING_BYTES:
            raise SnapshotInvalid(path, BINDING, f"more than the {MAX_BINDING_BYTES} bytes allowed")

        def keep(name: str, size: int) -> Into:
            if name in (BINDING, TRAIN_STATE):
                return bytearray(size)
            return into(name, size) if into is not None else None

        if opened is not None:
            opened(v.fds)
        v.contents = read_and_verify(
            path, v.fds, files, into=keep, hashes=hashes, progress=progress, workers=workers, pool=pool
        )
        with v.reader(BINDING) as f:
            v.binding = check_binding(f.read(), path, manifest)
        with v.reader(TRAIN_STATE) as f:  # whether there is optimizer state is its to say
            v.objects = read_train_state(path / TRAIN_STATE, f)
        holds = v.objects.get("optimizer") is not None
        if manifest.get("optimizer", NONMPU_OPTIM_FILE in files) != holds:
            why = f"its optimizer files do not match the train state (which holds {'' if holds else 'no '}optimizer state)"
            raise SnapshotInvalid(path, MANIFEST, why)
    except BaseException:
        v.close()
        raise
    return v


def verify_snapshot(
    path: str | os.PathLike[str], *, progress: Callable[[int], None] | None = None, workers: int | None = None
) -> Manifest:
    """Checks every file of a snapshot against its manifest (open_verified); returns the
    manifest, or raises SnapshotInvalid naming the first file at fault."""
    with open_verified(path, progress=progress, workers=workers) as v:
        return v.manifest


def list_snapshots(root: str | os.PathLike[str], *, include_incomplete: bool = False) -> list[SnapshotInfo]:
    """Snapshots under `root`: a snapshot directory, a directory of them, or one of rank
    subdirectories. Sorted by (rank, step). Incomplete ones (temporary names left by a crash)
    only with include_incomplete."""
    root = Path(root)
    if (root / MANIFEST).exists() or STEP_DIR.match(root.name):
        return [_info(root, None)]
    out: list[SnapshotInfo] = []
    if not root.is_dir():
        return out
    ranks: list[tuple[Path, int | None]] = [
        (p, int(m.group(1))) for p in sorted(root.iterdir()) if p.is_dir() and (m := RANK_DIR.match(p.name))
    ]
    for base, rank in [(root, None), *ranks]:  # a single rank's step_* beside rank dirs stay listed
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
    named = int(m.group(1)) if m else -1  # the step in the directory's name
    try:
        manifest = read_manifest(path)
    except SnapshotInvalid as e:
        return SnapshotInfo(path, named, rank, False, problem=f"{e.file}: {e.why}")
    return SnapshotInfo(path, manifest["step"], manifest["rank"], True, manifest)


# -- the train state, without torch -------------------------------------------------------


# -- inspecting ------------------------------------------------------------------------------


def summarize(info: SnapshotInfo) -> JSONObject:
    """What a complete snapshot holds, as JSON-friendly values: manifest fields, files, MPU
    binding, optimizer groups, scaler, scheduler, data position, RNG kinds. Every file is
    verified first (open_verified), and the train state read only then (SnapshotInvalid)."""
    with open_verified(info.path) as v:
        manifest, binding, objects = v.manifest, v.binding, v.objects
    try:
        return _summary(info, manifest, binding, objects)
    except (LookupError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise SnapshotInvalid(info.path, TRAIN_STATE, f"holds an unexpected structure: {e!r}") from None


def _summary(info: SnapshotInfo, manifest: Manifest, binding: JSONObject, objects: JSONObject) -> JSONObject:
    return {
        "path": str(info.path),
        "step": manifest["step"],
        "rank": manifest.get("rank"),
        "world_size": manifest.get("world_size"),
        "job_id": manifest.get("job_id"),
        "created_unix": manifest.get("created_unix"),
        "why": manifest.get("why"),
        "versions": manifest.get("versions"),
        "files": {n: dict(m) for n, m in sorted(manifest["files"].items())},  # size and digest
        "mpus": binding.get("mpus", manifest.get("mpus", {})),
        "optimizer": _optimizer_summary(as_dict(objects.get("optimizer") or {}, "optimizer")),
        "scaler": plain(objects.get("scaler")),
        "scheduler": plain(
            {
                k: v
                for k, v in as_dict(objects.get("scheduler") or {}, "scheduler").items()
                if k in ("last_epoch", "_last_lr", "_step_count", "base_lrs")
            }
        )
        or None,
        "data": plain({k: v for k, v in as_dict(objects.get("data") or {}, "data").items() if k != "skip"}) or None,
        "rng": sorted(as_dict(objects.get("rng") or {}, "rng").keys()),
    }


def _optimizer_summary(opt: JSONObject) -> JSONObject | None:
    if not opt:
        return None
    groups = [
        {k: plain(v) for k, v in g.items() if k != "params"} | {"params": len(as_list(g["params"], "params"))}
        for g in (as_dict(g, "a param group") for g in as_list(opt["param_groups"], "param_groups"))
    ]
    return {"class": opt.get("class"), "param_groups": groups}


def plain(obj: object) -> object:
    """JSON-friendly copy: a one-element tensor as its value, a larger one as `tensor(shape)`."""
    if isinstance(obj, TensorInfo):
        return obj.value if obj.numel == 1 else f"tensor{obj.shape}"
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj
