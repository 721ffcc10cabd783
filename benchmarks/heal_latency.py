"""Healing latency and goodput, on the tiny multimodal model trained on CPU.

1. Checksum failure -> swapped: from the checksum failure that completes the L1 trigger
   (the Nth consecutive failing step) to the swap applied and the MPU's forward re-run; and
   from the injection to the swap (N steps of evidence by design).
2. Xid -> emergency snapshot written: from the chaos API call on the agent (simulated GPU)
   through the GPU probe, the engine, the link command and the job's fuse, to the snapshot
   on disk (fsynced and renamed).
3. Goodput: useful steps per second of a run with five faults healed (L1, L2/L3, a 25x spike,
   a NaN loss) against the same run without faults.
4. Weight corruption (one element x1024 between steps) -> detected and repaired: the step it
   is found in (0: the step that would first use it), the repair's time as a ratio of the
   step time, in place (a snapshot of the last step) and by rollback (an older snapshot, the
   steps since re-run); and the fingerprints' own cost per step (record + check).
5. Goodput on the tiny Hugging Face LLaVA: a run with five faults (SDC on the vision MPU's GPU:
   L1; a 25x loss spike; a NaN loss; corruption that follows the vision MPU: L1, L2, L3 and
   recovery; a weight corrupted between steps) against its fault-free run, useful steps per
   CPU-second per round, target >= 0.9, the fault-free runs against each other the control.

Each figure is printed as a ratio against a baseline measured in the same run (the median
step time, the fault-free throughput), as the median of its repeats with their range
(benchmarks/_verdict.py); goodput pairs a faulty and a fault-free run per round, and the
fault-free runs against each other are its control (truly 1.00).

    .venv/bin/python benchmarks/heal_latency.py [--rounds 3] [--steps 200] [--json PATH]
        [--only weights,llava]     (those parts alone)
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


def weight_repair(reps: int = 5) -> dict[str, list[float]]:
    """Per repair path: [steps from corruption to detection], [repair seconds / step time],
    [steps re-run]; and the fingerprints' cost per step / step time."""
    import torch

    out: dict[str, list[float]] = {}
    for path, memory_every in (("in_place", 1), ("rollback", 5)):
        for i in range(reps):
            at = 23 + i % 3 + 5 * (i // 3)  # (at - 1) % 5 != 0: the rollback path's snapshot is older

            def between_steps(r, at=at) -> None:
                if r.guard.current_step == at and not r.__dict__.get("hit"):
                    r.hit = True
                    with torch.no_grad():
                        r.model.vision_tower.layers[0].linear1.weight.view(-1)[5] *= 1024

            r = run(RunConfig(steps=at + 6, seed=i, memory_every=memory_every, before_step=between_steps))
            (found,) = r.events("weight_corruption")
            fixed = max(r.actions("rollback") + r.actions("restore_weights"), key=lambda f: f.time)
            st = step_time(r)
            rerun = r.steps_run - r.steps
            out.setdefault(f"{path}_detect_steps", []).append(int(found.labels["step"]) - at)
            out.setdefault(f"{path}_repair_x_step", []).append((fixed.time - found.time + rerun * st) / st)
            out.setdefault(f"{path}_rerun_steps", []).append(rerun)
    # the watch's own cost: one record and one check, against the step time of a clean run
    r = Run(RunConfig(steps=40))
    try:
        t0 = time.perf_counter()
        for _ in range(40):
            r.one_step()
        st = (time.perf_counter() - t0) / 40
        watch = r.fuse.states["restore_weights"].watch
        for _ in range(reps):
            t0 = time.perf_counter()
            for k in range(100):
                watch.settle()
                watch.check(k)
            out.setdefault("fingerprint_x_step", []).append((time.perf_counter() - t0) / 100 / st)
    finally:
        r.close()
    return out


def llava_goodput(reps: int = 5, steps: int = 300) -> tuple[list[float], list[float], list[int], list[bool]]:
    """(ratios faulted/clean of useful steps per CPU-second, clean rates, steps lost, every
    fault healed) per repeat, on the tiny LLaVA in a plain loop with the one-line protection."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import mscale
    from mscale.sim.chaos_job import ChaosPlugin
    from support.tiny_hf import tiny_llava

    torch.set_num_threads(1)
    at = {30: ("corrupt", {"gpu": 0, "mode": "noise", "steps": 6}), 90: ("loss_spike", {"factor": 25.0})}
    at |= {130: ("nan_loss", {}), 160: ("corrupt", {"mpu": "vision", "mode": "noise", "steps": 15})}
    at |= {250: ("weights", {})}

    def one(faulted: bool) -> tuple[float, int, bool]:
        model, make_batch = tiny_llava(seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        chaos = ChaosPlugin(seed=0)
        applied: set[str] = set()

        class Applied:  # the actions booked "applied" (the guard keeps only recent findings)
            def on_finding(self, f) -> None:
                if f.reason.value == "heal_action" and f.labels.get("result") == "applied":
                    applied.add(f.labels.get("action", ""))

        guard = mscale.attach(
            model,
            opt,
            job_id="llava-goodput",
            connect=False,
            plugins=[chaos, Applied()],
            snapshots=mscale.SnapshotConfig(memory_every=5),
        )
        todo, runs = dict(at) if faulted else {}, 0
        c0 = time.process_time()
        try:
            while guard.current_step < steps:
                step = guard.current_step
                kind, args = todo.pop(step, ("", {}))
                if kind == "weights":
                    with torch.no_grad():
                        model.model.vision_tower.encoder.layers[0].mlp.fc1.weight.view(-1)[5] *= 1024
                elif kind:
                    chaos.inject(kind, **args)
                batch = make_batch(step, torch.Generator().manual_seed(step))
                opt.zero_grad()
                model(**batch).loss.backward()
                opt.step()
                runs += 1
            cpu = time.process_time() - c0
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            acted = {"l1_swap", "l2_degrade", "l3_distill", "recover", "lr_cool", "rollback", "restore_weights"}
            healed = finite and (not faulted or (guard.mpu("vision").gpu != 0 and acted <= applied))
        finally:
            guard.detach()
        return steps / cpu, runs - steps, healed

    ratios, clean, lost, healed = [], [], [], []
    for _ in range(reps):  # a fault-free and a faulty run back to back, each round
        c, _, _ = one(False)
        f, n, ok = one(True)
        clean.append(c)
        ratios.append(f / c)
        lost.append(n)
        healed.append(ok)
    return ratios, clean, lost, healed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="goodput rounds (a fault-free and a faulty run each)")
    ap.add_argument("--steps", type=int, default=200, help="steps of each goodput run")
    ap.add_argument("--only", default="", help="comma-separated parts to run alone: weights, llava")
    add_json_arg(ap)
    args = ap.parse_args()
    rep = Report("heal_latency", args.json)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    if args.only:
        extras(rep, set(args.only.split(",")))
        rep.write()
        return 0
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
    extras(rep, {"weights", "llava"})
    rep.write()
    return 0


def extras(rep: Report, parts: set[str]) -> None:
    if "weights" in parts:
        w = weight_repair()
        print("weight corruption (x1024 between steps) -> detected and repaired (tiny model)")
        for path, how in (("in_place", "in place"), ("rollback", "by rollback (snapshot <= 5 steps old)")):
            rep.figure(f"{how}: steps from corruption to finding", w[path + "_detect_steps"], unit="steps", digits=0)
            rep.figure(f"{how}: repair, x step time", w[path + "_repair_x_step"], unit="x")
            rep.figure(f"{how}: steps re-run", w[path + "_rerun_steps"], unit="steps", digits=0)
        rep.figure(
            "fingerprints per step (record + check), share of a step", w["fingerprint_x_step"], unit="x", digits=4
        )
    if "llava" in parts:
        ratios, clean, lost, healed = llava_goodput()
        control = [b / a for a, b in zip(clean, clean[1:], strict=False)]
        print(f"goodput on the tiny LLaVA: 5 faults healed vs fault-free (300 steps, {len(ratios)} rounds)")
        rep.verdict(
            "tiny LLaVA: useful steps per CPU-second, faulty / fault-free", ratios, 0.9, control=control, digits=3
        )
        rep.figure("tiny LLaVA: steps re-run after rollbacks", [float(n) for n in lost], unit="steps", digits=0)
        # the part of the goodput no timing noise touches: useful steps / steps run (the rest is
        # the faulty run's extra work per step, which the ratio above measures with the noise)
        rep.figure(
            "tiny LLaVA: useful steps / steps run (no timing)", [300 / (300 + n) for n in lost], unit="x", digits=3
        )
        print(f"  every faulty run healed: {all(healed)}")


if __name__ == "__main__":
    sys.exit(main())
