"""Reading a snapshot's `train_state.pt` without torch or numpy: a torch.save zip archive read
by an unpickler that builds only plain values and refuses every global outside the few that
`torch.load(weights_only=True)` allows, so no code from the file runs. Tensors become
`TensorInfo` (dtype, shape, and the value of a one-element tensor), which is what
`mscale snapshot inspect` shows. The format's other files are format.py's.
"""

from __future__ import annotations

import codecs
import os
import pickle
import struct
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mscale.snapshot.manifest import FORMAT, SnapshotInvalid
from mscale.snapshot.values import StateDict

__all__ = ["TensorInfo", "read_train_state"]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a train state read without torch: its dtype, shape and, when it holds one
    element, that element's value (what `tensor.item()` would give)."""

    dtype: str
    shape: tuple[int, ...]
    value: Any = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# torch storage class -> (dtype name, struct format of one element); bfloat16 is decoded apart
_STORAGES: dict[str, tuple[str, str]] = {
    "DoubleStorage": ("float64", "d"),
    "FloatStorage": ("float32", "f"),
    "HalfStorage": ("float16", "e"),
    "BFloat16Storage": ("bfloat16", "H"),
    "LongStorage": ("int64", "q"),
    "IntStorage": ("int32", "i"),
    "ShortStorage": ("int16", "h"),
    "CharStorage": ("int8", "b"),
    "ByteStorage": ("uint8", "B"),
    "BoolStorage": ("bool", "?"),
    "UInt16Storage": ("uint16", "H"),
    "UInt32Storage": ("uint32", "I"),
    "UInt64Storage": ("uint64", "Q"),
    "ComplexFloatStorage": ("complex64", "ff"),
    "ComplexDoubleStorage": ("complex128", "dd"),
}
_DTYPES = frozenset(
    "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool complex64 complex128 "
    "float8_e4m3fn float8_e5m2 half float double long int short cfloat cdouble".split()
)


@dataclass(frozen=True)
class _Storage:
    dtype: str
    fmt: str
    read: Callable[[], bytes]


class _DType(str):
    """A torch dtype named in a pickle: printed as torch prints it."""


def _decode(storage: _Storage, offset: int, order: str) -> Any:
    size = struct.calcsize("<" + storage.fmt)
    raw = storage.read()[offset * size : (offset + 1) * size]
    if len(raw) != size:
        raise pickle.UnpicklingError("a tensor's storage is shorter than its shape")
    values = struct.unpack(order + storage.fmt, raw)
    if storage.dtype == "bfloat16":  # the high half of a float32
        return struct.unpack("<f", struct.pack("<I", values[0] << 16))[0]
    return complex(*values) if len(values) == 2 else values[0]


class _TrainStateUnpickler(pickle.Unpickler):
    """Builds plain Python values and TensorInfo from a torch.save pickle; any global outside
    the few that weights_only loading allows is refused, so no code from the file runs."""

    def __init__(self, file: Any, archive: zipfile.ZipFile, prefix: str, order: str) -> None:
        super().__init__(file)
        self.archive, self.prefix, self.order = archive, prefix, order
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module in ("builtins", "__builtin__") and name in ("set", "frozenset", "bytearray", "complex"):
            return {"set": set, "frozenset": frozenset, "bytearray": bytearray, "complex": complex}[name]
        if module == "collections" and name in ("OrderedDict", "Counter"):
            return OrderedDict if name == "OrderedDict" else Counter
        if (module, name) == ("_codecs", "encode"):  # bytes, under pickle protocol 2
            return _encode
        if module == "torch._utils" and name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
            return self._tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *_: data
        if module == "torch":
            if name in _STORAGES:
                return name
            if name in _DTYPES:
                return _DType(f"torch.{name}")
            if name == "Size":
                return tuple
            if name == "device":
                return lambda kind, index=None: kind if index is None else f"{kind}:{index}"
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a train state")

    def persistent_load(self, pid: Any) -> _Storage:
        if not isinstance(pid, tuple) or len(pid) < 3 or pid[0] != "storage" or pid[1] not in _STORAGES:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        key = str(pid[2])
        if key not in self.storages:
            dtype, fmt = _STORAGES[pid[1]]
            entry = f"{self.prefix}data/{key}"

            def read() -> bytes:
                return self.archive.read(entry)

            self.storages[key] = _Storage(dtype, fmt, read)
        return self.storages[key]

    def _tensor(self, storage: _Storage, offset: int, size: Sequence[int], *_: object) -> TensorInfo:
        info = TensorInfo(storage.dtype, tuple(int(d) for d in size))
        if info.numel == 1:
            return TensorInfo(info.dtype, info.shape, _decode(storage, int(offset), self.order))
        return info


def _encode(text: str, encoding: str = "utf-8") -> bytes:
    if not isinstance(text, str):
        raise pickle.UnpicklingError("_codecs.encode of a non-string")
    return codecs.encode(text, encoding)


def read_train_state(path: str | os.PathLike[str], source: IO[bytes] | None = None) -> StateDict:
    """The objects of a `train_state.pt` (read from `source` when given, `path` naming it),
    without torch: tensors become TensorInfo. Raises SnapshotInvalid when the file is not a
    torch.save archive of allowed objects."""
    path = Path(path)
    where, name = path.parent, path.name
    try:
        with zipfile.ZipFile(source if source is not None else path) as archive:
            pkl = next((n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1), None)
            if pkl is None:
                raise SnapshotInvalid(where, name, "not a torch.save archive (no data.pkl)")
            prefix = pkl[: -len("data.pkl")]
            order = "<"
            if f"{prefix}byteorder" in archive.namelist():
                order = "<" if archive.read(f"{prefix}byteorder").strip() == b"little" else ">"
            with archive.open(pkl) as f:
                objects = _TrainStateUnpickler(f, archive, prefix, order).load()
    except (
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        EOFError,
        LookupError,
        ValueError,
        TypeError,
        AttributeError,
        NotImplementedError,
        RecursionError,
        struct.error,
    ) as e:
        raise SnapshotInvalid(where, name, f"not a readable train state: {e}") from None
    except OSError as e:
        raise SnapshotInvalid(where, name, f"unreadable: {e.strerror or e}") from None
    if not isinstance(objects, dict) or objects.get("format") != FORMAT:
        raise SnapshotInvalid(where, name, f"not an {FORMAT} train state")
    return objects
