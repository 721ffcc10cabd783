"""Resume from disk straight into the live tensors (mscale/snapshot/inplace.py): the bytes land
in the parameters and optimizer state that hold them, bitwise; a snapshot that does not fit
is refused before any byte lands; a corrupted one is replaced by the next older, and when none
is left the engine says the live state was overwritten instead of starting on a mixture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_snapshot import assert_resumed_past_the_corrupted, assert_same_state

from mscale.snapshot.digest import IOV_MAX, READ, TREE_CHUNK, read_and_verify
from mscale.snapshot.format import SnapshotError, SnapshotInvalid
from mscale.snapshot.inplace import plan_in_place
from mscale.snapshot.tensors import safetensors_parts
from support.digest import blake3_tree
from support.snapshot_inproc import Job, two_disk_snapshots


def _flip(f: Path, at: int) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 0x01
    f.write_bytes(bytes(data))


def _storages(job: Job) -> dict:
    live = {f"model/{k}": t.data_ptr() for k, t in job.model.state_dict().items()}
    for n, p in job.model.named_parameters():
        live.update({f"optim/{n}/{k}": v.data_ptr() for k, v in job.opt.state[p].items()})
    return live


def test_scattered_destinations_get_the_file_bytes_across_chunks_and_windows(tmp_path):
    """Pieces of any size (thousands of tiny ones, more than one preadv takes; pieces across
    the 1 MiB windows and the 16 MiB chunks) receive exactly the file's bytes, verified."""
    size = TREE_CHUNK + 3 * READ + 777
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    cuts = sorted({*range(0, 3 * IOV_MAX * 4, 4), READ - 1, TREE_CHUNK - 5, TREE_CHUNK + 2, size - 1, size})
    pieces = [bytearray(b - a) for a, b in zip([0, *cuts], cuts, strict=False)]
    assert sum(len(p) for p in pieces) == size and len(pieces[0]) == 0  # an empty piece too
    metas = {"f": {"size": size, "blake3_tree": blake3_tree(data)}}
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = read_and_verify(tmp_path, {"f": fd}, metas, into=lambda n, s: pieces, workers=2)
        assert got["f"] is pieces and b"".join(pieces) == data
        metas["f"]["blake3_tree"] = blake3_tree(data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(SnapshotInvalid, match="BLAKE3 differs"):
            read_and_verify(tmp_path, {"f": fd}, metas, into=lambda n, s: [bytearray(s)], workers=2)
        with pytest.raises(ValueError, match="destination"):  # pieces that do not cover the file
            read_and_verify(tmp_path, {"f": fd}, metas, into=lambda n, s: [bytearray(s - 1)])
    finally:
        os.close(fd)


def test_resume_lands_in_the_live_tensors_bitwise(tmp_path):
    job = Job(tmp_path, memory_every=10, disk_every=10)
    job.run(1, 10)
    job.engine.flush()
    at10 = job.state()
    job.run(11, 13)  # the live state moves on; the optimizer has state to be read into
    before = _storages(job)
    assert job.engine.resume() == 10
    assert_same_state(job.state(), at10)
    assert _storages(job) == before  # the same memory: read in place, nothing replaced
    job.run(11, 12)  # and training goes on from there
    job.close()


def test_a_snapshot_that_does_not_fit_is_refused_before_any_byte_lands(tmp_path):
    job = Job(tmp_path, memory_every=10, disk_every=10)
    job.run(1, 10)
    job.close()
    other = Job(tmp_path)
    with torch.no_grad():  # a model of another shape: one weight is a row short
        name, p = next((n, p) for n, p in other.model.named_parameters() if p.dim() == 2)
        p.data = p.data[1:].clone()
    live = {k: v.clone() for k, v in other.model.state_dict().items()}
    assert other.engine.resume() is None  # refused ("does not fit"): training starts from scratch
    refused = [f for f in other.engine.findings if f.reason.value == "snapshot_refused"]
    assert refused and "does not fit" in refused[0].message
    assert all(torch.equal(v, live[k]) for k, v in other.model.state_dict().items())
    other.close()


def test_a_corrupted_snapshot_read_in_place_gives_way_to_the_older_one(tmp_path):
    at10 = two_disk_snapshots(tmp_path)
    f = tmp_path / "step_00000020" / "mpu_003_text_state.safetensors"
    _flip(f, f.stat().st_size - 3)  # in a weight, after the header
    fresh = Job(tmp_path)
    fresh.run(1, 1)  # the optimizer holds state: both model and optimizer are read in place
    assert_resumed_past_the_corrupted(fresh, f, 10, at10, "BLAKE3 differs")


def test_when_no_snapshot_replaces_a_corrupted_one_read_in_place_resume_says_so(tmp_path):
    job = Job(tmp_path, memory_every=10, disk_every=10)
    job.run(1, 10)
    job.close()
    f = tmp_path / "step_00000010" / "mpu_003_text_state.safetensors"
    _flip(f, f.stat().st_size - 3)
    fresh = Job(tmp_path)
    with pytest.raises(SnapshotError, match="read into the live model and optimizer") as e:
        fresh.engine.resume()
    assert "step_00000010" in str(e.value)
    fresh.close()


def test_storage_shared_by_two_keys_is_not_written_in_place(tmp_path):
    """Tied weights (two keys, one storage) are read apart and copied, never written twice."""
    tied, own = torch.randn(4, 3), torch.randn(5)
    live = {"model/a": tied, "model/b": tied, "model/c": own}
    parts = safetensors_parts({k: v + 1 for k, v in live.items()}, {})
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"".join(bytes(p) for p in parts))
    fd = os.open(f, os.O_RDONLY)
    try:
        plans = plan_in_place(live, tmp_path, {f.name: fd})
    finally:
        os.close(fd)
    pieces, tensors, head = plans[f.name]
    assert tensors["model/c"] is own  # its own storage: the file's bytes land in it
    assert tensors["model/a"] is not tied and tensors["model/b"] is not tied
    assert sum(len(memoryview(p).cast("B")) for p in pieces) == f.stat().st_size
    assert len(pieces[0]) == len(head) and head == f.read_bytes()[: len(head)]  # read again, compared
    mismatch = {**live, "model/c": torch.randn(6)}  # a shape the file does not have: nothing planned
    fd = os.open(f, os.O_RDONLY)
    try:
        assert plan_in_place(mismatch, tmp_path, {f.name: fd}) == {}
    finally:
        os.close(fd)
