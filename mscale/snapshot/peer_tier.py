"""The peer tier: each rank's node-tier snapshot replicated, every `peer_every` steps, to a rank
on another node, which keeps it in its own node tier. It survives the loss of a node: the
restarted ranks of a lost node take their replicas back from their peers.

Who holds whose: rank r's replica goes to `replicate_to = (r + ranks_per_node) % world`
(ranks_per_node: LOCAL_WORLD_SIZE), which keeps it under `<node job dir>/peer/rank_<r>/step_N`
(0700/0600, node_tier.py's job directory: keyed by job and snapshot directory). The transfer is
peer_wire.py's, over a gloo group of its own (never the training group), in a thread of its
own after the node tier's writer has written the step (so training never waits for it), in
chunks, every wait bounded by `peer_timeout_s`; a peer that does not answer stops the
replication on this rank with a finding (the other tiers go on).

Verified: what is sent is the primary's node-tier snapshot, every file hashed when it was
captured (the BLAKE3 tree in its manifest). The peer checks each file against that digest as it
lands and keeps only a whole, matching replica of this job and of the rank it expects; when it
comes back at resume it is checked the same way as it lands again, and once more as it is read
into the model (inplace.py). A replica of a step flagged later (Flags in the rank's snapshot
directory) is never restored from.

Resume (`fetch`, collective over the peer group): every rank says which node-tier steps it holds
and which replicas it holds for its source; the steps every rank can take from its node tier, or
where that holds none (its node was lost) from its replica, are the candidates; the replicas a
rank needs come back to it (into `<node job dir>/fetched/rank_<r>/`), and what was refused on the
way drops out of the candidates on every rank alike. The engine then loads the newest candidate
(each rank from its own node tier or from its replica), falling back together to older ones and
to the disk. A peer that does not answer within `peer_timeout_s` at resume (or a peer group that
fails) is a finding naming it; every rank learns it over the engine's group, replication stops,
and all take the steps every rank holds in its node tier alone, then the disk.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch.distributed as dist

import mscale.snapshot.distributed as mdist
from mscale.findings import Reason, Severity
from mscale.snapshot.format import list_snapshots, rank_dir_name
from mscale.snapshot.node_tier import Flags, NodeTier, make_private, tier_bytes
from mscale.snapshot.peer_wire import Landing, Outgoing, PeerSilent, exchange
from mscale.snapshot.values import StateDict

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine

__all__ = ["PeerTier", "replicate_to"]

MAX_QUEUED = 8  # replications waiting for the thread; more: the thread is stuck, replication stops
NO_CAP = 1 << 62

log = structlog.get_logger("mscale.snapshot")


def replicate_to(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank that holds `rank`'s replicas: the same local rank on the next node."""
    return (rank + ranks_per_node) % world


class PeerTier:
    """This rank's side of the peer tier (see the module docstring); `open` decides whether it is on."""

    def __init__(
        self, engine: SnapshotEngine, node: NodeTier, group: dist.ProcessGroup | None, per_node: int, every: int
    ) -> None:
        self.engine, self.node, self.group, self.every = engine, node, group, every
        cfg = engine.config
        self.keep, self.timeout = cfg.peer_keep, timedelta(seconds=cfg.peer_timeout_s)
        world, rank = engine.world_size, engine.rank
        self.per_node, self.world = per_node, world
        self.dest = replicate_to(rank, world, per_node)  # holds this rank's replicas
        self.source = (rank - per_node) % world  # whose replicas this rank holds
        self.dir = node.job_dir / "peer" / rank_dir_name(self.source)
        self.fetched = node.job_dir / "fetched" / rank_dir_name(rank)
        self.broken = ""  # why replication stopped on this rank
        self.last: StateDict = {}  # the last exchange: step, seconds, bytes sent
        self._jobs: queue.Queue[tuple[str, int, Future[Any] | None]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="mscale-snapshot-peer", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, engine: SnapshotEngine, node: NodeTier | None) -> PeerTier | None:
        """The tier for `engine`, or None: off, with a finding saying why. Collective over the
        engine's group (every rank decides alike: the gloo group is made by all or none)."""
        cfg = engine.config
        if cfg.peer_every == 0 or engine.world_size == 1:
            return None
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        world = engine.world_size
        why, one_node = "", per_node >= world
        if node is None:
            why = "the node tier is off on this rank"
        elif not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world:
            why = "the snapshot group is not the whole world"
        elif one_node or world % per_node:
            why = f"{world} ranks, {per_node} a node (LOCAL_WORLD_SIZE): no rank on another node to hold a replica"
        if mdist.any_flag(bool(why), engine.group):
            engine.emit(  # one node is no fault: nothing on another node to hold a replica
                Reason.SNAPSHOT_TIER,
                Severity.INFO if one_node and node is not None else Severity.WARNING,
                f"peer snapshot tier off: {why or 'off on another rank'}",
                tier="peer",
            )
            return None
        assert node is not None
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.peer_timeout_s))
        every = -(-cfg.peer_every // node.every) * node.every
        tier = cls(engine, node, group, per_node, every)
        for path in (node.job_dir / "peer", tier.dir, node.job_dir / "fetched", tier.fetched):
            make_private(path)
        engine.emit(
            Reason.SNAPSHOT_TIER,
            Severity.INFO,
            f"peer snapshot tier on: every {every} steps a replica to rank {tier.dest}, the newest "
            f"{tier.keep} of rank {tier.source}'s held in {tier.dir}",
            tier="peer",
        )
        return tier

    # -- replication (the thread) ----------------------------------------------------------
    def replicate(self, step: int, written: Future[Path | None]) -> None:
        """After step `step`: send its node-tier snapshot (`written`'s result) once it is written."""
        if self._jobs.qsize() >= MAX_QUEUED and not self.broken:
            self._stop(f"{MAX_QUEUED} replications queued behind a stuck one")
        self._jobs.put(("replicate", step, written))

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every replication queued so far is done (sent, refused or stopped)."""
        done: Future[None] = Future()
        self._jobs.put(("barrier", 0, done))
        done.result(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        self._jobs.put(("stop", 0, None))
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            kind, step, fut = self._jobs.get()
            if kind == "stop":
                return
            if kind == "barrier":
                assert fut is not None
                fut.set_result(None)
                continue
            if self.broken or fut is None:
                continue
            try:
                path = fut.result(self.timeout.total_seconds())
            except Exception:  # the node write failed (a finding said so): nothing to send
                path = None
            try:
                self._replicate(step, path)
            except Exception as e:  # a peer gone or out of step: this rank stops replicating
                self._stop(str(e))

    def _stop(self, why: str) -> None:
        self.broken = why
        self.engine.emit(
            Reason.SNAPSHOT_FAILED,
            Severity.CRITICAL,
            f"peer replication stopped on rank {self.engine.rank}: {why}; the node and disk tiers go on",
            tier="peer",
        )

    def room(self) -> int:
        """Bytes this rank may still put in the node root under node_cap_bytes."""
        cap = self.engine.config.node_cap_bytes
        if cap is None:
            return NO_CAP
        return cap - sum(tier_bytes(d) for d in (self.node.rank_dir, self.dir, self.fetched))

    def _replicate(self, step: int, path: Path | None) -> None:
        t0 = time.perf_counter()
        eng = self.engine
        try:
            out = Outgoing(path, eng.job_id, eng.rank) if path is not None else None
        except (OSError, ValueError, KeyError) as e:  # pruned meanwhile: nothing to send this time
            log.warning("node-tier snapshot not replicated", step=step, error=str(e))
            out = None

        def land(index: bytes) -> Landing:
            return Landing(
                self.dir,
                index,
                job_id=eng.job_id,
                source=self.source,
                room=self.room(),
                keep=self.keep,
                world=self.world,
            )

        got = exchange(self.group, step, self.dest, out, self.source, land, self.timeout)
        self.last = {"step": step, "seconds": time.perf_counter() - t0, "bytes": out.total if out else 0}
        if got is None:
            return
        if got.path is None:
            eng.emit(
                Reason.SNAPSHOT_REFUSED,
                Severity.WARNING,
                f"rank {self.source}'s replica of step {got.step} refused as it landed: {got.why}",
                step=got.step,
                tier="peer",
            )
            return
        nbytes = sum(f["size"] for f in got.manifest["files"].values())
        eng.emit(
            Reason.SNAPSHOT_WRITTEN,
            Severity.INFO,
            f"replica of rank {self.source}'s step {got.step} landed in {got.path} ({nbytes} bytes, every file "
            f"matching its primary's digest)",
            step=got.step,
            why="replica",
            tier="peer",
            bytes=nbytes,
            seconds=f"{self.last['seconds']:.6f}",
        )

    # -- resume (collective) ----------------------------------------------------------------
    def _held(self, directory: Path) -> dict[int, Path]:
        return {i.step: i.path for i in list_snapshots(directory) if i.complete and i.path.parent == directory}

    def fetch(self, node: dict[int, Path]) -> dict[int, tuple[Path, str]]:
        """step -> (path, tier) of the steps every rank can resume from its node tier (`node`:
        this rank's candidates) or its replica, for this rank, newest first (see the module
        docstring). Collective over the peer group, then over the engine's group: a peer that
        does not answer within `peer_timeout_s` on any rank (or a peer group that fails) is a
        finding naming it, replication stops, and every rank takes the steps every rank holds
        in its node tier alone (none where a node was lost: the disk's, then)."""
        why, peer = "", -1
        try:
            found = self._fetch(node)
        except PeerSilent as e:
            found, why, peer = {}, str(e), e.rank
        except (RuntimeError, TimeoutError) as e:  # a collective of the peer group timed out or broke
            found, why = {}, f"the peer group failed at resume: {str(e)[:300]}"
        if not mdist.any_flag(bool(why), self.engine.group):  # the training group still answers
            return found
        if why:
            self.engine.emit(
                Reason.SNAPSHOT_REFUSED,
                Severity.WARNING,
                f"the peer tier did not answer at resume ({why}); every rank takes its node tier's steps "
                "alone, then the disk",
                tier="peer",
                **({"peer": str(peer)} if peer >= 0 else {}),
            )
        self._stop(why or "the peer tier failed at resume on another rank")
        shutil.rmtree(self.fetched, ignore_errors=True)
        common = mdist.common_steps(sorted(node), self.engine.group)
        return {s: (node[s], "node") for s in common}

    def _fetch(self, node: dict[int, Path]) -> dict[int, tuple[Path, str]]:
        world, per = self.engine.world_size, self.per_node
        shutil.rmtree(self.fetched, ignore_errors=True)
        make_private(self.fetched)
        nodes = mdist.gather_steps(sorted(node), self.group)
        mine = self._held(self.dir)
        held = mdist.gather_steps(sorted(mine), self.group)  # held[h]: h's replicas of its source
        # a rank whose node tier holds snapshots takes its steps from there alone: a replica of a
        # step its node tier lacks is older than its keep, or of a timeline a rollback abandoned
        able = [set(nodes[r]) or set(held[replicate_to(r, world, per)]) for r in range(world)]
        usable = set.intersection(*able)
        need = [usable - set(nodes[r]) for r in range(world)]  # what rank r takes from its replica
        for step in sorted(set().union(*need), reverse=True):
            # this rank sends its source's replica back to it, and takes its own from its holder
            out = None
            if step in need[self.source]:
                try:
                    out = Outgoing(mine[step], self.engine.job_id, self.source)
                except (OSError, ValueError, KeyError) as e:  # its manifest unreadable now: sent as nothing
                    log.warning("replica not sent back", step=step, rank=self.source, error=str(e))
            self._fetch_one(step, out)
        landed = self._unflagged(self._held(self.fetched))
        common = mdist.common_steps(sorted(set(node) | set(landed)), self.group)
        return {s: (node[s], "node") if s in node else (landed[s], "peer") for s in common}

    def _fetch_one(self, step: int, out: Outgoing | None) -> None:
        eng = self.engine

        def land(index: bytes) -> Landing:
            return Landing(
                self.fetched,
                index,
                job_id=eng.job_id,
                source=eng.rank,
                room=self.room(),
                keep=self.keep,
                world=self.world,
            )

        holder = self.dest
        got = exchange(self.group, step, self.source, out, holder, land, self.timeout)
        if got is not None and got.path is None:
            eng.emit(
                Reason.SNAPSHOT_REFUSED,
                Severity.WARNING,
                f"the replica of step {got.step} held by rank {holder} refused: {got.why}; the next tier is tried",
                step=got.step,
                tier="peer",
            )

    def _unflagged(self, landed: dict[int, Path]) -> dict[int, Path]:
        """The fetched replicas of steps not flagged later (in the disk or node rank directory)."""
        flags = [Flags(d) for d in (self.engine.rank_dir, self.node.rank_dir) if d is not None]
        out = {}
        for info in list_snapshots(self.fetched):
            if info.step not in landed:
                continue
            why = next((w for f in flags if (w := f.why(info))), "")
            if why:
                self.engine.emit(
                    Reason.SNAPSHOT_REFUSED,
                    Severity.WARNING,
                    f"the replica of step {info.step} refused: the step was flagged after it was taken ({why}); "
                    "never restored from, the next tier is tried",
                    step=info.step,
                    tier="peer",
                )
                shutil.rmtree(info.path, ignore_errors=True)
                continue
            out[info.step] = info.path
        return out
