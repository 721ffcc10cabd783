"""Snapshot file digests: the BLAKE3 chunk tree recorded by the writer and checked in one
parallel pass while reading, and manifests written the old way (SHA-256 per file) still read
and verified. Corruption is refused naming the file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from test_snapshot import assert_resumed_past_the_corrupted

from mscale.snapshot.digest import TREE_CHUNK, TreeHasher, read_and_verify
from mscale.snapshot.format import MANIFEST, SnapshotInvalid, verify_snapshot
from mscale.snapshot.tensors import load_snapshot
from support.digest import blake3_tree
from support.snapshot_inproc import Job, two_disk_snapshots


def _open(paths: dict[str, Path]) -> dict[str, int]:
    return {name: os.open(p, os.O_RDWR) for name, p in paths.items()}


def test_the_tree_digest_is_the_documented_construction_for_any_split():
    data = os.urandom(2 * TREE_CHUNK + 12345)
    for step in (1 << 20, TREE_CHUNK, 7_000_003, len(data)):
        h = TreeHasher()
        for i in range(0, len(data), step):
            h.update(data[i : i + step])
        assert h.hexdigest() == blake3_tree(data)
    assert TreeHasher().hexdigest() == blake3_tree(b"")


def test_reading_verifies_every_chunk_in_parallel_and_names_the_corrupted_file(tmp_path):
    big, small = os.urandom(3 * TREE_CHUNK + 99), os.urandom(1000)
    (tmp_path / "big").write_bytes(big)
    (tmp_path / "small").write_bytes(small)
    metas = {
        "big": {"size": len(big), "blake3_tree": blake3_tree(big)},
        "small": {"size": len(small), "sha256": hashlib.sha256(small).hexdigest()},
    }
    fds = _open({n: tmp_path / n for n in metas})
    try:
        kept = read_and_verify(tmp_path, fds, metas, into=lambda n, size: bytearray(size), workers=3)
        assert bytes(kept["big"]) == big and bytes(kept["small"]) == small
        for name, data in (("big", big), ("small", small)):  # a flip in the third chunk, or anywhere
            bad = bytearray(data)
            bad[min(len(bad) - 1, 2 * TREE_CHUNK + 5)] ^= 0x40
            os.pwrite(fds[name], bytes(bad), 0)
            with pytest.raises(SnapshotInvalid) as e:
                read_and_verify(tmp_path, fds, metas, workers=3)
            assert e.value.file == name and ("BLAKE3" if name == "big" else "SHA-256") in e.value.why
            os.pwrite(fds[name], data, 0)
        os.truncate(tmp_path / "big", TREE_CHUNK)  # shrunk after its size was checked
        with pytest.raises(SnapshotInvalid, match="shorter") as e:
            read_and_verify(tmp_path, fds, metas, workers=3)
        assert e.value.file == "big"
    finally:
        for fd in fds.values():
            os.close(fd)


def _rewrite_the_old_way(snap: Path) -> None:
    """The manifest as written before BLAKE3: size and SHA-256 of every file."""
    manifest = json.loads((snap / MANIFEST).read_text())
    for name in manifest["files"]:
        data = (snap / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (snap / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def test_a_manifest_written_the_old_way_is_verified_and_resumes_bitwise(tmp_path):
    at10 = two_disk_snapshots(tmp_path)
    for step in (10, 20):
        _rewrite_the_old_way(tmp_path / f"step_{step:08d}")
    assert verify_snapshot(tmp_path / "step_00000020")["step"] == 20
    tensors, objects, manifest = load_snapshot(tmp_path / "step_00000010")
    assert objects["step"] == 10 and all("sha256" in m for m in manifest["files"].values())
    f = tmp_path / "step_00000020" / "mpu_003_text_optim.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    fresh = Job(tmp_path)
    # 20 refused, naming the file; 10 (old manifest) restored
    assert_resumed_past_the_corrupted(fresh, f, 10, at10, "SHA-256 differs")


def test_loaded_tensors_are_the_bytes_verified_and_owned(tmp_path):
    job = Job(tmp_path, memory_every=10, disk_every=10)
    job.run(1, 10)
    job.close()
    snap = tmp_path / "step_00000010"
    tensors, _, _ = load_snapshot(snap)
    from safetensors.torch import load_file

    for name, got in tensors.items():
        want = load_file(snap / name)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (name, k)
    # the files may change afterwards: what was loaded is a copy in memory, not a mapping
    name = "mpu_003_text_state.safetensors"
    before = {k: v.clone() for k, v in tensors[name].items()}
    (snap / name).write_bytes(b"\0" * (snap / name).stat().st_size)
    assert all(torch.equal(tensors[name][k], before[k]) for k in before)
