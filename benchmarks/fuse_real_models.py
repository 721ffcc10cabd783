"""What the fuse's L1 -> L2 -> L3 escalation and recovery cost the task loss on the tiny LLaVA /
Qwen2-VL (tests/support/tiny_hf.py), trained on CPU with the one-line protection: a persistent
fault in the vision tower (one element of its first linear layer's output scaled by 64, 55
steps from --fault-start) escalates it L1 -> L2 -> L3 and it recovers 50 clean steps after the
fault ends (tests/support/fuse_runs.py). Each variant's task loss on 16 held-out batches at
the end is printed as a ratio to the fault-free run of the same seed, data and length; the
verdict is on the median over the seeds (target <= 1.1):

    clean          no fault
    no-fuse        the fault, the guard only (no healing)
    fuse           the fault, the fuse as shipped (L1, L2 reduction where one applies, L3 term)
    fuse-no-l2     the same without L2's reduction
    fuse-no-l3     the same with the L3 term's weight at 0
    fuse-bare      neither (L1 and the levels' bookkeeping only)

By default clean, no-fuse and fuse (`make benchmarks`' quick run); the ablations on request
with --variants.

The default task has 4 caption endings per image drawn at random (a loss floor of ln 4 / 6),
and 800 steps: both runs end on their plateau. With one ending the loss falls toward 0 as long
as training runs, and at 300 steps the ratio measures when each run began to read its images
(the tiny LLaVA ignores them for its first 130-250 steps), not what the fuse did. A ratio only
means something when the fault-free run learned to read its images: each seed's clean held-out
loss is shown against the image-blind level and the floor, and the verdict is "inconclusive"
when a clean run ends above two thirds of the way from blind to floor (0.35 with 4 endings).
The tiny Qwen2-VL gets pixels normalized as its image processor does (raw 0..1 pixels: it never
reads them).

Run: PYTHONPATH=. .venv/bin/python benchmarks/fuse_real_models.py [--model llava|qwen2vl]
     [--seeds 0,1,2] [--steps 800] [--endings 4] [--image 16] [--variants clean,fuse]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import structlog
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _verdict import Report, add_json_arg  # noqa: E402

from support.fuse_runs import HELD_OUT, VARIANTS, fuse_run, image_levels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("llava", "qwen2vl"), default="llava")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument(
        "--seeds", default="0,1,2", help="comma-separated seeds (at least 3 for a verdict); the median ratio"
    )
    add_json_arg(ap)
    ap.add_argument("--variants", default="no-fuse,fuse", help=f"any of {','.join(VARIANTS)}")
    ap.add_argument("--image", type=int, default=16, help="the tiny LLaVA's image side (16: a 4x4 patch grid)")
    ap.add_argument("--l2-resolution", type=float, default=None, help="L2's image scale (default: the fuse's)")
    ap.add_argument("--fault-start", type=int, default=5, help="the first faulty step (the fault lasts 55 steps)")
    ap.add_argument("--endings", type=int, default=4, help="caption endings per image (>1: a loss floor above 0)")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    torch.set_num_threads(1)
    variants = [v for v in args.variants.split(",") if v]
    if "clean" not in variants:
        variants.insert(0, "clean")
    fault = range(args.fault_start, args.fault_start + 55)
    print(
        f"tiny {args.model} ({args.image}px, {args.endings} caption ending(s)), {args.steps} steps, "
        f"L2 at {args.l2_resolution if args.l2_resolution is not None else 'the default'}; "
        f"fault over steps {fault.start}-{fault.stop - 1}; held-out loss over {HELD_OUT} batches"
    )
    rep = Report("fuse_real_models", args.json)
    ratios: dict[str, list[float]] = {v: [] for v in variants if v != "clean"}
    floor, blind, learned = image_levels(args.endings)
    blind_seeds: list[int] = []
    for seed in [int(x) for x in args.seeds.split(",") if x]:
        runs = {
            v: fuse_run(args.model, v, args.steps, seed, args.l2_resolution, args.image, fault, args.endings)
            for v in variants
        }
        base = runs["clean"]["held_out"]
        read = base < learned
        if not read:
            blind_seeds.append(seed)
        print(
            f" seed {seed}: clean held-out {base:.4f} (image-blind {blind:.2f}, floor {floor:.2f}: "
            f"{'reads its images' if read else 'did NOT learn to read its images'})"
        )
        for v, r in runs.items():
            if v == "clean":
                continue
            ratios[v].append(r["held_out"] / base)
            changes = ", ".join(f"{state}@{step}" for step, state in r["states"])
            print(
                f"  {v:12s} held-out {r['held_out']:.4f} ({ratios[v][-1]:5.2f}x clean), "
                f"train tail {r['train']:.4f}, {r['seconds']:.1f} s; {changes}"
            )
    for v, xs in ratios.items():
        rep.figure(f"{args.model} {v}: held-out task loss / fault-free", xs, unit="x", show=False)
        if v != "fuse":
            continue
        label = f"{args.model} fuse: held-out task loss / fault-free"
        if len(xs) < 3:  # a verdict is on the median of at least 3 repeats
            print(f"  {label:<52} {', '.join(f'{x:.2f}x' for x in xs)}: a verdict needs 3 seeds")
        elif blind_seeds:  # a ratio between runs that ignore their images says nothing about the fuse
            rep.data["verdicts"][label] = {"samples": xs, "target": "<= 1.1", "verdict": "inconclusive"}
            print(f"  {label:<52} inconclusive: the clean run of seed(s) {blind_seeds} did not read its images")
        else:
            rep.verdict(label, xs, target=1.1, higher=False)
    rep.write()


if __name__ == "__main__":
    main()
