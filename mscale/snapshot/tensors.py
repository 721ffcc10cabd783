"""The torch side of the snapshot format: torch tensors to safetensors bytes, and a snapshot
loaded back into torch tensors and objects (verified first, never unpickling code)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from mscale.snapshot.format import (
    FORMAT,
    TRAIN_STATE,
    SnapshotError,
    SnapshotInvalid,
    open_verified,
    safetensors_header,
)

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


def safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> list:
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


def load_snapshot(
    path: str | os.PathLike, *, verify: bool = True
) -> tuple[dict[str, dict[str, torch.Tensor]], dict, dict]:
    """(tensors per file, train-state objects, manifest) of a snapshot, verified first
    (open_verified: the manifest's schema and completeness, regular files only, sizes, and the
    SHA-256 of each file unless verify=False). The files read are the descriptors verified."""
    from safetensors.torch import load_file

    path = Path(path)
    with open_verified(path, hashes=verify) as snap:
        manifest = snap.manifest
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for name in manifest["files"]:
            if not name.endswith(".safetensors"):
                continue
            try:  # a private mapping of the file: model tensors are copied into the model from it
                loaded = load_file(snap.fd_path(name))
            except Exception as e:  # a file that passed its hash but does not parse: refuse it
                raise SnapshotInvalid(path, name, f"not a readable safetensors file: {e}") from None
            # optimizer tensors become the optimizer's state: fresh memory, not the file's pages
            # (measured: as fast as torch.load, twice as fast as safetensors' pread backend here)
            tensors[name] = {k: (v.clone() if k.startswith("optim/") else v) for k, v in loaded.items()}
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
