"""`mscale snapshot list|verify|inspect DIR`: look at training snapshots on disk; `export --format
dcp DIR OUT` writes one as a torch.distributed.checkpoint (mscale.snapshot.dcp, which needs torch).

DIR is a snapshot directory (`step_00000120`), a directory of them, or one with a
`rank_NNNNN/` subdirectory per rank. `verify` checks every file against the manifest (its
schema and completeness, regular files only, size and digest) and shows a progress bar on a
terminal. Exit status 1 when a snapshot is refused (by `list`: its manifest; by `inspect`: any
of its files), naming the file at fault and why; 2 when DIR holds no snapshot. Never a
traceback, never a hang (a FIFO or device in place of a file is refused, not read).

Uses only the torch-free format module, so it runs where torch is not installed (export aside).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from mscale.snapshot import format as snap
from mscale.snapshot.values import as_dict, as_float, as_int, as_list

HELP = "list, verify or inspect training snapshots on disk"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser("list", help="snapshots under DIR: step, rank, size, complete or not")
    ls.add_argument("dir", metavar="DIR")
    ls.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    ls.add_argument(
        "--job", default=None, help="the job id DIR's snapshots were taken by: its node tier (/dev/shm) is listed too"
    )
    ls.add_argument("--node-root", default=None, help="the node tier's file system (default: as the job's)")
    v = sub.add_parser("verify", help="check every file of every snapshot against its manifest")
    v.add_argument("dir", metavar="DIR")
    v.add_argument("--step", type=int, default=None, help="only the snapshot(s) of this step")
    v.add_argument("--newest", action="store_true", help="only the newest complete snapshot (per rank)")
    i = sub.add_parser("inspect", help="what a snapshot holds (the newest under DIR unless --step)")
    i.add_argument("dir", metavar="DIR")
    i.add_argument("--step", type=int, default=None)
    i.add_argument("--rank", type=int, default=None, help="with rank subdirectories: which rank (default 0)")
    i.add_argument("--json", action="store_true")
    e = sub.add_parser("export", help="write a snapshot as another format's checkpoint (needs torch)")
    e.add_argument("dir", metavar="DIR")
    e.add_argument("out", metavar="OUT", help="a new or empty directory")
    e.add_argument("--format", choices=("dcp",), required=True, help="dcp: torch.distributed.checkpoint")
    e.add_argument("--step", type=int, default=None)
    e.add_argument("--rank", type=int, default=None, help="with rank subdirectories: which rank (default 0)")


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.exists():
        print(f"mscale snapshot: {root}: no such directory", file=sys.stderr)
        return 2
    try:
        return {"list": _list, "verify": _verify, "inspect": _inspect, "export": _export}[args.action](root, args)
    except (snap.SnapshotError, OSError) as e:  # e.g. DIR unreadable: a reason, not a traceback
        print(f"mscale snapshot: {_clean(str(e))}", file=sys.stderr)
        return 1


def _clean(text: object) -> str:
    """`text` safe to print on a terminal: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _tiers(root: Path, args: argparse.Namespace) -> list[tuple[str, snap.SnapshotInfo]]:
    """(tier, snapshot) under DIR (the disk tier), and with --job in the job's node tier on this
    host: this node's ranks' own (node) and the replicas of other nodes' ranks it holds (peer)."""
    rows = [("disk", i) for i in snap.list_snapshots(root, include_incomplete=True)]
    if args.job:
        from mscale.snapshot.config import SnapshotConfig
        from mscale.snapshot.node_tier import node_job_dir

        node = node_job_dir(SnapshotConfig(node_root=args.node_root).node_root_path, args.job, root)
        rows += [("node", i) for i in snap.list_snapshots(node, include_incomplete=True)] if node.is_dir() else []
        peer = node / "peer"
        rows += [("peer", i) for i in snap.list_snapshots(peer, include_incomplete=True)] if peer.is_dir() else []
    return rows


def _list(root: Path, args: argparse.Namespace) -> int:
    rows = _tiers(root, args)
    infos = [i for _, i in rows]
    if not infos:
        print(f"mscale snapshot: no snapshots under {root}", file=sys.stderr)
        return 2
    if args.json:
        for tier, i in rows:
            m = i.manifest
            entry = {
                "path": str(i.path),
                "step": i.step,
                "rank": i.rank,
                "complete": i.complete,
                "bytes": i.nbytes,
                "created_unix": m["created_unix"] if m is not None else None,
                "files": len(m["files"]) if m is not None else 0,
                "problem": i.problem,
            }
            print(json.dumps({**entry, "tier": tier} if args.job else entry))
        return 1 if any(i.problem for i in infos) else 0
    tiers = f"{'TIER':<4}  " if args.job else ""
    print(f"{tiers}{'RANK':>4}  {'STEP':>10}  {'STATUS':<10}  {'SIZE':>10}  {'CREATED (UTC)':<19}  {'FILES':>5}  PATH")
    for tier, i in rows:
        m = i.manifest
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m["created_unix"])) if m is not None else "-"
        status = "complete" if i.complete else "invalid" if i.problem else "incomplete"
        rank = "-" if i.rank is None else str(i.rank)
        print(
            f"{f'{tier:<4}  ' if args.job else ''}{rank:>4}  {i.step:>10}  {status:<10}  "
            f"{_size(i.nbytes) if i.complete else '-':>10}  {created:<19}  {len(m['files']) if m is not None else 0:>5}  {_clean(i.path)}"
        )
    for i in infos:
        if i.problem:
            print(f"invalid: {_clean(i.path)}: {_clean(i.problem)}", file=sys.stderr)
    return 1 if any(i.problem for i in infos) else 0


class _Progress:
    """A byte-count progress bar on stderr, drawn only on a terminal; thread-safe."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty() and total > 0
        self.total, self.done = total, 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and (now - self.last >= 0.1 or self.done >= self.total):
                self.last = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total)
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        rate = self.done / max(now - self.t0, 1e-9)
        self.stream.write(
            f"\rverifying [{bar}] {frac * 100:5.1f}%  {_size(self.done)} / {_size(self.total)}  {_size(rate)}/s "
        )
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            with self.lock:
                self._draw(time.monotonic())
                self.stream.write("\n")
                self.stream.flush()


def _verify(root: Path, args: argparse.Namespace) -> int:
    infos = snap.list_snapshots(root, include_incomplete=True)
    # Temporary directories are writes a crash interrupted: never loaded, so only counted. A
    # step_ directory whose manifest is bad is a failed snapshot, verified (and failed) below.
    incomplete = [i for i in infos if i.path.name.startswith(snap.TEMP_PREFIX)]
    complete = [i for i in infos if snap.STEP_DIR.match(i.path.name)]
    if args.step is not None:
        complete = [i for i in complete if i.step == args.step]
    if args.newest:
        newest: dict[int | None, snap.SnapshotInfo] = {}
        for i in complete:
            if i.rank not in newest or i.step > newest[i.rank].step:
                newest[i.rank] = i
        complete = list(newest.values())
    if not complete:
        print(f"mscale snapshot: no snapshot to verify under {root}", file=sys.stderr)
        return 2
    progress = _Progress(sum(i.nbytes for i in complete))
    failed = 0
    results = []
    for i in complete:
        try:
            snap.verify_snapshot(i.path, progress=progress)
            results.append(
                f"OK      step {i.step}{'' if i.rank is None else f' rank {i.rank}'}  {i.path}  ({_size(i.nbytes)})"
            )
        except snap.SnapshotInvalid as e:
            failed += 1
            results.append(
                f"FAILED  step {i.step}{'' if i.rank is None else f' rank {i.rank}'}  {i.path}: {_clean(e.file)}: {_clean(e.why)}"
            )
    progress.finish()
    for line in results:
        print(line)
    if incomplete:
        print(
            f"({len(incomplete)} incomplete snapshot(s) left by an interrupted write, ignored: {', '.join(_clean(i.path.name) for i in incomplete)})"
        )
    return 1 if failed else 0


def _export(root: Path, args: argparse.Namespace) -> int:
    """The chosen snapshot (as `inspect` chooses it) in another format: mscale.snapshot.dcp."""
    infos = _chosen(root, args)
    if not infos:
        print(f"mscale snapshot: no complete snapshot under {root}", file=sys.stderr)
        return 2
    info = max(infos, key=lambda i: (i.step, i.complete))
    from mscale.snapshot.dcp import export  # torch: only here

    try:
        done = export(info.path, args.out)
    except snap.SnapshotInvalid as e:
        print(f"mscale snapshot: {_clean(e.path / e.file)}: {_clean(e.why)}", file=sys.stderr)
        return 1
    print(
        f"exported {_clean(done['snapshot'])} (step {done['step']}) to {_clean(done['out'])} as a DCP "
        f"checkpoint: {done['model_tensors']} model tensors, optimizer state of {done['optimizer_parameters']} parameters"
    )
    return 0


def _chosen(root: Path, args: argparse.Namespace) -> list[snap.SnapshotInfo]:
    infos = [i for i in snap.list_snapshots(root) if i.complete or i.problem]  # a bad newest one is refused
    if args.rank is not None:
        infos = [i for i in infos if i.rank == args.rank]
    elif any(i.rank is not None for i in infos):
        infos = [i for i in infos if i.rank in (0, None)]  # None: a bad manifest did not say
    if args.step is not None:
        infos = [i for i in infos if i.step == args.step]
    return infos


def _inspect(root: Path, args: argparse.Namespace) -> int:
    infos = _chosen(root, args)
    if not infos:
        print(
            f"mscale snapshot: no complete snapshot{'' if args.step is None else f' of step {args.step}'} under {root}",
            file=sys.stderr,
        )
        return 2
    info = max(infos, key=lambda i: (i.step, i.complete))
    try:  # every file is verified first; the train state is read only then
        summary = snap.summarize(info)
    except snap.SnapshotInvalid as e:
        print(f"mscale snapshot: {_clean(e.path / e.file)}: {_clean(e.why)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    print(f"snapshot   {summary['path']}")
    print(
        f"step       {summary['step']}   rank {summary['rank']} of {summary['world_size']}   job {summary['job_id'] or '-'}   written: {summary['why']}"
    )
    if summary["created_unix"]:
        print(
            f"created    {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(as_float(summary['created_unix'], 'created_unix')))}"
        )
    print(f"versions   {', '.join(f'{k} {v}' for k, v in as_dict(summary['versions'] or {}, 'versions').items())}")
    print("mpus")
    for mpu_id, binding in sorted(as_dict(summary["mpus"], "mpus").items()):
        m = as_dict(binding, f"MPU {mpu_id}")
        where = (
            f"gpu {m.get('gpu')} {m.get('gpu_uuid') or ''}".strip()
            if m.get("gpu") is not None
            else m.get("device", "-")
        )
        print(f"  {_clean(mpu_id)}  {_clean(m.get('name', '-')):<10} {_clean(where)}")
    print("files")
    for name, listed in as_dict(summary["files"], "files").items():
        f = as_dict(listed, name)
        kind = "blake3_tree" if "blake3_tree" in f else "sha256"
        print(f"  {name:<40} {_size(as_int(f['size'], 'size')):>10}  {kind} {str(f[kind])[:16]}…")
    for key in ("optimizer", "scaler", "scheduler", "data"):
        if summary[key] is not None:
            print(f"{key:<10} {json.dumps(summary[key], default=str)}")
    print(f"rng        {', '.join(map(str, as_list(summary['rng'], 'rng')))}")
    return 0
