"""The torch side of the snapshot format: torch tensors to safetensors bytes, and a snapshot
loaded back into torch tensors and objects (verified first, never unpickling code)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mscale.snapshot.digest import Into
from mscale.snapshot.format import (
    FORMAT,
    TRAIN_STATE,
    SnapshotError,
    SnapshotInvalid,
    open_verified,
    safetensors_header,
)
from mscale.snapshot.manifest import Manifest, parse_json
from mscale.snapshot.values import StateDict

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["load_snapshot", "safetensors_parts"]

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> list[bytes | memoryview]:
    """The safetensors encoding of `tensors`, as a header plus zero-copy views of the data.

    Larger element sizes first, so every tensor lands aligned (the header is padded to 8).
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    entries = []
    for key in order:
        t = tensors[key]
        if t.dtype not in _ST_DTYPES:
            raise SnapshotError(f"tensor {key!r} has dtype {t.dtype}, which the snapshot format cannot store")
        entries.append((key, _ST_DTYPES[t.dtype], tuple(t.shape), t.numel() * t.element_size()))
    return [safetensors_header(entries, dict(metadata))] + [_byte_view(tensors[k]) for k in order]


_FROM_ST = {name: dtype for dtype, name in _ST_DTYPES.items()}
MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


Entry = tuple[str, torch.dtype, list[int], int, int]  # key, dtype, shape, start, end (in the body)
Tensors = dict[str, dict[str, torch.Tensor]]  # file name -> key -> tensor: a snapshot's tensors
# A file read into memory the caller chose (inplace.py): the buffers its consecutive bytes go into
# (bytearrays, and uint8 numpy views of tensors), the tensors they make, its header bytes.
Planned = tuple[list["WriteableBuffer"], dict[str, torch.Tensor], bytes]


def parse_header(head: bytes, size: int, path: Path, name: str) -> tuple[int, list[Entry]]:
    """(offset of the body, entries) of a safetensors file of `size` bytes whose first bytes
    (at least 8 + the header's length) are `head`. Every offset, dtype and shape is checked
    against the file."""

    def bad(why: str) -> SnapshotInvalid:
        return SnapshotInvalid(path, name, f"not a readable safetensors file: {why}")

    if size < 8 or len(head) < 8:
        raise bad("shorter than its header length")
    hlen = int.from_bytes(head[:8], "little")
    if hlen > min(MAX_HEADER, size - 8) or len(head) < 8 + hlen:
        raise bad(f"a header of {hlen} bytes in a file of {size}")
    header = parse_json(bytes(head[8 : 8 + hlen]), path, name)
    if not isinstance(header, dict):
        raise bad("the header is not an object")
    base, body = 8 + hlen, size - 8 - hlen
    entries: list[Entry] = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _FROM_ST[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            start, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"entry {key!r}: {e!r}") from None
        numel = 1
        for d in shape:
            if d < 0:
                raise bad(f"entry {key!r}: negative dimension")
            numel *= d
        width = torch.empty((), dtype=dtype).element_size()
        if not 0 <= start <= end <= body or end - start != numel * width:
            raise bad(f"entry {key!r}: offsets {start}..{end} do not fit its shape or the file")
        entries.append((key, dtype, shape, start, end))
    return base, entries


def tensors_from_bytes(data: torch.Tensor, path: Path, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `data` (uint8), as views of it where aligned.
    Every offset, dtype and shape is checked against the file before a view is made."""
    size = data.numel()
    hlen = int.from_bytes(bytes(data[:8].numpy()), "little") if size >= 8 else 0
    base, entries = parse_header(bytes(data[: 8 + min(hlen, MAX_HEADER)].numpy()), size, path, name)
    out: dict[str, torch.Tensor] = {}
    for key, dtype, shape, start, end in entries:
        raw = data[base + start : base + end]
        if (base + start) % torch.empty((), dtype=dtype).element_size():  # not aligned for a view: copied
            raw = raw.clone()
        out[key] = raw.view(dtype).reshape(shape)
    return out


def load_snapshot(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    workers: int | None = None,
    pool: Any = None,
    plan: Callable[[Path, dict[str, int]], dict[str, Planned]] | None = None,
) -> tuple[Tensors, StateDict, Manifest]:
    """(tensors per file, train-state objects, manifest) of a snapshot, verified as it is
    read (open_verified: the manifest's schema and completeness, regular files only, sizes, and
    each file's digest unless verify=False). Every file is read once, in parallel chunks, into
    fresh memory: the tensors returned are views of the very bytes verified. plan(path, fds):
    per safetensors file, (the buffers its consecutive bytes go into, the tensors they make,
    its header bytes) where the caller has chosen the memory (inplace.py)."""
    path = Path(path)
    raw: dict[str, torch.Tensor] = {}
    planned: dict[str, Planned] = {}

    def opened(fds: dict[str, int]) -> None:
        if plan is not None:
            planned.update(plan(path, fds))

    def into(name: str, size: int) -> Into:
        if name in planned:
            return planned[name][0]
        if not name.endswith(".safetensors"):
            return None
        raw[name] = torch.empty(size, dtype=torch.uint8)
        return raw[name].numpy().data  # the tensor's bytes, not a copy

    with open_verified(path, hashes=verify, into=into, workers=workers, pool=pool, opened=opened) as snap:
        manifest = snap.manifest
        tensors = {
            name: tensors_from_bytes(raw.pop(name), path, name) for name in sorted(manifest["files"]) if name in raw
        }
        for name, (pieces, planned_tensors, head) in planned.items():
            if bytes(pieces[0]) != head:  # the header the plan was made from is the one verified
                raise SnapshotInvalid(path, name, "its header changed while it was read")
            tensors[name] = planned_tensors
        try:
            with snap.reader(TRAIN_STATE) as f:
                objects = torch.load(f, weights_only=True, map_location="cpu")
        except Exception as e:
            raise SnapshotInvalid(path, TRAIN_STATE, f"not loadable with weights_only=True: {e}") from None
    if not isinstance(objects, dict) or objects.get("format") != FORMAT:
        raise SnapshotInvalid(path, TRAIN_STATE, f"not an {FORMAT} train state")
    if objects.get("step") != manifest.get("step"):
        raise SnapshotInvalid(
            path, TRAIN_STATE, f"step {objects.get('step')} differs from the manifest's {manifest.get('step')}"
        )
    return tensors, objects, manifest
