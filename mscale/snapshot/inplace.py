"""Restore from disk straight into the live tensors: each byte of a snapshot is read once, into
the parameter or optimizer tensor that will hold it, and hashed there while it is in the
CPU's cache (digest.py). No fresh memory to fault in, no second copy into the model.

Measured on this project's 2-core machine (benchmarks/snapshot.py, 1.15 GiB of parameters and
AdamW state): filling freshly allocated memory costs 0.23-0.41 s, more than reading the same
bytes from the page cache into memory already in use; torch.load pays it for every byte.

A snapshot is read in place only when it fits the live state as a whole (every model key,
every optimizer state tensor: same names, shapes and dtypes), checked from the files' headers
before any byte lands. Its digests are checked as it is read, so a corrupted snapshot is found
after part of it has landed: the next older snapshot overwrites all of it (it must fit the
same way); when none is left, the live state is no longer the one the process started with,
and `load_newest_valid` raises instead of letting training start from scratch on a mixture.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import mscale.snapshot.distributed as mdist
from mscale.findings import Reason, Severity
from mscale.snapshot.fit import check_fits
from mscale.snapshot.format import SnapshotError, SnapshotInvalid, step_dir_name
from mscale.snapshot.keys import renamed_for
from mscale.snapshot.tensors import MAX_HEADER, Entry, Planned, Tensors, load_snapshot, parse_header
from mscale.snapshot.values import StateDict

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

    from mscale.snapshot.engine import SnapshotEngine

__all__ = ["live_targets", "plan_in_place", "load_newest_valid"]


def live_targets(engine: SnapshotEngine) -> dict[str, torch.Tensor]:
    """The live tensors a snapshot's tensors would be restored into, by snapshot key: every
    model state entry ('model/<key>') and every optimizer state tensor ('optim/<param>/<key>').
    Empty when the model customises loading (its load_state_dict hooks must see the values)."""
    model = engine.model
    if any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in model.modules()):
        return {}
    engine.copier.fence()  # a snapshot copy still reading the live tensors finishes first
    live = {f"model/{k}": t for k, t in model.state_dict().items()}
    named = engine.named_optimizer
    if named is not None:
        opt = named.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        for p, fqn in zip(params, named.names, strict=True):
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    live[f"optim/{fqn}/{k}"] = v
    if any(type(t) is not torch.Tensor for t in live.values()):  # DTensor shards and the like: as before
        return {}
    return live


def _writable(t: torch.Tensor) -> bool:
    """Whether t can take a file's bytes directly: CPU, contiguous, its storage its alone."""
    return (
        t.device.type == "cpu"
        and t.numel() > 0
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def plan_in_place(live: dict[str, torch.Tensor], path: Path, fds: dict[str, int]) -> dict[str, Planned]:
    """For each safetensors file: (the buffers its consecutive bytes are read into, its
    tensors, its header bytes), the tensors live ones where the snapshot fits the live state
    as a whole, fresh memory otherwise. Empty when the snapshot does not fit: read as usual."""
    headers: dict[str, tuple[bytes, int, list[Entry]]] = {}
    sizes = {name: os.fstat(fd).st_size for name, fd in fds.items() if name.endswith(".safetensors")}
    for name, size in sorted(sizes.items()):
        first = os.pread(fds[name], 8, 0)
        hlen = int.from_bytes(first, "little") if len(first) == 8 else 0
        head = first + os.pread(fds[name], min(hlen, MAX_HEADER), 8) if hlen else first
        base, entries = parse_header(head, size, path, name)
        headers[name] = (head[:base], base, entries)
    found = {key: (dtype, shape) for _, _, entries in headers.values() for key, dtype, shape, _, _ in entries}
    wanted = {k: (t.dtype, list(t.shape)) for k, t in live.items()}
    if not any(k.startswith("optim/") for k in wanted):
        found = {k: v for k, v in found.items() if not k.startswith("optim/")}  # fresh optimizer: its state is new
    if not live or found != wanted:
        return {}
    seen: dict[int, int] = {}
    for t in live.values():  # storage shared by two keys (tied weights) is never written twice
        seen[t.data_ptr()] = seen.get(t.data_ptr(), 0) + 1
    plans = {}
    for name, (head, base, entries) in headers.items():
        pieces: list[WriteableBuffer] = [bytearray(base)]
        tensors: dict[str, torch.Tensor] = {}
        at = 0  # file offset reached, relative to the body
        for key, dtype, shape, start, end in sorted(entries, key=lambda e: (e[3], e[4])):
            if start < at:  # overlapping entries: no plain layout to scatter into
                return {}
            if start > at:
                pieces.append(bytearray(start - at))
            mine = live.get(key)  # None: optimizer state the live optimizer does not hold yet
            if mine is not None and _writable(mine) and seen[mine.data_ptr()] == 1:
                dest = mine
            else:
                dest = torch.empty(shape, dtype=dtype)
            if end > start:
                pieces.append(dest.detach().view(-1).view(torch.uint8).numpy().data)  # its bytes, not a copy
            tensors[key], at = dest, end
        if base + at < sizes[name]:
            pieces.append(bytearray(sizes[name] - base - at))
        plans[name] = (pieces, tensors, head)
    return plans


def load_newest_valid(
    engine: SnapshotEngine,
    steps: list[int],
    *,
    collective: bool,
    where: Callable[[int], Path] | None = None,
    read: Callable[[int], tuple[Tensors, StateDict] | None] | None = None,
    sources: list[tuple[int, Path, str]] | None = None,
) -> tuple[int, Path, Tensors, StateDict] | None:
    """(step, path, tensors, objects) of the newest of `steps` that verifies and fits, read
    into the live tensors where it fits them (or by `read(step)`, when it gives (tensors,
    objects): another world's shards re-sharded); each refused one a finding naming the next
    tried; collective: a step any rank refuses is skipped by all. sources: (step, path, tier)
    in the order to try, instead of `steps` (tiers: engine.py; `read` is the disk tier's only).
    Raises SnapshotError (on every rank, when collective) when a refused snapshot had already
    landed in live tensors and no older one replaced it."""
    assert engine.rank_dir is not None
    rank_dir = engine.rank_dir
    if sources is None:  # another rank's (worlds.py) where `where` says
        sources = [(s, where(s) if where is not None else rank_dir / step_dir_name(s), "disk") for s in steps]
    overwritten: Path | None = None
    landed: list[bool] = []  # whether the snapshot being read goes into the live tensors

    def plan(path: Path, fds: dict[str, int]) -> dict[str, Planned]:
        plans = plan_in_place(live_targets(engine), path, fds)
        landed.append(bool(plans))
        return plans

    for i, (step, path, tier) in enumerate(sources):
        landed.clear()
        try:
            got = read(step) if read is not None and tier == "disk" else None
            tensors, objects = got if got is not None else load_snapshot(path, pool=engine.copier.pool(), plan=plan)[:2]
            tensors, objects = renamed_for(engine, tensors, objects)  # written with a wrapper's names
            check_fits(engine, tensors, objects, str(path))
        except SnapshotError as e:  # SnapshotInvalid names the file at fault
            overwritten = path if any(landed) else overwritten
            file = {"file": e.file} if isinstance(e, SnapshotInvalid) else {}
            nxt = sources[i + 1] if i + 1 < len(sources) else None
            then = f"trying the {nxt[2]} tier's step {nxt[0]}" if nxt else "no older snapshot to try"
            engine.emit(Reason.SNAPSHOT_REFUSED, Severity.WARNING, f"{e}; {then}", step=step, tier=tier, **file)
            if collective:
                mdist.any_flag(True, engine.group)
            continue
        if not collective or not mdist.any_flag(False, engine.group):
            return step, path, tensors, objects
        overwritten = path if any(landed) else overwritten  # landed here, refused by another rank
    # every rank gets here together (one flag per source on each): all raise, or none
    if mdist.any_flag(overwritten is not None, engine.group) if collective else overwritten is not None:
        at = overwritten or "a snapshot on another rank"
        raise SnapshotError(
            f"{at} was refused after part of it was read into the live model and optimizer, and no "
            "older snapshot verifies: their state is no longer the one this process started with; start it again"
        )
    return None
