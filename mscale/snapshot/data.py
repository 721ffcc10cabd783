"""Resumable data positions: the part of a snapshot that makes a restored run see the same
samples as the uninterrupted one.

`ResumableLoader` wraps a map-style dataset: the order of an epoch is a pure function of
(seed, epoch) (and of rank and world size when sharded), so the position is three small
numbers, (epoch, index within the epoch, seed), not a copy of the order. The position counts
batches *handed to the caller*, not batches prefetched by workers, so a snapshot taken after
step N always resumes at the batch of step N+1.

`ResumableFileStream` reads newline-delimited records from a file and tracks the byte offset
of the next record, for data sets streamed from files too large to index.

Both offer `state_dict()` / `load_state_dict()` (what the snapshot engine stores),
`last_batch_position` and `skip_batch_at(position)` (so a rollback can step over the batch that
caused a fault), and `next_batch()`; iterating either yields batches without end, across epoch
boundaries, so training loops are driven by the step count. With gradient accumulation a step
draws several batches: `step_positions` lists those drawn since `mark_step()` (which the
snapshot engine calls at every step end), so a rollback can step over every micro-batch of the
offending step, or exactly the one whose loss was non-finite, not just the last one drawn.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from mscale.snapshot.values import StateDict, as_dict, as_int, as_list

__all__ = ["ResumableLoader", "ResumableFileStream", "epoch_order"]

MAX_STEP_POSITIONS = 4096  # micro-batches one step may draw and still be stepped over on a rollback


def _epoch_seed(seed: int, epoch: int) -> int:
    # Derived through a hash so that nearby (seed, epoch) pairs give unrelated permutations.
    digest = hashlib.sha256(f"mscale-order:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def epoch_order(
    length: int, *, seed: int, epoch: int, shuffle: bool = True, rank: int = 0, world_size: int = 1
) -> list[int]:
    """The sample indices one rank sees in one epoch, a pure function of the arguments.

    Sharding follows DistributedSampler: the permutation is padded (by wrapping) to a multiple
    of the world size and rank r takes every world_size-th index starting at r.
    """
    if shuffle:
        g = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
        order = torch.randperm(length, generator=g).tolist()
    else:
        order = list(range(length))
    if world_size > 1:
        total = -(-length // world_size) * world_size
        order = (order + order[: total - length]) if total > length else order
        order = order[rank::world_size]
    return order


class ResumableLoader:
    """Deterministic, resumable batches over a map-style dataset.

    Position = (epoch, index): the next batch starts at element `index` of this rank's order for
    `epoch`. `num_workers > 0` loads through a torch DataLoader; its prefetching does not move
    the position, which advances only when a batch is handed out.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        num_workers: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.dataset = dataset
        self.length = len(dataset)  # type: ignore[arg-type]
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.rank, self.world_size = rank, world_size
        self.collate_fn, self.num_workers = collate_fn, num_workers
        self.epoch = 0
        self.index = 0
        self.skip: set[tuple[int, int]] = set()
        self.last_batch_position: StateDict | None = None
        self.step_positions: list[StateDict] = []  # the batches drawn since mark_step(), in order
        self._order_cache: tuple[int, list[int]] | None = None
        self._it: Iterator[Any] | None = None  # worker-backed iterator, valid for (epoch, index) at creation

    # -- position ------------------------------------------------------------------------
    def order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (
                epoch,
                epoch_order(
                    self.length,
                    seed=self.seed,
                    epoch=epoch,
                    shuffle=self.shuffle,
                    rank=self.rank,
                    world_size=self.world_size,
                ),
            )
        return self._order_cache[1]

    def batches_per_epoch(self) -> int:
        n = len(self.order(self.epoch))
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def position(self) -> StateDict:
        return {"epoch": self.epoch, "index": self.index}

    def _normalise(self) -> None:
        """Moves past the end of an epoch and over batches marked to be skipped."""
        while True:
            n = len(self.order(self.epoch))
            left = n - self.index
            if left <= 0 or (self.drop_last and left < self.batch_size):
                self.epoch, self.index = self.epoch + 1, 0
                self._it = None
                continue
            if (self.epoch, self.index) in self.skip:
                self.index += self.batch_size
                self._it = None
                continue
            return

    def _batch_indices(self, epoch: int, index: int) -> list[int]:
        return self.order(epoch)[index : index + self.batch_size]

    def next_batch(self) -> Any:
        self._normalise()
        start = (self.epoch, self.index)
        if self.num_workers > 0:
            if self._it is None:
                self._it = self._worker_iter()
            batch = next(self._it)
        else:
            batch = self.collate_fn([self.dataset[i] for i in self._batch_indices(*start)])
        self.last_batch_position = {"epoch": start[0], "index": start[1]}
        self._drawn(self.last_batch_position)
        self.index += self.batch_size
        return batch

    def _worker_iter(self) -> Iterator[Any]:
        # The batches this iterator yields are exactly the ones _normalise would pick, in order,
        # until the epoch ends; any change of position (load, skip) drops the iterator.
        plan, index = [], self.index
        n = len(self.order(self.epoch))
        while index < n and not (self.drop_last and n - index < self.batch_size):
            if (self.epoch, index) not in self.skip:
                plan.append(self._batch_indices(self.epoch, index))
            index += self.batch_size
        loader = DataLoader(self.dataset, batch_sampler=plan, collate_fn=self.collate_fn, num_workers=self.num_workers)
        return iter(loader)

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.next_batch()

    def skip_batches(self, n: int = 1) -> None:
        """Steps over the next n batches without loading them."""
        for _ in range(n):
            self._normalise()
            self.index += self.batch_size
            self._it = None

    def skip_batch_at(self, position: StateDict) -> None:
        """Marks the batch starting at `position` (a `last_batch_position`) to be stepped over
        when reached; kept in the state, so a later resume skips it too."""
        self.skip.add((as_int(position["epoch"], "epoch"), as_int(position["index"], "index")))
        self._it = None

    def mark_step(self) -> None:
        """A step ended: the next batch drawn opens the next step's `step_positions`."""
        self.step_positions = []

    def _drawn(self, position: StateDict) -> None:
        if len(self.step_positions) < MAX_STEP_POSITIONS:  # a loop that never marks stays bounded
            self.step_positions.append(dict(position))

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> StateDict:
        return {
            "kind": "resumable_loader",
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "length": self.length,
            "rank": self.rank,
            "world_size": self.world_size,
            "skip": sorted([e, i] for e, i in self.skip),
            "last_batch_position": dict(self.last_batch_position) if self.last_batch_position else None,
        }

    def load_state_dict(self, state: StateDict) -> None:
        if state.get("kind") != "resumable_loader":
            raise ValueError(f"not a ResumableLoader position: kind={state.get('kind')!r}")
        for key in ("length", "batch_size", "world_size", "rank", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data position does not fit this loader: {key} was {state[key]!r}, now {getattr(self, key)!r}"
                )
        self.epoch, self.index, self.seed = (as_int(state[k], k) for k in ("epoch", "index", "seed"))
        self.skip = {_pair(p) for p in as_list(state.get("skip", []), "skip")}
        last = state.get("last_batch_position")
        self.last_batch_position = dict(as_dict(last, "last_batch_position")) if last else None
        self.step_positions = []
        self._order_cache = None
        self._it = None


class ResumableFileStream:
    """Batches of newline-delimited records read from a file, resumable by byte offset.

    A batch never spans two epochs: the last one of an epoch may be short. With world_size > 1,
    record k of the file belongs to rank k % world_size.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        batch_size: int,
        parse: Callable[[bytes], Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = os.fspath(path)
        self.batch_size, self.parse = batch_size, parse or (lambda line: line.decode())
        self.rank, self.world_size = rank, world_size
        self.epoch, self.offset, self.record = 0, 0, 0  # record: number of the next record in the file
        self.skip: set[tuple[int, int]] = set()
        self.last_batch_position: StateDict | None = None
        self.step_positions: list[StateDict] = []  # the batches drawn since mark_step(), in order

    def position(self) -> StateDict:
        return {"epoch": self.epoch, "offset": self.offset}

    def _read_batch(self, f: BinaryIO) -> tuple[list[bytes], int, int]:
        f.seek(self.offset)
        records: list[bytes] = []
        offset, record = self.offset, self.record
        while len(records) < self.batch_size:
            line = f.readline()
            if not line:
                break
            offset += len(line)
            mine = record % self.world_size == self.rank
            record += 1
            if mine and line.strip():
                records.append(line.rstrip(b"\n"))
        return records, offset, record

    def next_batch(self) -> list[Any]:
        wrapped = False
        with open(self.path, "rb") as f:
            while True:
                if (self.epoch, self.offset) in self.skip:
                    records, offset, record = self._read_batch(f)
                    if records:
                        self.offset, self.record = offset, record
                        continue
                start = (self.epoch, self.offset)
                records, offset, record = self._read_batch(f)
                if not records:
                    if wrapped:
                        raise ValueError(f"{self.path}: no records for rank {self.rank} of {self.world_size}")
                    self.epoch, self.offset, self.record, wrapped = self.epoch + 1, 0, 0, True
                    continue
                self.last_batch_position = {"epoch": start[0], "offset": start[1]}
                if len(self.step_positions) < MAX_STEP_POSITIONS:
                    self.step_positions.append(dict(self.last_batch_position))
                self.offset, self.record = offset, record
                return [self.parse(r) for r in records]

    def __iter__(self) -> Iterator[list[Any]]:
        while True:
            yield self.next_batch()

    def skip_batch_at(self, position: StateDict) -> None:
        self.skip.add((as_int(position["epoch"], "epoch"), as_int(position["offset"], "offset")))

    def mark_step(self) -> None:
        self.step_positions = []

    def state_dict(self) -> StateDict:
        return {
            "kind": "file_stream",
            "path": self.path,
            "epoch": self.epoch,
            "offset": self.offset,
            "record": self.record,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "file_size": os.path.getsize(self.path),
            "skip": sorted([e, o] for e, o in self.skip),
            "last_batch_position": dict(self.last_batch_position) if self.last_batch_position else None,
        }

    def load_state_dict(self, state: StateDict) -> None:
        if state.get("kind") != "file_stream":
            raise ValueError(f"not a ResumableFileStream position: kind={state.get('kind')!r}")
        for key in ("batch_size", "rank", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data position does not fit this stream: {key} was {state[key]!r}, now {getattr(self, key)!r}"
                )
        size = os.path.getsize(self.path)
        if as_int(state["offset"], "offset") > size:
            raise ValueError(
                f"{self.path}: saved byte offset {state['offset']} is past the end of the file ({size} bytes)"
            )
        self.epoch, self.offset, self.record = (as_int(state[k], k) for k in ("epoch", "offset", "record"))
        self.skip = {_pair(p) for p in as_list(state.get("skip", []), "skip")}
        last = state.get("last_batch_position")
        self.last_batch_position = dict(as_dict(last, "last_batch_position")) if last else None
        self.step_positions = []


def _pair(skipped: object) -> tuple[int, int]:
    """One skipped batch of a saved position: (epoch, index or offset)."""
    epoch, at = as_list(skipped, "a skipped batch")
    return as_int(epoch, "a skipped batch's epoch"), as_int(at, "a skipped batch's position")


def step_batches(data: Any, micro_batches: Sequence[int] = ()) -> list[StateDict] | None:
    """The positions a rollback of the offending step steps over: every batch the step drew
    (`step_positions`), or only those at the indices `micro_batches` names when the step drew
    that many; a data object without `step_positions` has its last batch. None: the data cannot
    say; [] for a loop's loader that already moved past them (mscale.hook.core.protect.LoopData)."""
    drawn = list(getattr(data, "step_positions", None) or [])
    if not drawn:
        last = getattr(data, "last_batch_position", None)
        return None if last is None else [dict(last)] if last else []
    picked = [drawn[i] for i in micro_batches if 0 <= i < len(drawn)]
    return picked if micro_batches and len(picked) == len(micro_batches) else drawn


def describe_batches(positions: list[StateDict]) -> str:
    """'the batch at epoch 0, index 8' or 'the 4 batches at ...', for a rollback's finding."""
    where = "; ".join(", ".join(f"{k} {v}" for k, v in p.items()) for p in positions)
    return f"the batch at {where}" if len(positions) == 1 else f"the {len(positions)} batches at {where}"


def indices_of(batch: Any) -> Sequence[int]:
    """Sample indices of a SyntheticCaptions batch (tests and demos record what was seen)."""
    return [int(i) for i in batch["index"]]
