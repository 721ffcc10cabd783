"""What a snapshot's manifest may say, and how a snapshot's files are opened.

A snapshot loads only what its manifest vouches for, so the manifest is parsed strictly
before anything is believed: a bounded size, a nesting depth counted before `json.loads`
(which would otherwise recurse as deep as the file asks), then a schema (types, ranges, file
names of a small charset and length, digests as 64 hex digits, no unknown keys) and a
completeness check: the files it lists must be exactly those the format requires for what it
declares (each MPU's state and optimizer file, the non-MPU files, the train state, the
binding), so an entry removed from the manifest is a refusal, not a file quietly not loaded.

Files are opened relative to the snapshot directory's descriptor (the directory resolved
once), without following symbolic links and without blocking (a FIFO would), and refused
unless they are regular files. Every refusal is a SnapshotInvalid naming the file and why.
Standard library only: `mscale snapshot` runs without torch.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import NoReturn, NotRequired, TypedDict, cast

from mscale.snapshot.values import JSONObject

__all__ = [
    "FileMeta",
    "Identity",
    "Manifest",
    "MpuFiles",
    "SnapshotError",
    "SnapshotInvalid",
    "parse_manifest",
    "parse_json",
    "required_files",
    "open_dir",
    "open_file",
    "read_small",
    "safe_name",
    "check_binding",
    "step_dir_name",
    "rank_dir_name",
    "mpu_file",
    "optim_file",
]

FORMAT = "mscale-snapshot/1"
MANIFEST = "manifest.json"
BINDING = "resource_binding.json"
TRAIN_STATE = "train_state.pt"
NONMPU_FILE = "nonmpu_state.safetensors"
NONMPU_OPTIM_FILE = "nonmpu_optim.safetensors"


class FileMeta(TypedDict):
    """A file the manifest lists: its size and its digest (blake3_tree; sha256 in older ones)."""

    size: int
    blake3_tree: NotRequired[str]
    sha256: NotRequired[str]


class MpuFiles(TypedDict):
    """An MPU the manifest declares: its name and the files of its state and optimizer state."""

    name: str
    file: str
    optim_file: str


class Identity(TypedDict):
    """What a writer stamps on every manifest it writes: whose snapshot, and what it holds."""

    rank: int
    world_size: int
    job_id: str
    optimizer: bool
    mpus: dict[str, MpuFiles]


class Manifest(TypedDict):
    """A manifest as parse_manifest checked it: every key and its type, as the schema says."""

    format: str
    step: int
    rank: int
    world_size: int
    job_id: str
    created_unix: float
    why: str
    versions: dict[str, str]
    mpus: dict[str, MpuFiles]
    files: dict[str, FileMeta]
    optimizer: NotRequired[bool]  # written since the manifest declared it


def step_dir_name(step: int) -> str:
    """A complete snapshot's directory: `step_00000120`."""
    return f"step_{step:08d}"


def rank_dir_name(rank: int) -> str:
    """A rank's directory when several ranks share one root: `rank_00003`."""
    return f"rank_{rank:05d}"


def mpu_file(mpu_id: str, name: str) -> str:
    """The file of an MPU's model tensors (`optim_file` of it: its optimizer state's)."""
    return f"mpu_{safe_name(mpu_id)}_{safe_name(name)}_state.safetensors"


def optim_file(state_file: str) -> str:
    """The optimizer-state twin of a model-state file (nonmpu_state -> nonmpu_optim)."""
    return state_file.replace("_state.safetensors", "_optim.safetensors")


MAX_MANIFEST_BYTES = 4 << 20  # a manifest of 4,096 files is ~600 KB
MAX_BINDING_BYTES = 4 << 20
MAX_DEPTH = 8  # the manifest nests 3 deep (files -> name -> size), the binding 3
MAX_FILES = 4096
MAX_NAME = 255  # NAME_MAX
MAX_TEXT = 256  # job_id, why, versions, MPU names
MAX_FILE_BYTES = 1 << 50  # 1 PiB: a size beyond this is not a file we wrote
FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NOT_SAFE = re.compile(r"[^A-Za-z0-9_-]")
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_DEPTH = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKETS = bytes(c for c in range(256) if c not in _DEPTH)


class SnapshotError(RuntimeError):
    """A snapshot could not be taken, written or restored."""


class SnapshotInvalid(SnapshotError):
    """A snapshot on disk is refused: `file` is the file at fault (relative to `path`)."""

    def __init__(self, path: Path, file: str, why: str) -> None:
        self.path, self.file, self.why = Path(path), file, why
        super().__init__(f"snapshot {path} refused: {file}: {why}")


def safe_name(name: str) -> str:
    """A name as it appears in a file name: anything but [A-Za-z0-9_-] becomes '-'."""
    return _NOT_SAFE.sub("-", name)


# -- opening files --------------------------------------------------------------------------


def open_dir(path: Path) -> int:
    """A descriptor of the snapshot directory (symbolic links above it resolved, once)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotInvalid(path, ".", "no such directory") from None
    except OSError as e:
        raise SnapshotInvalid(path, ".", f"not a readable directory: {e.strerror or e}") from None


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def open_file(dirfd: int, path: Path, name: str) -> tuple[int, os.stat_result]:
    """(descriptor, fstat) of the regular file `name` directly inside the directory `dirfd`
    (`path` names it in errors). Never follows a symbolic link, never blocks on a FIFO."""
    if not FILE_NAME.fullmatch(name) or len(name) > MAX_NAME:
        raise SnapshotInvalid(path, _printable(name), "not a file name of the snapshot format")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dirfd)
    except FileNotFoundError:
        raise SnapshotInvalid(path, name, "missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SnapshotInvalid(path, name, "a symbolic link: refused, only regular files are read") from None
        raise SnapshotInvalid(path, name, f"unreadable: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SnapshotInvalid(path, name, f"{_kind(st.st_mode)}: refused, only regular files are read")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_small(dirfd: int, path: Path, name: str, limit: int) -> bytes:
    """The whole of a small regular file, refused when larger than `limit` bytes."""
    fd, st = open_file(dirfd, path, name)
    try:
        if st.st_size > limit:
            raise SnapshotInvalid(path, name, f"{st.st_size} bytes, more than the {limit} allowed")
        chunks, total = [], 0
        while chunk := os.read(fd, limit + 1 - total):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise SnapshotInvalid(path, name, f"more than the {limit} bytes allowed")
        return b"".join(chunks)
    except OSError as e:
        raise SnapshotInvalid(path, name, f"unreadable: {e.strerror or e}") from None
    finally:
        os.close(fd)


# -- parsing ----------------------------------------------------------------------------------


def _printable(text: str, limit: int = 80) -> str:
    """`text` fit for a message: escapes instead of control characters, cut at `limit`."""
    shown = text[:limit].encode("unicode_escape").decode("ascii")
    return shown + ("..." if len(text) > limit else "")


def parse_json(raw: bytes, path: Path, name: str) -> object:
    """JSON whose nesting is counted first (strings skipped), so it never recurses deeper
    than MAX_DEPTH; non-UTF-8, NaN and Infinity are refused."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SnapshotInvalid(path, name, f"not UTF-8 (byte {e.start})") from None
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if brackets and max(accumulate(_DEPTH[c] for c in brackets)) > MAX_DEPTH:
        raise SnapshotInvalid(path, name, f"nested deeper than {MAX_DEPTH} levels")

    def constant(word: str) -> NoReturn:
        raise ValueError(f"{word} is not a number")

    try:
        return json.loads(text, parse_constant=constant)
    except (ValueError, RecursionError) as e:
        raise SnapshotInvalid(path, name, f"not valid JSON: {e}") from None


def _int(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _text(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_TEXT and value.isprintable()


_KEYS = {"format", "step", "rank", "world_size", "job_id", "created_unix", "why", "versions", "mpus", "files"}
_OPTIONAL = {"optimizer"}  # written since the manifest declared it; older ones: all optimizer files or none


def parse_manifest(raw: bytes, path: Path) -> Manifest:
    """The manifest in `raw`, checked against the schema and for completeness, or
    SnapshotInvalid(path, "manifest.json", why)."""
    m = parse_json(raw, path, MANIFEST)

    def bad(why: str) -> SnapshotInvalid:
        return SnapshotInvalid(path, MANIFEST, why)

    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise bad(f"not an {FORMAT} manifest")
    if unknown := sorted(m.keys() - _KEYS - _OPTIONAL):
        raise bad(f"unknown key '{_printable(unknown[0])}'")
    if missing := sorted(_KEYS - m.keys()):
        raise bad(f"no {missing[0]!r}")
    if not _int(m["step"], 0, 2**63 - 1):
        raise bad(f"step must be an integer >= 0, not {_printable(repr(m['step']))}")
    if not _int(m["world_size"], 1, 2**31) or not _int(m["rank"], 0, m["world_size"] - 1):
        raise bad("rank and world_size must be integers, 0 <= rank < world_size")
    created = m["created_unix"]
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created < 1e11:
        raise bad("created_unix must be a time in seconds since 1970")
    if not _text(m["job_id"]) or not _text(m["why"]):
        raise bad(f"job_id and why must be printable strings of at most {MAX_TEXT} characters")
    versions = m["versions"]
    if not isinstance(versions, dict) or len(versions) > 16 or not all(map(_text, [*versions, *versions.values()])):
        raise bad("versions must map names to printable strings")
    if "optimizer" in m and not isinstance(m["optimizer"], bool):
        raise bad("optimizer must be true or false")
    _check_mpus(m["mpus"], bad)
    _check_files(m["files"], bad)
    manifest = cast(Manifest, m)  # every key and type checked above
    want = required_files(manifest)
    listed = set(manifest["files"])
    if missing := sorted(want.keys() - listed):
        raise bad(f"does not list {missing[0]} ({want[missing[0]]}), which the format requires")
    if extra := sorted(listed - want.keys()):
        raise bad(f"lists {extra[0]}, which is not a file of this snapshot's format")
    return manifest


def _check_mpus(mpus: object, bad: Callable[[str], SnapshotInvalid]) -> None:
    if not isinstance(mpus, dict) or len(mpus) > MAX_FILES // 2:
        raise bad("mpus must map MPU ids to their name and files")
    for mpu_id, entry in mpus.items():
        if not mpu_id or not _text(mpu_id):
            raise bad(f"MPU id '{_printable(mpu_id)}' is not a printable string of 1-{MAX_TEXT} characters")
        if not isinstance(entry, dict) or entry.keys() != {"name", "file", "optim_file"} or not _text(entry["name"]):
            raise bad(f"MPU {mpu_id}: must hold exactly a printable name, file and optim_file")
        file = mpu_file(mpu_id, entry["name"])
        if entry["file"] != file or entry["optim_file"] != optim_file(file):
            raise bad(f"MPU {mpu_id}: its files must be {file} and its _optim twin")


def _check_files(files: object, bad: Callable[[str], SnapshotInvalid]) -> None:
    if not isinstance(files, dict) or not files or len(files) > MAX_FILES:
        raise bad(f"files must list 1 to {MAX_FILES} files")
    for name, meta in files.items():
        if not FILE_NAME.fullmatch(name) or len(name) > MAX_NAME:
            raise bad(f"file name '{_printable(name)}' is not 1-{MAX_NAME} of [A-Za-z0-9._-], not starting with '.'")
        # blake3_tree since the digests are checked in parallel (digest.py); sha256 before
        if not isinstance(meta, dict) or meta.keys() not in ({"size", "blake3_tree"}, {"size", "sha256"}):
            raise bad(f"{name}: must hold exactly size and blake3_tree (or sha256)")
        if not _int(meta["size"], 0, MAX_FILE_BYTES):
            raise bad(f"{name}: size must be an integer number of bytes, not {_printable(repr(meta['size']))}")
        kind = "blake3_tree" if "blake3_tree" in meta else "sha256"
        if not isinstance(meta[kind], str) or not SHA256.fullmatch(meta[kind]):
            raise bad(f"{name}: {kind} must be 64 lowercase hex digits")


def required_files(manifest: Manifest) -> dict[str, str]:
    """File name -> what it holds, for every file the format requires of a manifest that
    declares these MPUs (and an optimizer, or not): exactly the files the engine writes."""
    optimizer = manifest.get("optimizer")
    if optimizer is None:  # an older manifest: every optimizer file, or none
        optimizer = any("_optim." in name for name in manifest["files"])
    want = {TRAIN_STATE: "the train state", BINDING: "the MPU binding", NONMPU_FILE: "tensors outside every MPU"}
    if optimizer:
        want[NONMPU_OPTIM_FILE] = "optimizer state outside every MPU"
    for mpu_id, entry in manifest["mpus"].items():
        want[entry["file"]] = f"MPU {mpu_id} {entry['name']!r} parameters"
        if optimizer:
            want[entry["optim_file"]] = f"MPU {mpu_id} {entry['name']!r} optimizer state"
    return want


def check_binding(raw: bytes, path: Path, manifest: Manifest) -> JSONObject:
    """The binding file (already hashed): JSON naming the same MPUs as the manifest."""
    binding = parse_json(raw, path, BINDING)
    mpus = binding.get("mpus") if isinstance(binding, dict) else None
    if (
        not isinstance(binding, dict)
        or not isinstance(mpus, dict)
        or not all(isinstance(v, dict) for v in mpus.values())
    ):
        raise SnapshotInvalid(path, BINDING, "holds no MPU binding")
    theirs = {k: v.get("name") for k, v in mpus.items()}
    if theirs != {k: v["name"] for k, v in manifest["mpus"].items()}:
        raise SnapshotInvalid(path, BINDING, "binds other MPUs than the manifest declares")
    return binding
