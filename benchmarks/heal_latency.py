"""Healing latency and goodput, on the tiny multimodal model trained on CPU.

1. Checksum failure -> swapped: from the checksum failure that completes the L1 trigger
   (the Nth consecutive failing step) to the swap applied and the MPU's forward re-run; and
   from the injection to the swap (N steps of evidence by design).
2. Xid -> emergency snapshot written: from the chaos API call on the agent (simulated GPU)
   through the GPU probe, the engine, the link command and the job's fuse, to the snapshot
   on disk (fsynced and renamed).
3. Goodput: useful steps per second of a run with five faults healed (L1, L2/L3, a 25x spike,
   a NaN loss) against the same run without faults.

Each figure is printed as a ratio against a baseline measured in the same run (the median
step time, the fault-free throughput). Run: .venv/bin/python benchmarks/heal_latency.py
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mscale.demo.scenario import Fault, Run, RunConfig, run  # noqa: E402


def step_time(r) -> float:
    return r.wall_s / r.steps_run


def checksum_to_swap(reps: int = 5) -> tuple[list[float], list[float], float]:
    trig, inj, steps = [], [], []
    for i in range(reps):
        at = 20 + 3 * i
        r = run(
            RunConfig(steps=at + 8, seed=i, faults=(Fault(at, "corrupt", {"gpu": 0, "mode": "noise", "steps": 10}),))
        )
        fails = [f for f in r.findings if f.reason.value == "checksum_failure"]
        ((_, _, gpu, done),) = r.fuse.reruns  # the forward re-run on the standby, output replaced
        assert gpu == 3
        trig.append(done - fails[-1].time)
        inj.append(done - fails[0].time)
        steps.append(step_time(r))
    return trig, inj, statistics.median(steps)


def xid_to_emergency_snapshot(reps: int = 3) -> tuple[list[float], float]:
    from mscale.demo.embedded import EmbeddedAgent

    out, steps = [], []
    for i in range(reps):
        with EmbeddedAgent() as agent, tempfile.TemporaryDirectory() as snapdir:
            r = Run(RunConfig(steps=60, socket_path=agent.socket_path, snapshot_dir=snapdir, job_id=f"bench{i}"))
            try:
                agent.wait_for(lambda evs: any(e["reason"] == "job_registered" for e in evs))
                t_step = time.perf_counter()
                for _ in range(12):
                    r.one_step()
                steps.append((time.perf_counter() - t_step) / 12)
                t0 = time.time()
                agent.chaos({"kind": "xid", "gpu": 0, "code": 79, "corrupt": "none"})
                # the job keeps training; the command lands at its next step boundary
                while not r.fuse.states["emergency_snapshot"].writes:
                    r.one_step()
                r.fuse.states["emergency_snapshot"].writes[0].result(timeout=60)
                r.one_step()  # the writer's finding reaches the guard at the next hook call
                written = [f for f in r.findings if f.reason.value == "snapshot_written" and f.time >= t0]
                out.append(written[0].time - t0)
            finally:
                r.close()
    return out, statistics.median(steps)


def goodput() -> tuple[float, float, int]:
    steps = 300
    faults = (
        Fault(30, "corrupt", {"gpu": 0, "mode": "noise", "steps": 20}),
        Fault(90, "corrupt", {"mpu": "vision", "mode": "noise", "steps": 25}),
        Fault(170, "loss_spike", {"factor": 25.0}),
        Fault(210, "nan_loss", {}),
        Fault(250, "corrupt", {"gpu": 1, "mode": "noise", "steps": 20}),
    )
    refs, bads = [], []
    for _ in range(2):  # alternate and keep the best of each: the machine is shared
        refs.append(run(RunConfig(steps=steps)))
        bads.append(run(RunConfig(steps=steps, faults=faults)))
    ref, bad = min(refs, key=lambda r: r.cpu_s), min(bads, key=lambda r: r.cpu_s)
    wall = (bad.steps / min(b.wall_s for b in bads)) / (ref.steps / min(r.wall_s for r in refs))
    return (bad.steps / bad.cpu_s) / (ref.steps / ref.cpu_s), wall, bad.eval_loss / ref.eval_loss, bad.steps_lost


def main() -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    trig, inj, st = checksum_to_swap()
    print("checksum failure -> swapped (tiny model, CPU, 1 thread)")
    print(f"  step time (baseline, same run)       {st * 1e3:8.2f} ms")
    print(
        f"  Nth failure -> swapped, re-run done  {statistics.median(trig) * 1e3:8.2f} ms   "
        f"= {statistics.median(trig) / st:5.2f} x step time (median of {len(trig)})"
    )
    print(
        f"  first failure -> swapped, re-run     {statistics.median(inj) * 1e3:8.2f} ms   "
        f"= {statistics.median(inj) / st:5.2f} x step time (3 failing steps of evidence)"
    )
    xs, st2 = xid_to_emergency_snapshot()
    print("Xid -> emergency snapshot written (agent probe -> engine -> link -> fuse -> disk)")
    print(f"  step time (baseline, same run)       {st2 * 1e3:8.2f} ms")
    print(
        f"  Xid injected -> snapshot on disk     {statistics.median(xs) * 1e3:8.2f} ms   "
        f"= {statistics.median(xs) / st2:5.2f} x step time (median of {len(xs)})"
    )
    ratio, wall, loss_ratio, lost = goodput()
    print("goodput of a run with 5 faults healed vs the fault-free run (300 steps, best of 2 each)")
    print(f"  useful steps per CPU-second, ratio   {ratio:8.3f}")
    print(f"  useful steps per wall-second, ratio  {wall:8.3f}   (noisy on a shared machine)")
    print(f"  final held-out loss ratio            {loss_ratio:8.4f}   (steps lost to rollbacks: {lost})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
