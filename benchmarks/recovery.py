"""Recovery after a kill -9: the node tier (/dev/shm) against the disk resume of the same state.

A job of at least --gib GiB of training state (an MLP's parameters plus AdamW's two moments)
trains to step K with a snapshot of step K in both tiers (the node tier's and the disk's,
fsynced), then SIGKILLs itself, writing the time just before. Each restart is a new process
that imports torch, builds the job, resumes, trains one step and writes the time that step
completed: the figure is that time minus the restart's launch, plus the time from the kill to
the launch (measured once per round, the same for every arm: the arms restart one after
another), the whole of what a crashed rank costs before training goes on. The arms restart from the same killed state, in one run, their order
alternating per round:

- node: resumes the node tier's copy of step K (verified as it is read);
- disk, cached: the node tier off, resumes the disk's copy, whose pages are still in the page
  cache (a crash that leaves the node up);
- disk, evicted: the same after the snapshot's pages are dropped from the page cache
  (posix_fadvise DONTNEED on its files): what a restart on another node, or after the cache was
  reclaimed, reads.

Verdicts: disk evicted / node, and disk cached / node (target: at least 5x for the evicted
disk, issue 39). Control: the node arm twice per round (truly 1.00). The resume alone (the
engine's recovery_seconds) is reported beside each. Files go to a temporary directory under
--dir (default /tmp) and one under /dev/shm, both removed at the end.

    .venv/bin/python benchmarks/recovery.py [--gib 1.0] [--dir /tmp] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verdict import Report, add_json_arg  # noqa: E402

K = 3  # the step snapshotted in both tiers, then killed
WIDTH = 4096


def child(args: argparse.Namespace) -> None:
    import torch

    from mscale.snapshot.config import SnapshotConfig
    from mscale.snapshot.engine import SnapshotEngine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = max(1, round(args.gib * 2**30 / 3 / 4 / (WIDTH * WIDTH)))  # params + 2 AdamW moments, fp32
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    node_every = K if args.child in ("prepare", "node") else 0
    cfg = SnapshotConfig(directory=args.snaps, memory_every=K, disk_every=K, node_every=node_every, node_keep=1)
    engine = SnapshotEngine(model, opt, config=cfg, job_id="recovery-bench")

    def step(n: int) -> None:
        model(torch.ones(1, WIDTH)).sum().backward()
        opt.step()
        opt.zero_grad()
        engine.step_end(n)

    if args.child == "prepare":
        for n in range(1, K + 1):
            step(n)
        engine.flush()
        Path(args.out).write_text(json.dumps({"killed": time.time()}))
        os.kill(os.getpid(), 9)
    resumed = engine.resume()
    assert resumed == K, f"resumed {resumed}, wanted {K}"
    step(K + 1)
    done = time.time()
    Path(args.out).write_text(json.dumps({"done": done, "resume_s": dict(engine.recovery_seconds)}))
    os._exit(0)  # no writes are due: nothing to finish


def run_child(kind: str, args: argparse.Namespace, snaps: Path, out: Path, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--gib", str(args.gib), "--snaps", str(snaps), "--out", str(out)]
    launched = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if kind != "prepare" and proc.returncode != 0:
        raise SystemExit(f"{kind} restart failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "launched": launched}


def evict(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--snaps", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    add_json_arg(ap)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="mscale-recovery-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="mscale-recovery-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "MSCALE_SNAPSHOT_NODE_ROOT": str(shm), "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    times: dict[str, list[float]] = {a: [] for a in ("node", "node again", "disk cached", "disk evicted")}
    resumes: dict[str, list[float]] = {a: [] for a in times}
    gap: list[float] = []
    print(f"recovery after kill -9: {args.gib} GiB of state, {args.repeats} rounds")
    try:
        for r in range(args.repeats):
            snaps = work / f"round{r}"
            killed = run_child("prepare", args, snaps, work / "killed.json", env)["killed"]
            gap.append(time.time() - killed)  # the kill seen and the restart launched
            arms = ["node", "disk cached", "node again", "disk evicted"]
            for arm in arms if r % 2 == 0 else arms[::-1]:
                if arm == "disk evicted":
                    evict(snaps)
                got = run_child(arm.split()[0], args, snaps, work / "restart.json", env)
                times[arm].append(got["done"] - got["launched"] + gap[-1])
                resumes[arm].append(sum(got["resume_s"].values()))
            shutil.rmtree(snaps, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
            shm.mkdir()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    rep = Report("recovery", args.json)
    rep.figure("kill to restart launched", gap)
    for arm in times:
        rep.figure(f"kill to first step, {arm}", times[arm])
        rep.figure(f"resume alone, {arm}", resumes[arm])
    control = [a / b for a, b in zip(times["node again"], times["node"], strict=True)]
    ratio = {
        arm: [d / n for d, n in zip(times[arm], times["node"], strict=True)] for arm in ("disk cached", "disk evicted")
    }
    rep.verdict("kill to first step: disk evicted / node", ratio["disk evicted"], 5.0, control=control)
    rep.verdict("kill to first step: disk cached / node", ratio["disk cached"], 5.0, control=control)
    alone = [d / n for d, n in zip(resumes["disk evicted"], resumes["node"], strict=True)]
    rep.verdict("resume alone: disk evicted / node", alone, 5.0, control=control)
    rep.write()


if __name__ == "__main__":
    main()
