"""The output statistic (mscale.hook.checks.outstats): what it costs a step, how soon it finds noise at a
tower's output, and how often it cries wolf.

Cost. The README's line (`attach(..., snapshots=True, data=loader)`) on the LLaVA of
benchmarks/attach_overhead.py (its `Arm`, the realistic shape), three arms interleaved step by
step, the order rotated each batch: "off" (`ChecksumConfig(output_stats=False)`), "control" (the
same again) and "on" (the default). Printed:

- on / off: the median over rounds of the step time ratio (`_verdict.paired`), as an added
  fraction of the step, against the guard's 1% budget; the control (off / off) says how much
  of that the machine's noise can be;
- charged: what the guard itself charges the statistic (`budget.cost_s["output_stats"]`, its
  smoothed seconds a step) over its smoothed step time: the share of the detection budget it
  takes.

Detection. The tiny LLaVA of the tests (tests/support/tiny_hf.py, lr 1e-3, the guard's
defaults, no snapshots): for each seed, noise of 1x and 3x the output's std at the vision
tower's output (a forward hook on its last encoder layer, its own generator) from each onset in
--onsets, run to onset + 50 steps; the latency is the first step a warning or worse names the
vision MPU, less the onset (50+: not found). Then clean runs of --clean steps per seed: every
`output_shift` is a false alarm, counted per 1,000 steps (of the run; 3 MPUs judged each step).

    PYTHONPATH=. .venv/bin/python benchmarks/output_stats.py [--steps 24] [--repeats 3] [--seeds 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

import structlog
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from _verdict import Report, add_json_arg, add_warmup_arg, paired  # noqa: E402
from attach_overhead import HIDDEN, LAYERS, Arm  # noqa: E402

import mscale  # noqa: E402
from mscale.healing.settings import HealingSection  # noqa: E402
from mscale.hook.checks.checksum import ChecksumConfig  # noqa: E402
from mscale.hook.checks.outstats import SOURCE  # noqa: E402

BOUND = 50  # steps: the bound stated for a persistent 1x-std fault at a tower's output


def cost(args: argparse.Namespace, rep: Report) -> None:
    off = ChecksumConfig(output_stats=False)
    ratios, control, charged = [], [], []
    for r in range(args.repeats):
        arms = [
            Arm("off", args, healing=HealingSection(), clip=False, checksum=off),
            Arm("control", args, healing=HealingSection(), clip=False, checksum=off),
            Arm("on", args, healing=HealingSection(), clip=False),
        ]
        try:
            for i in range(args.warmup + args.steps):
                for k in [(i + r + j) % 3 for j in range(3)]:
                    arms[k].step(keep=i >= args.warmup)
            budget = arms[2].guard.budget
            charged.append(budget.cost_s.get(SOURCE, 0.0) / budget.step_s)
        finally:
            for a in arms:
                a.close()
        base, ctl, on = (a.wall for a in arms)
        ratios.append(paired(on, base) - 1.0)
        control.append(paired(ctl, base))
        print(
            f"  repeat {r}: off step {statistics.median(base):.3f} s, on/off {ratios[-1]:+.2%}, control {control[-1]:.3f}"
        )
    rep.figure("charged to the budget (output_stats / step)", charged, unit="x", digits=5)
    rep.verdict("added step time (on / off - 1)", ratios, 0.01, at_most=True, control=control)


def noisy_run(seed: int, steps: int, mult: float, onset: int) -> tuple[int | None, int]:
    """(first step a finding names the vision MPU at or after `onset`, or None; output_shift
    findings before the onset)."""
    from support.noise_job import add_noise
    from support.tiny_hf import tiny_llava

    torch.manual_seed(seed)
    model, make_batch = tiny_llava(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id=f"detect-{seed}", connect=False)
    vision, active = guard.mpu("vision").mpu_id, {"on": False}
    if mult:
        add_noise(model.model.vision_tower.encoder.layers[-1], mult, active, seed=100 + seed)
    try:
        for step in range(steps):
            active["on"] = bool(mult) and guard.current_step >= onset
            model(**make_batch(step, torch.Generator().manual_seed(1000 * seed + step))).loss.backward()
            opt.step()
            opt.zero_grad()
            named = [
                int(f.labels["step"])
                for f in guard.findings
                if f.labels.get("mpu_id") == vision and f.severity.value != "info" and int(f.labels["step"]) >= onset
            ]
            if mult and named:
                break
        early = [f for f in guard.findings if f.reason.value == "output_shift" and int(f.labels["step"]) < onset]
        return (min(named) if named else None), len(early)
    finally:
        guard.detach()


def detection(args: argparse.Namespace, rep: Report) -> None:
    onsets = [int(x) for x in args.onsets.split(",")]
    for mult in (1.0, 3.0):
        lat = []
        for seed in range(args.seeds):
            for onset in onsets:
                found, _ = noisy_run(seed, onset + BOUND + 1, mult, onset)
                lat.append(float(found - onset) if found is not None else float(BOUND + 1))
        rep.figure(f"latency at {mult:g}x std (steps after the onset)", lat, unit="steps", digits=1)
        missed = sum(x > BOUND for x in lat)
        print(f"  {mult:g}x: found within {BOUND} steps in {len(lat) - missed} of {len(lat)} runs")
    alarms = []
    for seed in range(args.seeds):
        _, early = noisy_run(seed, args.clean, 0.0, args.clean)
        alarms.append(1000.0 * early / args.clean)
    rep.figure(f"false alarms per 1,000 clean steps ({args.clean} steps a seed)", alarms, unit="", digits=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="timed steps per arm per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", default="realistic")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--onsets", default="20,40,60,100,150", help="steps the noise starts at")
    ap.add_argument("--clean", type=int, default=300, help="clean steps per seed")
    ap.add_argument("--skip", choices=("cost", "detection"), default=None)
    add_warmup_arg(ap)
    add_json_arg(ap)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    torch.set_num_threads(1)
    rep = Report("output_stats", args.json)
    if args.skip != "cost":
        print("cost: the README's line on the LLaVA of attach_overhead.py, output_stats off / on")
        cost(args, rep)
    if args.skip != "detection":
        print(f"detection: the tiny LLaVA, {args.seeds} seeds, noise from onsets {args.onsets}")
        detection(args, rep)
    rep.write()


if __name__ == "__main__":
    main()
