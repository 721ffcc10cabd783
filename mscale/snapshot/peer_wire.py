"""How a snapshot travels between two ranks of the peer tier (peer_tier.py) over a gloo group:
one exchange sends this rank's snapshot (or nothing) to one rank and takes another's (or
nothing) from a third, both directions at once, every wait bounded.

An exchange is, in each direction: a header (int64: step, whether a snapshot follows, the
index's length, the bytes of its files), the index (JSON: job id, source rank, step, the
snapshot's manifest as the primary wrote it, each file's name and size as sent), then the
files' bytes back to back in chunks of at most CHUNK bytes. Both sides know from the headers how
many chunks each way, so a refused snapshot is still read to its end and the next exchange
starts in step.

The receiver (`Landing`) writes each file into a temporary directory as it lands, hashing it
(the BLAKE3 tree of digest.py), and keeps the snapshot only when the index names this job and
the expected source rank, every file has the size and the digest the primary's manifest gives,
and the node tier's cap leaves room: then the manifest is written last and the directory
renamed into place, as the writer does. Otherwise nothing is kept, and `why` says what was wrong.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TypedDict

import torch
import torch.distributed as dist

from mscale.snapshot.digest import TreeHasher
from mscale.snapshot.format import MANIFEST, SnapshotInvalid, fsync_dir, step_dir_name
from mscale.snapshot.manifest import parse_manifest
from mscale.snapshot.values import as_int

__all__ = ["CHUNK", "Landing", "Outgoing", "PeerSilent", "exchange"]

CHUNK = 8 << 20  # bytes per message of a file stream
MAX_INDEX = 1 << 22  # an index is a manifest and a file list: a few KiB; more is refused


class Index(TypedDict):
    """What an exchange's index says: whose snapshot (job, source rank), of which step, its
    manifest as the primary wrote it, and the files sent, (name, size) in the order sent."""

    job_id: str
    source_rank: int
    step: int
    manifest: str
    files: list[tuple[str, int]]


def read_index(raw: bytes) -> Index:
    """The index in `raw`, each field of its type (ValueError, KeyError or TypeError if not)."""
    head = json.loads(raw)
    if not isinstance(head, dict):
        raise TypeError(f"the index is a {type(head).__name__}, not an object")
    return {
        "job_id": str(head.get("job_id")),
        "source_rank": as_int(head.get("source_rank", -1), "source_rank"),
        "step": int(head["step"]),
        "manifest": str(head["manifest"]),
        "files": [(str(n), int(s)) for n, s in head["files"]],
    }


def _size(path: Path) -> int:
    """A file's size now (0 when it is gone: the peer refuses it on the size)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


class Outgoing:
    """A complete snapshot directory to send: its manifest (as the primary wrote it) and files."""

    def __init__(self, path: Path, job_id: str, rank: int) -> None:
        self.path = path
        raw = (path / MANIFEST).read_bytes()
        manifest = json.loads(raw)
        names = sorted(manifest["files"])
        self.files = [(n, _size(path / n)) for n in names]  # as they are now, not as listed
        self.step = int(manifest["step"])
        index: Index = {
            "job_id": job_id,
            "source_rank": rank,
            "step": self.step,
            "manifest": raw.decode(),
            "files": self.files,
        }
        self.index = json.dumps(index).encode()
        self.total = sum(size for _, size in self.files)

    def chunks(self) -> Iterator[torch.Tensor]:
        """The files' bytes, back to back, in chunks of CHUNK bytes (one buffer, reused). A file
        that cannot be read to its size (removed or cut meanwhile) is sent as zeros from there:
        the peer's digest check refuses it, and the exchange stays in step."""
        raw = bytearray(CHUNK)
        buf, view = torch.frombuffer(raw, dtype=torch.uint8), memoryview(raw)
        fill = 0
        for name, size in self.files:
            left = size
            try:
                f = open(self.path / name, "rb", buffering=0)  # noqa: SIM115 (closed below, read lazily)
            except OSError:
                f = None
            while left:
                want = view[fill : fill + min(left, CHUNK - fill)]
                n = f.readinto(want) if f is not None else 0
                if not n:  # gone or cut short: zeros, refused by the peer
                    want[:] = bytes(len(want))
                    n = len(want)
                fill, left = fill + n, left - n
                if fill == CHUNK:
                    yield buf
                    fill = 0
            if f is not None:
                f.close()
        if fill:
            yield buf[:fill]


class Landing:
    """Takes one incoming snapshot into `target` (a rank directory of replicas), checked as it
    lands (see the module docstring). `why` is '' while it is good."""

    def __init__(
        self, target: Path, index: bytes, *, job_id: str, source: int, room: int, keep: int, world: int | None = None
    ) -> None:
        self.target, self.keep, self.why = target, keep, ""
        self.path: Path | None = None  # where it was kept
        self._fd, self._left, self._hasher = -1, 0, TreeHasher()
        self._files: list[tuple[str, int]] = []
        self._queue: list[tuple[str, int]] = []
        self._tmp = target / f".tmp-replica-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            head = read_index(index)
            self._files = head["files"]
            self.step = head["step"]
            self.manifest_raw = head["manifest"].encode()
            self.manifest = parse_manifest(self.manifest_raw, target / step_dir_name(self.step))
        except SnapshotInvalid as e:
            self.step = -1
            self.why = f"its manifest is refused ({e.why})"
            return
        except (ValueError, KeyError, TypeError) as e:
            self.step = -1
            self.why = f"its index is unreadable ({e})"
            return
        self.why = self._refusal(head, job_id, source, room)
        if not self.why and world is not None and self.manifest["world_size"] != world:
            self.why = f"it is of a world of {self.manifest['world_size']} ranks, not {world}"
        if not self.why:
            self._tmp.mkdir(mode=0o700)
            self._queue = list(self._files)
            self._left = self._queue[0][1] if self._queue else 0
            self._skip_empty()

    def _refusal(self, head: Index, job_id: str, source: int, room: int) -> str:
        m = self.manifest
        if head["job_id"] != job_id or m["job_id"] != job_id:
            return f"it is a snapshot of job {str(m['job_id'])[:64]!r}, not of this one ({job_id!r})"
        if head["source_rank"] != source or m["rank"] != source:
            return f"it is rank {m['rank']}'s, not rank {source}'s"
        if m["step"] != self.step:
            return f"its manifest is of step {m['step']}, not {self.step}"
        listed = {n: f["size"] for n, f in m["files"].items()}
        if {n for n, _ in self._files} != set(listed):
            return "the files sent are not the files its manifest lists"
        for name, size in self._files:
            if size != listed[name]:
                return f"{name} is {size} bytes, its primary's manifest says {listed[name]} (truncated or replaced)"
            if "blake3_tree" not in m["files"][name]:
                return f"{name} has no BLAKE3 digest in its primary's manifest"
        total = sum(listed.values())
        if total > room:
            return f"{total} bytes would take the node tier past node_cap_bytes ({room} bytes left)"
        return ""

    def take(self, chunk: memoryview) -> None:
        """The next bytes of the file stream (discarded once the replica is refused)."""
        while chunk and self._queue and not self.why:
            name = self._queue[0][0]
            n = min(len(chunk), self._left)
            if self._fd < 0:
                self._fd = os.open(self._tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            self._hasher.update(chunk[:n])
            part = chunk[:n]
            while part:
                part = part[os.write(self._fd, part) :]
            chunk, self._left = chunk[n:], self._left - n
            self._skip_empty()

    def _skip_empty(self) -> None:
        """Ends each file that has all its bytes (an empty one at once)."""
        while self._queue and self._left == 0 and not self.why:
            self._end_file(self._queue.pop(0)[0])
            self._left = self._queue[0][1] if self._queue else 0

    def _end_file(self, name: str) -> None:
        if self._fd < 0:  # an empty file: nothing came
            self._fd = os.open(self._tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(self._fd)
        self._fd = -1
        want = self.manifest["files"][name]["blake3_tree"]
        got, self._hasher = self._hasher.hexdigest(), TreeHasher()
        if got != want:
            self.why = f"{name} does not match its primary's BLAKE3 digest (flipped bits on the way or at rest)"

    def finish(self) -> Path | None:
        """Keeps the replica (the manifest last, then renamed into place; the oldest beyond `keep`
        removed, and any of a newer step: a rollback abandoned it); None, and nothing left
        behind, when it was refused."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not self.why and self._queue:
            self.why = f"{self._queue[0][0]} did not arrive whole"
        if self.why:
            shutil.rmtree(self._tmp, ignore_errors=True)
            return None
        fd = os.open(self._tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.manifest_raw)
        final = self.target / step_dir_name(self.step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(self._tmp, final)
        fsync_dir(self.target)
        steps = sorted(p for p in self.target.iterdir() if p.name.startswith("step_"))
        newer = [p for p in steps if p.name > final.name]  # an abandoned timeline's (a rollback since)
        for old in [*newer, *[p for p in steps if p not in newer][: -self.keep]]:
            shutil.rmtree(old, ignore_errors=True)
        self.path = final
        return final


class PeerSilent(TimeoutError):
    """A rank that did not answer an exchange within its bound (or whose link broke): `rank`."""

    def __init__(self, rank: int, what: str) -> None:
        super().__init__(what)
        self.rank = rank


def _wait(works: list[tuple[dist.Work | None, int]], timeout: timedelta, what: str) -> None:
    """Waits for each (work, the rank it talks to) in turn; PeerSilent names the first that did not answer."""
    for w, peer in works:
        if w is None:  # this rank is not in the group: nothing to wait for
            continue
        try:
            done = w.wait(timeout)
        except RuntimeError as e:  # gloo: a timeout, or the link to the peer gone
            raise PeerSilent(peer, f"{what}: rank {peer} did not answer ({str(e)[:200]})") from e
        if done is False:
            raise PeerSilent(peer, f"{what}: rank {peer} did not answer in {timeout.total_seconds():.0f} s")


def exchange(
    group: dist.ProcessGroup | None,
    step: int,
    send_to: int,
    outgoing: Outgoing | None,
    recv_from: int,
    land: Callable[[bytes], Landing],
    timeout: timedelta,
) -> Landing | None:
    """Sends `outgoing` (None: nothing) to `send_to` and takes what `recv_from` sends, as one
    exchange of `step` (see the module docstring). land(index bytes) -> Landing makes the
    receiving side. The Landing of what came (finished: its `path` or `why`), or None. A wait
    past `timeout` raises PeerSilent naming the rank that did not answer."""
    mine = torch.tensor([step, 0, 0, 0], dtype=torch.int64)
    if outgoing is not None:
        mine = torch.tensor([step, 1, len(outgoing.index), outgoing.total], dtype=torch.int64)
    theirs = torch.zeros(4, dtype=torch.int64)
    what = f"the peer replica exchange of step {step} (to rank {send_to}, from rank {recv_from})"
    works = [(dist.isend(mine, send_to, group=group), send_to), (dist.irecv(theirs, recv_from, group=group), recv_from)]
    _wait(works, timeout, what)
    their_step, comes, index_len, total = (int(v) for v in theirs.tolist())
    if their_step != step or not 0 <= index_len <= MAX_INDEX or total < 0:
        raise RuntimeError(f"{what}: out of step (rank {recv_from} sent step {their_step}, index {index_len} bytes)")
    works, index = [], torch.empty(index_len if comes else 0, dtype=torch.uint8)
    if outgoing is not None:
        raw_index = torch.frombuffer(bytearray(outgoing.index), dtype=torch.uint8)
        works.append((dist.isend(raw_index, send_to, group=group), send_to))
    if comes:
        works.append((dist.irecv(index, recv_from, group=group), recv_from))
    _wait(works, timeout, what)
    landing = land(index.numpy().tobytes()) if comes else None
    sends = outgoing.chunks() if outgoing is not None else iter(())
    left = total if comes else 0
    raw = bytearray(min(CHUNK, max(left, 1)))
    inbox, inview = torch.frombuffer(raw, dtype=torch.uint8), memoryview(raw)
    while True:
        works, out = [], next(sends, None)
        if out is not None:
            works.append((dist.isend(out, send_to, group=group), send_to))
        n = min(left, CHUNK)
        if n:
            works.append((dist.irecv(inbox[:n], recv_from, group=group), recv_from))
        if not works:
            break
        _wait(works, timeout, what)
        if n and landing is not None:
            landing.take(inview[:n])
        left -= n
    if landing is not None:
        landing.finish()
    return landing
