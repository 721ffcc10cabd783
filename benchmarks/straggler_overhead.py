#!/usr/bin/env python3
"""The agent's added cost for the cross-rank comparison (mscale.daemon.stragglers): one job of
8 ranks x 4 MPUs reporting every step, the agent's report path with the comparison against
the same path without it, in the same run.

Two real agent apps (`create_app`, not served): one with the link only, one with the link and
the straggler watch. Each round feeds both the same --steps steps of all 8 ranks, as frames
the link takes them: decoded and validated (mscale.link), then applied by the link server's
report handler (state, findings, observers). The arms take turns step by step (the 8 reports
of one step to each arm, the arms' order cycling through every permutation), so that a
neighbour's burst on this shared machine, or the caches it leaves cold, falls on all arms
alike; the figure is each arm's CPU time summed over the round. The verdict is on the median over --rounds of (with / without - 1), the added
fraction, at most TARGET (the link's path here is without the websocket and aiohttp layers,
which the comparison does not touch, so the real fraction is smaller); also printed: the added
CPU in % of one core with 8 ranks at STEPS_PER_S steps a second; the control is the bare arm against a second bare arm, interleaved
the same way (truly 1.00): when it strays further than the effect's distance from the target,
"inconclusive".

    .venv/bin/python benchmarks/straggler_overhead.py [--steps 300] [--rounds 15] [--json PATH] [--strict]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _verdict import Report, add_json_arg  # noqa: E402

from mscale import link as protocol  # noqa: E402
from mscale.daemon import keys  # noqa: E402
from mscale.daemon.app import create_app  # noqa: E402
from mscale.daemon.config import Config  # noqa: E402

RANKS, MPUS = 8, ("001", "002", "003", "004")
TARGET = 0.10  # the comparison may add at most a tenth of the agent's report path (set before the first run)
STEPS_PER_S = 10  # for the added CPU in % of a core: 8 ranks stepping 10 times a second


def agent(features: tuple[str, ...]):
    """An agent app, not served, with one job of RANKS ranks registered; (link server, job)."""
    app = create_app(Config(), probes=[], features=features)
    link, state = app[keys.LINK], app[keys.STATE]
    from mscale.daemon.jobs import JobState

    job = JobState(job_id="bench")
    for r in range(RANKS):
        mpus = tuple(protocol.MpuInfo(m, f"mpu{m}", r) for m in MPUS)
        job.register(protocol.Register(job_id="bench", rank=r, pid=1000 + r, local_rank=r, world_size=RANKS, mpus=mpus))
        job.ranks[r] = 1000 + r
    state.jobs[job.job_id] = job
    return link, job


def frames(steps: int, first: int, seed: int) -> list[tuple[int, str]]:
    """(rank, frame) for `steps` steps of every rank, as the job's link client sends them."""
    rnd = random.Random(seed)
    out = []
    for s in range(first, first + steps):
        for r in range(RANKS):
            mpus = {
                m: {"forward_s": 0.01 * rnd.uniform(0.9, 1.1), "backward_s": 0.02 * rnd.uniform(0.9, 1.1), "gpu": r}
                for m in MPUS
            }
            rep = {"step": s, "time": time.time(), "loss": 1.0, "grad_norm": 1.0, "mpus": mpus, "findings": []}
            out.append((r, json.dumps({"type": "report", "job_id": "bench", "dropped": 0, "reports": [rep]})))
    return out


def feed(link, job, batch: list[tuple[int, str]]) -> float:
    """CPU seconds the agent's report path takes for `batch`."""
    t0 = time.process_time()
    for rank, frame in batch:
        link._report(job, rank, protocol.Report.from_wire(protocol.decode(frame)))
    return time.process_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="steps of all 8 ranks per round and arm")
    ap.add_argument("--rounds", type=int, default=15)
    add_json_arg(ap)
    ap.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    args = ap.parse_args()
    bare = ("mscale.daemon.link",)
    arms = {
        "without": agent(bare),
        "without (control)": agent(bare),
        "with": agent((*bare, "mscale.daemon.stragglers")),
    }
    orders = list(itertools.permutations(arms))
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(args.rounds + 1):  # round 0 warms up (the windows fill), not counted
        batch = frames(args.steps, i * args.steps, seed=i)
        spent = dict.fromkeys(arms, 0.0)
        for s in range(args.steps):
            step = batch[s * RANKS : (s + 1) * RANKS]
            for name in orders[(i * args.steps + s) % len(orders)]:
                spent[name] += feed(*arms[name], step)
        if i:
            for name in arms:
                times[name].append(spent[name])
    watch = arms["with"][0].state.snapshots["stragglers"]
    assert watch.steps_compared == (args.rounds + 1) * args.steps, "every step must have been compared"
    rep = Report("straggler_overhead", args.json)
    n = args.steps * RANKS
    print(
        f"straggler_overhead: {RANKS} ranks x {len(MPUS)} MPUs reporting every step, {args.steps} steps "
        f"({n} reports) per round and arm, {args.rounds} rounds, CPU time of the report path"
    )
    for name in arms:
        rep.figure(f"per report, {name}, us", [t / n * 1e6 for t in times[name]], unit="us", digits=1)
    added = [w / b - 1.0 for w, b in zip(times["with"], times["without"], strict=True)]
    control = [c / b for c, b in zip(times["without (control)"], times["without"], strict=True)]
    extra = [(w - b) / args.steps * STEPS_PER_S * 100 for w, b in zip(times["with"], times["without"], strict=True)]
    rep.figure(f"added CPU at {STEPS_PER_S} steps/s, % of one core", extra, unit="%", digits=3)
    v = rep.verdict("comparison's added cost on the report path", added, TARGET, at_most=True, control=control)
    rep.write()
    return 1 if args.strict and v == "MISSED" else 0


if __name__ == "__main__":
    sys.exit(main())
