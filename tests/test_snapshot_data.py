"""Resumable data positions: the same batches after a save/load as without, across epoch
boundaries, with workers, sharded by rank, and by byte offset for a streamed file."""

from __future__ import annotations

import pytest
import torch

from mscale.sim.tinymm import SyntheticCaptions, TinyConfig
from mscale.snapshot.data import ResumableFileStream, ResumableLoader, epoch_order, indices_of

DATA = SyntheticCaptions(TinyConfig(), size=100, seed=3)


def take(loader, n):
    return [indices_of(loader.next_batch()) for _ in range(n)]


def test_order_is_a_pure_function_of_seed_and_epoch():
    assert epoch_order(100, seed=1, epoch=0) == epoch_order(100, seed=1, epoch=0)
    assert epoch_order(100, seed=1, epoch=0) != epoch_order(100, seed=1, epoch=1)
    assert epoch_order(100, seed=1, epoch=0) != epoch_order(100, seed=2, epoch=0)
    assert sorted(epoch_order(100, seed=1, epoch=5)) == list(range(100))
    shards = [epoch_order(10, seed=0, epoch=0, rank=r, world_size=4) for r in range(4)]
    assert all(len(s) == 3 for s in shards)  # padded by wrapping, like DistributedSampler
    assert set().union(*map(set, shards)) == set(range(10))


def test_resuming_from_a_saved_position_gives_the_same_batches_across_epochs():
    ref = ResumableLoader(DATA, batch_size=16, seed=5)
    expected = take(ref, 20)  # 6 batches per epoch (drop_last): crosses three epoch boundaries
    a = ResumableLoader(DATA, batch_size=16, seed=5)
    head = take(a, 7)
    state = a.state_dict()
    assert state["epoch"] == 1 and state["index"] == 16
    take(a, 3)  # drift on, then come back
    b = ResumableLoader(DATA, batch_size=16, seed=5)
    b.load_state_dict(state)
    assert head + take(b, 13) == expected
    a.load_state_dict(state)
    assert take(a, 13) == expected[7:]
    assert expected[0] != expected[6]  # a new epoch, a new order


def test_workers_do_not_move_the_position():
    ref = ResumableLoader(DATA, batch_size=8, seed=2)
    expected = take(ref, 6)
    w = ResumableLoader(DATA, batch_size=8, seed=2, num_workers=2)
    assert take(w, 3) == expected[:3]
    state = w.state_dict()  # the workers have prefetched further: the position has not
    assert state["index"] == 24
    fresh = ResumableLoader(DATA, batch_size=8, seed=2, num_workers=2)
    fresh.load_state_dict(state)
    assert take(fresh, 3) == expected[3:]


def test_skip_batches_and_skip_a_marked_batch():
    ref = ResumableLoader(DATA, batch_size=10, seed=0, drop_last=False)
    expected = take(ref, 10)  # 10 batches: exactly one epoch
    a = ResumableLoader(DATA, batch_size=10, seed=0, drop_last=False)
    take(a, 2)
    start = a.state_dict()
    take(a, 3)
    bad = a.last_batch_position
    a.load_state_dict(start)
    a.skip_batch_at(bad)
    assert take(a, 3) == [expected[2], expected[3], expected[5]]  # batch 4 (index 40) stepped over
    assert a.state_dict()["skip"] == [[0, 40]]  # kept in the state: a later resume skips it too
    a.skip_batches(2)
    assert take(a, 1) == [expected[8]]


def test_a_position_from_another_loader_is_refused_and_changes_nothing():
    a = ResumableLoader(DATA, batch_size=10, seed=0)
    take(a, 2)
    before = a.state_dict()
    other = ResumableLoader(DATA, batch_size=20, seed=0).state_dict()
    with pytest.raises(ValueError, match="batch_size was 20, now 10"):
        a.load_state_dict(other)
    assert a.state_dict() == before
    with pytest.raises(ValueError, match="rank 2 outside"):
        ResumableLoader(DATA, batch_size=10, rank=2, world_size=2)


def test_file_stream_resumes_at_the_byte_offset(tmp_path):
    f = tmp_path / "captions.jsonl"
    lines = [f'{{"id": {i}, "text": "caption {i}"}}' for i in range(23)]
    f.write_text("\n".join(lines) + "\n")
    ref = ResumableFileStream(f, batch_size=5)
    expected = [ref.next_batch() for _ in range(12)]  # 5 batches per epoch, the last one short
    assert expected[4] == lines[20:23] and expected[5] == lines[0:5] and ref.epoch == 2
    s = ResumableFileStream(f, batch_size=5)
    [s.next_batch() for _ in range(3)]
    state = s.state_dict()
    assert state["offset"] == sum(len(line) + 1 for line in lines[:15]) and state["epoch"] == 0
    t = ResumableFileStream(f, batch_size=5)
    t.load_state_dict(state)
    assert [t.next_batch() for _ in range(9)] == expected[3:]
    bad = t.last_batch_position
    u = ResumableFileStream(f, batch_size=5)
    u.load_state_dict(state)
    u.skip_batch_at({"epoch": 0, "offset": state["offset"]})
    assert u.next_batch() == lines[20:23]
    assert bad["epoch"] == 2


def test_file_stream_shards_records_and_refuses_an_offset_past_the_end(tmp_path):
    f = tmp_path / "data.txt"
    f.write_text("".join(f"r{i}\n" for i in range(10)))
    r1 = ResumableFileStream(f, batch_size=2, rank=1, world_size=3)
    assert r1.next_batch() == ["r1", "r4"] and r1.next_batch() == ["r7"]
    state = r1.state_dict()
    f.write_text("r0\n")  # the file shrank: the saved position no longer exists
    with pytest.raises(ValueError, match="past the end"):
        ResumableFileStream(f, batch_size=2, rank=1, world_size=3).load_state_dict(state)


def test_batches_are_collated_tensors():
    loader = ResumableLoader(DATA, batch_size=4, seed=0)
    batch = loader.next_batch()
    assert batch["images"].shape == (4, 3, 16, 16) and batch["index"].dtype == torch.int64
