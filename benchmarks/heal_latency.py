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
step time, the fault-free throughput), as the median of its repeats with their range
(benchmarks/_verdict.py); goodput pairs a faulty and a fault-free run per round, and the
fault-free runs against each other are its control (truly 1.00).

    .venv/bin/python benchmarks/heal_latency.py [--rounds 3] [--steps 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verdict import Report, add_json_arg  # noqa: E402

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


def goodput(rounds: int, steps: int) -> tuple[list[float], list[float], list[float], list[float], int]:
    """Per round: useful steps per CPU-second and per wall-second of the faulty run against
    the fault-free one, the held-out loss ratio; and the control: fault-free against the
    previous round's fault-free run. Plus the steps lost to rollbacks (last round)."""
    faults = (
        Fault(steps // 10, "corrupt", {"gpu": 0, "mode": "noise", "steps": 20}),
        Fault(3 * steps // 10, "corrupt", {"mpu": "vision", "mode": "noise", "steps": 25}),
        Fault(55 * steps // 100, "loss_spike", {"factor": 25.0}),
        Fault(70 * steps // 100, "nan_loss", {}),
        Fault(85 * steps // 100, "corrupt", {"gpu": 1, "mode": "noise", "steps": 20}),
    )
    cpu, wall, loss, control = [], [], [], []
    prev = None
    lost = 0
    for _ in range(rounds):  # a fault-free and a faulty run back to back, each round
        ref = run(RunConfig(steps=steps))
        bad = run(RunConfig(steps=steps, faults=faults))
        cpu.append((bad.steps / bad.cpu_s) / (ref.steps / ref.cpu_s))
        wall.append((bad.steps / bad.wall_s) / (ref.steps / ref.wall_s))
        loss.append(bad.eval_loss / ref.eval_loss)
        if prev is not None:
            control.append((ref.steps / ref.cpu_s) / (prev.steps / prev.cpu_s))
        prev, lost = ref, bad.steps_lost
    return cpu, wall, loss, control, lost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="goodput rounds (a fault-free and a faulty run each)")
    ap.add_argument("--steps", type=int, default=200, help="steps of each goodput run")
    add_json_arg(ap)
    args = ap.parse_args()
    rep = Report("heal_latency", args.json)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    trig, inj, st = checksum_to_swap()
    print("checksum failure -> swapped (tiny model, CPU, 1 thread)")
    rep.figure("step time (baseline, same run), ms", [st * 1e3], unit="ms", digits=2)
    rep.figure("Nth failure -> swapped, re-run done, x step time", [t / st for t in trig], unit="x")
    rep.figure("first failure -> swapped (3 steps of evidence), x step time", [t / st for t in inj], unit="x")
    xs, st2 = xid_to_emergency_snapshot()
    print("Xid -> emergency snapshot written (agent probe -> engine -> link -> fuse -> disk)")
    rep.figure("step time of the Xid runs (baseline), ms", [st2 * 1e3], unit="ms", digits=2)
    rep.figure("Xid injected -> snapshot on disk, ms", [x * 1e3 for x in xs], unit="ms", digits=1)
    rep.figure("Xid injected -> snapshot on disk, x step time", [x / st2 for x in xs], unit="x")
    cpu, wall, loss, control, lost = goodput(args.rounds, args.steps)
    print(f"goodput of a run with 5 faults healed vs the fault-free run ({args.steps} steps, {args.rounds} rounds)")
    rep.figure("useful steps per CPU-second, faulty / fault-free", cpu, unit="x", digits=3)
    rep.figure("useful steps per wall-second, faulty / fault-free", wall, unit="x", digits=3)
    rep.figure("control: fault-free / fault-free (CPU)", control, unit="x", digits=3)
    rep.figure("final held-out loss, faulty / fault-free", loss, unit="x", digits=4)
    print(f"  steps lost to rollbacks: {lost}")
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
