"""What the snapshot verification costs the training thread, on the copier's thread (as shipped:
mscale.snapshot.verify) against on the training thread (where it ran before), on
benchmarks/attach_overhead.py's 8.1M LLaVA under the README's line (`memory_every=10`).

Arms, built as attach_overhead.py builds them (`Arm`), interleaved step by step with the order
rotating, one torch thread:

- clip: the plain loop with `clip_grad_norm_` (the baseline);
- copier: the README's line as shipped, each snapshot verified on the copier's thread;
- training: the same line with each snapshot's verification run on the training thread at the end
  of the step after the snapshot, once its copy has landed (where and when the fuse ran it
  before: `Verifier.schedule` pointed at this script's queue).

The cost is the training thread's CPU time (time.thread_time) over windows of `memory_every`
rounds: any 10 consecutive steps hold exactly one snapshot and one verification, so the ratio of
an arm's summed window to clip's same window keeps the verification in (a median of single
steps would leave it out). Each repeat builds fresh arms, runs --warmup untimed steps, then
--windows windows; its figure is the median of its windows' ratios, the one printed the median
of the repeats. Besides: the verification's own CPU time a snapshot, on whichever thread it ran,
as a share of clip's median step. The machine's load average is printed.

    PYTHONPATH=. .venv/bin/python benchmarks/verify_thread.py [--windows 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _verdict import Report, add_json_arg, add_warmup_arg  # noqa: E402
from attach_overhead import HIDDEN, LAYERS, SHAPES, Arm  # noqa: E402

from mscale.healing.settings import HealingSection  # noqa: E402

ARMS = ("clip", "copier", "training")


class Timed:
    """One arm: its steps' CPU and wall time on the training thread; for `training`, the
    verifications queued by its engine, run at the end of the step after their snapshot."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.arm = (
            Arm(name, args, clip=True) if name == "clip" else Arm(name, args, healing=HealingSection(), clip=False)
        )
        self.queued: list[tuple[int, Callable[[], None]]] = []
        self.inline_cpu: list[float] = []  # the training thread's CPU seconds in each verification
        self.steps = 0
        self.cpu: list[float] = []
        engine = self.engine
        if name == "training" and engine is not None:
            engine.verifier.schedule = lambda job: self.queued.append((self.steps, job))

    @property
    def engine(self):  # noqa: ANN201 (the attached arms' SnapshotEngine)
        guard = self.arm.guard
        return getattr(getattr(guard, "fuse", None), "snapshot_engine", None)

    def step(self, keep: bool) -> None:
        c = time.thread_time()
        self.arm.step(keep=False)
        due = [job for at, job in self.queued if at < self.steps]  # the step after the snapshot's
        self.queued = [(at, job) for at, job in self.queued if at >= self.steps]
        for job in due:
            v0 = time.thread_time()
            job()
            self.inline_cpu.append(time.thread_time() - v0)
        self.steps += 1
        if keep:
            self.cpu.append(time.thread_time() - c)


def run_repeat(args: argparse.Namespace, r: int, every: int) -> list[Timed]:
    order = [ARMS[(r + j) % len(ARMS)] for j in range(len(ARMS))]
    built = {name: Timed(name, args) for name in order}  # built in a rotated order
    arms = [built[name] for name in ARMS]
    try:
        n = len(arms)
        for i in range(args.warmup + args.windows * every):
            for k in [(i + r + j) % n for j in range(n)]:
                arms[k].step(keep=i >= args.warmup)
    finally:
        for a in arms:
            a.arm.close()
    return arms


def window_ratios(arm: Timed, clip: Timed, every: int) -> list[float]:
    return [
        sum(arm.cpu[w : w + every]) / sum(clip.cpu[w : w + every]) for w in range(0, len(clip.cpu) - every + 1, every)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=1, help="timed windows of memory_every rounds per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="repeats, fresh arms each (>= 3)")
    add_warmup_arg(ap)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="realistic")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--batch", type=int, default=8)
    add_json_arg(ap)
    args = ap.parse_args()
    if args.repeats < 3 or args.windows < 1:
        ap.error("--repeats: at least 3; --windows: at least 1")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    rep = Report("verify_thread", args.json)
    load = os.getloadavg()[0]
    every = 10  # the README line's memory_every (SnapshotConfig's default)
    repeats: list[list[Timed]] = []
    for r in range(args.repeats):
        repeats.append(run_repeat(args, r, every))
        print(f"  (repeat {r + 1}/{args.repeats} done)", flush=True)
    print(
        f"verify_thread: LLaVA {args.hidden}x{args.layers}, {args.shape} shape, {args.repeats} repeats of "
        f"{args.windows} windows of {every} steps per arm; machine load (1-min average) {load:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs"
    )
    clip_step = statistics.median(x for rr in repeats for x in rr[0].cpu)
    inline = [x for rr in repeats for x in rr[2].inline_cpu]
    off = [rr[1].engine.verifier for rr in repeats if rr[1].engine is not None]
    copier = [v.cpu_s / v.checked for v in off if v.checked]
    rep.figure("clip step (cpu)", [x for rr in repeats for x in rr[0].cpu], unit="s")
    if inline:
        rep.figure("verification on the training thread (cpu)", inline, unit="s")
        print(f"    = {statistics.median(inline) / every / clip_step:.2%} of clip's step at one in {every}")
    if copier:
        rep.figure("verification on the copier's thread (cpu, mean per repeat)", copier, unit="s")
    for k, name in ((1, "copier"), (2, "training")):
        added = [statistics.median(window_ratios(rr[k], rr[0], every)) - 1 for rr in repeats]
        rep.figure(f"{name} vs clip, training thread's cpu, added", added, unit="x", digits=4)
    saved = [
        statistics.median(window_ratios(rr[2], rr[0], every)) - statistics.median(window_ratios(rr[1], rr[0], every))
        for rr in repeats
    ]
    rep.figure("training minus copier, added (of clip's step)", saved, unit="x", digits=4)
    rep.write()


if __name__ == "__main__":
    main()
