#!/usr/bin/env python3
"""/metrics at the socket's caps: what a scrape costs when jobs hold as many MPU states as the
agent admits (`socket.max_mpu_states`, 2,048 by default), against the target of 1 s (a scrape
well within Prometheus's default 10 s timeout, /healthz never kept waiting a second).

The page is rendered as the agent renders it (mscale.daemon.scrape): the real collectors over a
real agent state (jobs registered and reported as the link reads them off the wire), the
collect on the calling thread (in the agent, the event loop: what /healthz may wait behind),
then the text formatted within the page budget (in the agent, a worker thread). Printed per
figure, each the median of --repeats renders with its range:

- loop hold: the collect, the time /healthz, the webhook and the socket can wait for a render;
- render: collect and formatting, the time a scrape waits for its page;
- the same render for an agent with one job of one rank (its baseline, measured in the run),
  and the page sizes.

Each figure is printed as a ratio against its 1 s target (<= 1 meets it) and the render beside
its baseline. The load average is printed: on a shared machine the formatting competes for a
core, so run it with the machine otherwise idle for the figure docs/security.md quotes.

    PYTHONPATH=. .venv/bin/python benchmarks/metrics_at_caps.py [--repeats 7] [--json PATH] [--strict]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _verdict import Report, add_json_arg  # noqa: E402

from mscale.daemon import scrape  # noqa: E402
from mscale.daemon.app import new_state  # noqa: E402
from mscale.daemon.config import Config  # noqa: E402
from mscale.daemon.exporters import make_registry  # noqa: E402
from mscale.daemon.jobs import JobState  # noqa: E402
from mscale.daemon.settings import HttpSection, SocketSection  # noqa: E402
from mscale.link import Register, StepReport  # noqa: E402

TARGET_S = 1.0
MPUS_PER_RANK = 8


def state_with(jobs: int, ranks: int, uids: int):
    """An agent state holding `jobs` jobs of `ranks` ranks of MPUS_PER_RANK MPUs each, owned by
    `uids` uids in turn, every rank with one step report applied."""
    state = new_state(Config())
    mpus = [{"mpu_id": f"{m:03d}", "name": f"mpu{m}", "gpu": m} for m in range(MPUS_PER_RANK)]
    figures = {"forward_s": 0.01, "backward_s": 0.02, "grad_norm": 1.0, "gvc": 0.5, "checksum_coverage_ratio": 0.2}
    for j in range(jobs):
        job_id = f"team-{j % uids}/run-{j}"
        job = JobState(job_id=job_id, uid=1000 + j % uids)
        for r in range(ranks):
            job.register(
                Register.from_wire(
                    {"job_id": job_id, "rank": r, "pid": 100 + r, "step": 0, "local_rank": r, "mpus": mpus}
                )
            )
            job.ranks[r] = 100 + r
            report = {"step": 1, "loss": 2.0, "grad_norm": 1.0, "mpus": {m["mpu_id"]: figures for m in mpus}}
            job.apply_report(StepReport.from_wire(report), {}, rank=r)
        state.jobs[job_id] = job
    return state


def timed_render(state, http: HttpSection) -> tuple[float, float, int]:
    """(loop hold, whole render, page bytes) of one render as the agent does it."""
    t0 = time.perf_counter()
    families = list(make_registry(state).collect())
    t1 = time.perf_counter()
    uid_of = {j: job.uid for j, job in state.jobs.items()}
    budget = scrape.Budget(
        per_job=http.metrics_max_series_per_job,
        per_uid=http.metrics_max_series_per_uid,
        max_bytes=http.metrics_max_bytes,
        uid_of=uid_of,
    )
    page = scrape.render(families, budget)
    return t1 - t0, time.perf_counter() - t0, len(page)


def measure(state, http: HttpSection, repeats: int) -> tuple[list[float], list[float], int]:
    holds, renders, size = [], [], 0
    timed_render(state, http)  # warm-up (imports, first allocations)
    for _ in range(repeats):
        hold, whole, size = timed_render(state, http)
        holds.append(hold)
        renders.append(whole)
    return holds, renders, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a verdict is MISSED")
    add_json_arg(ap)
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats: at least 3 (the verdict is on the median)")
    http, sock = HttpSection(), SocketSection()
    ranks = 8
    jobs = sock.max_mpu_states // (ranks * MPUS_PER_RANK)
    uids = -(-sock.max_mpu_states // sock.max_mpu_states_per_uid)  # as few uids as the per-uid cap allows
    print(f"load average {os.getloadavg()[0]:.2f}; {jobs} jobs x {ranks} ranks x {MPUS_PER_RANK} MPUs over {uids} uids")
    base_hold, base_render, base_size = measure(state_with(1, 1, 1), http, args.repeats)
    holds, renders, size = measure(state_with(jobs, ranks, uids), http, args.repeats)
    states = jobs * ranks * MPUS_PER_RANK
    rep = Report("metrics_at_caps", args.json)
    print(f"  page at the caps {size / 1e6:.2f} MB ({states} MPU states); one job of one rank {base_size / 1e3:.0f} kB")
    rep.figure("render, one job of one rank (baseline)", base_render)
    rep.figure("loop hold, one job of one rank", base_hold)
    rep.figure("render at the caps", renders)
    rep.figure("loop hold at the caps", holds)
    rep.figure(
        "render at the caps / baseline", [r / statistics.median(base_render) for r in renders], unit="x", digits=1
    )
    # The verdicts: each render against the 1 s target, as a ratio (<= 1 meets it); the
    # renders' own spread is the noise.
    verdicts = [
        rep.verdict("/metrics render at the caps / 1 s", [r / TARGET_S for r in renders], 1.0, higher=False),
        rep.verdict("loop hold (/healthz's wait) at the caps / 1 s", [h / TARGET_S for h in holds], 1.0, higher=False),
    ]
    rep.write()
    return 1 if args.strict and "MISSED" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
