"""Another world size's snapshot of a sharded (FSDP2) model, re-sharded for this rank.

Each old rank's snapshot holds its local shards and, in its `ShardingMarker` state, where each
one lies in the whole tensor (global shape, offset and shape of the local box). This rank's
own boxes come from its live marker. Every old rank's snapshot of the step is read and
verified in turn (one at a time: the memory held is this rank's new shards plus one old
snapshot), and the overlap of each old box with this rank's box is copied into a fresh tensor
of this rank's local shape: the bytes are the saved ones, nothing is computed. Written
elements are counted, so a layout that does not cover this rank's box is refused, never left
uninitialised; and the old ranks' boxes of each tensor must tile it exactly (inside it, none
overlapping another, their volumes adding up to the whole), or the step is refused: boxes that
overlap would count elements twice and leave others unwritten.

Which tensors are sharded: a parameter's (`model/<fqn>` where the layout names fqn), and an
optimizer state tensor of that parameter with its local shape (Adam's moments; the rule
LocalOptimizer.load_state_dict applies too). Everything else (buffers, 0-d `step` counters) is
whole on every old rank and is taken, with the RNG state, data position and non-tensor state,
from old rank r % old_world (worlds.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from mscale.snapshot.format import SnapshotError
from mscale.snapshot.sharded import ShardingMarker
from mscale.snapshot.tensors import load_snapshot
from mscale.snapshot.values import StateDict, as_dict, as_int, as_list

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine
    from mscale.snapshot.worlds import Candidate

__all__ = ["read", "tiling_error"]

Box = tuple[list[int], list[int]]  # (global offset, local shape)


def tiling_error(shape: list[int], boxes: dict[int, Box]) -> str:
    """'' when the boxes (old rank -> box) tile a tensor of `shape` exactly, else why not."""
    for rank, (at, local) in boxes.items():
        if len(at) != len(shape) or len(local) != len(shape):
            return f"rank {rank}'s box has {len(local)} dimensions, the tensor {len(shape)}"
        if any(a < 0 or n < 0 or a + n > s for a, n, s in zip(at, local, shape, strict=True)):
            return f"rank {rank}'s box {local} at {at} lies outside the {shape} tensor"
    volume = sum(math.prod(local) for _, local in boxes.values())
    if volume != math.prod(shape):
        return f"the boxes hold {volume} elements, the {shape} tensor {math.prod(shape)}"
    full = sorted((r, b) for r, b in boxes.items() if math.prod(b[1]) > 0)
    for i, (r, (at, local)) in enumerate(full):
        for q, (at2, local2) in full[i + 1 :]:
            if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(at, local, at2, local2, strict=True)):
                return f"the boxes of ranks {r} and {q} overlap"
    return ""


def _param_of(key: str, t: torch.Tensor, layout: dict[str, object]) -> str | None:
    """The parameter whose shard `key` (a snapshot key) is, or None for a whole tensor."""
    kind, _, rest = key.partition("/")
    fqn = rest if kind == "model" else rest.rpartition("/")[0] if kind == "optim" else ""
    box = layout.get(fqn)
    if box is None or t.dim() == 0:
        return None
    if kind == "optim" and list(t.shape) != as_dict(box, fqn)["local"]:
        return None  # state of another shape than the shard's: kept whole
    return fqn


def _overlap(src: torch.Tensor, src_at: list[int], dst: torch.Tensor, dst_at: list[int]) -> int:
    """Copy where the box `src` (at global offset src_at) overlaps the box `dst`; elements copied."""
    s_idx, d_idx = [], []
    for a, n, b, m in zip(src_at, src.shape, dst_at, dst.shape, strict=True):
        lo, hi = max(a, b), min(a + n, b + m)
        if hi <= lo:
            return 0
        s_idx.append(slice(lo - a, hi - a))
        d_idx.append(slice(lo - b, hi - b))
    part = src[tuple(s_idx)]
    dst[tuple(d_idx)].copy_(part)
    return part.numel()


def read(engine: SnapshotEngine, found: Candidate) -> tuple[dict[str, dict[str, torch.Tensor]], StateDict]:
    """(tensors per file, objects) of the snapshot at `found.step`, written by `found.world_size`
    ranks, as this rank of `engine` holds it (see the module docstring). Raises SnapshotError
    (SnapshotInvalid naming the file) where an old rank's snapshot fails or does not fit."""
    marker = engine.extra["sharding"]
    assert isinstance(marker, ShardingMarker)  # (worlds.py reshards only with one)
    mine: dict[str, StateDict] = marker.layout
    source = engine.rank % found.world_size
    out: dict[str, dict[str, torch.Tensor]] = {}
    written: dict[str, int] = {}
    boxes: dict[str, dict[int, Box]] = {}  # fqn -> old rank -> its box: they must tile the tensor
    objects: StateDict | None = None
    for rank in range(found.world_size):
        path = found.shards[rank]
        tensors, objs, _ = load_snapshot(path, pool=engine.copier.pool())
        sharding = as_dict(as_dict(objs.get("extra") or {}, "the extras' state").get("sharding") or {}, "sharding")
        theirs = as_dict(sharding.get("layout") or {}, "the shard layout")
        for name, box in theirs.items():
            if isinstance(box, dict) and "shape" in box:
                boxes.setdefault(name, {})[rank] = (list(box.get("offset") or []), list(box.get("local") or []))
        if rank == source:
            objects = objs
        for file, entries in tensors.items():
            for key, t in entries.items():
                fqn = _param_of(key, t, theirs)
                if fqn is None:
                    if rank == source:  # a copy: a view would keep the old file's whole buffer alive
                        out.setdefault(file, {})[key] = t.clone()
                    continue
                box, want = as_dict(theirs[fqn], f"the box of {fqn}"), mine.get(fqn)
                if (
                    want is None
                    or "shape" not in want
                    or want["shape"] != box["shape"]
                    or list(t.shape) != box["local"]
                ):
                    raise SnapshotError(
                        f"{path}: {key} is a shard of a {box['shape']} tensor of shape {list(t.shape)}, "
                        f"this job's {fqn} {want.get('shape') if want else 'is not sharded'}: it does not fit"
                    )
                dst = out.setdefault(file, {}).get(key)
                if dst is None:
                    dst = out[file][key] = torch.empty(_ints(want["local"], "local"), dtype=t.dtype)
                written[key] = written.get(key, 0) + _overlap(
                    t, _ints(box["offset"], "offset"), dst, _ints(want["offset"], "offset")
                )
        del tensors
    for fqn, theirs_boxes in boxes.items():
        why = tiling_error(_ints(mine.get(fqn, {}).get("shape") or [], "shape"), theirs_boxes)
        if fqn in mine and why:
            raise SnapshotError(f"the shards of step {found.step} do not tile {fqn}: {why}")
    short = [k for d in out.values() for k, t in d.items() if k in written and written[k] < t.numel()]
    if short:
        raise SnapshotError(
            f"the shards of step {found.step} do not cover this rank's part of {short[0]} "
            f"({written[short[0]]} of its elements)"
        )
    assert objects is not None  # source < world_size
    return out, objects


def _ints(value: object, what: str) -> list[int]:
    """A shape or an offset as the layout records it: a list of integers."""
    return [as_int(x, what) for x in as_list(value, what)]
