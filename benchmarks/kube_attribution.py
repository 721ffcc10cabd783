#!/usr/bin/env python3
"""Pod labels' cost on a scrape: the /metrics page of 8 simulated GPUs and 4 jobs rendered
with pod attribution (every GPU held by a pod, every job reporting its pod) against the same
page without it, in the same process, alternately.

Each repeat renders the page --scrapes times per arm, alternating arms scrape by scrape, and
takes each arm's median; its ratio is attributed / plain. A control repeats the plain arm
against itself. Headline: the median over --repeats of the ratio; verdict "within budget"
when it is below 1 + --budget (default 1: three more labels on nearly every sample make
the text itself about half longer), "over budget" when it exceeds 1 + --budget by more than the
control's spread (median |control ratio - 1|), otherwise "inconclusive".

    .venv/bin/python benchmarks/kube_attribution.py [--repeats 7] [--scrapes 200] [--budget 0.5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verdict import Report, add_json_arg  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from mscale.daemon.config import from_dict  # noqa: E402
from mscale.daemon.exporters import make_registry  # noqa: E402
from mscale.daemon.jobs import JobState  # noqa: E402
from mscale.daemon.state import AgentState  # noqa: E402
from mscale.kube.attribution import SNAPSHOT  # noqa: E402
from mscale.kube.podresources import PodMap, PodRef  # noqa: E402
from mscale.probes import spec  # noqa: E402
from mscale.probes.base import ProbeContext  # noqa: E402
from mscale.sim.nvml import SimNvml  # noqa: E402


def state_with_jobs(pods: bool) -> AgentState:
    config = from_dict({})
    state = AgentState(node="bench")
    sim = SimNvml(8)
    ctx = ProbeContext(config=config, emit=state.events.emit, clock=time.time, jobs=state.registered_jobs, nvml=sim)
    probe = spec("gpu").factory(ctx)
    state.publish("gpu", probe.sample())
    probe.close()
    for j in range(4):
        job = JobState(job_id=f"job-{j}", rank=0, pid=1000 + j)
        mpus = [{"mpu_id": f"00{m}", "name": n, "gpu": 2 * j + m % 2} for m, n in enumerate(("vision", "text"), 1)]
        msg = {"job_id": job.job_id, "rank": 0, "pid": job.pid, "step": 0, "mpus": mpus}
        if pods:
            msg["pod"] = {"name": f"train-{j}", "namespace": "ml"}
        job.register(msg)
        state.jobs[job.job_id] = job
    if pods:
        devices = {u: PodRef("ml", f"train-{i // 2}", "trainer") for i, u in enumerate(sim.uuids)}
        state.snapshots[SNAPSHOT] = PodMap(devices=devices, time=time.time())
    return state


def median_s(fns: list, scrapes: int) -> list[float]:
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(scrapes):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def render(registry) -> object:
    return lambda: generate_latest(registry)


def collect(registry) -> object:
    """The families only (the exporters and, with pods, the relabel pass), not the text."""
    return lambda: [list(c.collect()) for c in registry._collector_to_names]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--scrapes", type=int, default=200)
    # three more labels on nearly every sample: the text alone grows by about half, so up to
    # twice the plain page's time is the budget (about 1 ms on an 8-GPU page here)
    p.add_argument("--budget", type=float, default=1.0, help="allowed relative cost of the labels")
    add_json_arg(p)
    args = p.parse_args()
    rep = Report("kube_attribution", args.json)
    plain = make_registry(state_with_jobs(pods=False))
    plain_again = make_registry(state_with_jobs(pods=False))
    labelled_state = state_with_jobs(pods=True)
    labelled = make_registry(labelled_state)
    page = generate_latest(labelled).decode()
    samples = [ln for ln in page.splitlines() if ln and not ln.startswith("#")]
    with_pod = sum('pod="' in ln for ln in samples)
    ratios, controls, collect_ratios = [], [], []
    for _ in range(args.repeats):
        base, attributed, control = median_s([render(plain), render(labelled), render(plain_again)], args.scrapes)
        ratios.append(attributed / base)
        controls.append(control / base)
        c_base, c_attr = median_s([collect(plain), collect(labelled)], args.scrapes)
        collect_ratios.append(c_attr / c_base)
    ratio = statistics.median(ratios)
    noise = statistics.median(abs(c - 1) for c in controls)
    if ratio < 1 + args.budget:
        verdict = "within budget"
    elif ratio - 1 - args.budget > noise:
        verdict = "over budget"
    else:
        verdict = "inconclusive"
    plain_bytes = len(generate_latest(plain))
    print(f"page: {len(samples)} samples, {with_pod} with pod labels; {len(page) / plain_bytes:.2f}x the bytes")
    print(
        f"scrape render with pod labels / without: {ratio:.2f}x (median of {args.repeats}; "
        f"plain {base * 1e3:.2f} ms); control {statistics.median(controls):.2f}x (spread {noise:.2f}); "
        f"budget {1 + args.budget:.2f}x: {verdict}"
    )
    print(
        f"of which building the families (exporters + relabel pass, no text): "
        f"{statistics.median(collect_ratios):.2f}x; the rest is the longer exposition text"
    )
    rep.figure("control: plain / plain render", controls, unit="x")
    rep.figure("families only (no text): with pod labels / without", collect_ratios, unit="x")
    rep.verdict("scrape render with pod labels / without", ratios, 1 + args.budget, higher=False, control=controls)
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
