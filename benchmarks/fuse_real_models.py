"""What the fuse's L2 and L3 cost the task loss on the tiny LLaVA / Qwen2-VL (tests/support/tiny_hf.py),
trained on CPU with the one-line protection: a persistent fault in the vision tower (one element
of its first linear layer's output scaled by 64, steps 5-59) escalates it L1 -> L2 -> L3 and it
recovers 50 clean steps later. Each variant's final task loss (mean of the last 30 steps) is
printed as a ratio to the fault-free run of the same length and seed:

    clean          no fault
    no-fuse        the fault, the guard only (no healing)
    fuse           the fault, the fuse as shipped (L1, L2 reduction, L3 term)
    fuse-no-l2     the same without L2's reduction
    fuse-no-l3     the same with the L3 term's weight at 0
    fuse-bare      neither (L1 and the levels' bookkeeping only)

Run: PYTHONPATH=. .venv/bin/python benchmarks/fuse_real_models.py [--model llava|qwen2vl] [--steps 300]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import structlog
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import mscale  # noqa: E402
from support.tiny_hf import tiny_llava, tiny_qwen2vl  # noqa: E402

VARIANTS = ("clean", "no-fuse", "fuse", "fuse-no-l2", "fuse-no-l3", "fuse-bare")
FAULT = range(5, 60)


def one(model_name: str, variant: str, steps: int, seed: int) -> tuple[float, float]:
    model, make_batch = {"llava": tiny_llava, "qwen2vl": tiny_qwen2vl}[model_name](seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = mscale.attach(model, opt, job_id=variant, snapshots=variant != "no-fuse", connect=False)
    if guard.fuse is not None:
        if variant in ("fuse-no-l2", "fuse-bare"):
            guard.fuse.states["l2_degrade"].resolution = 1.0  # no reduction applies
        if variant in ("fuse-no-l3", "fuse-bare"):
            guard.fuse.states["l3_distill"].band = (0.0, 0.0)  # weight 0
    tower = getattr(model.model, "vision_tower", None) or model.model.visual
    linear = next(m for m in tower.modules() if isinstance(m, torch.nn.Linear))
    on = {"fault": False}

    def corrupt(module, args, out):
        if on["fault"]:
            out = out.clone()
            out.view(-1)[0] = out.view(-1)[0] * 64.0 + 3.0
            return out
        return None

    linear.register_forward_hook(corrupt, prepend=True)
    task = []
    t0 = time.perf_counter()
    for s in range(steps):
        on["fault"] = variant != "clean" and s in FAULT
        out = model(**make_batch(s, torch.Generator().manual_seed(s)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        task.append(guard.summary().get("loss"))  # the task loss the guard saw (without the L3 term)
    guard.detach()
    tail = [x for x in task[-30:] if x is not None]
    return sum(tail) / len(tail), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("llava", "qwen2vl"), default="llava")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    torch.set_num_threads(1)
    variants = [v for v in args.variants.split(",") if v]
    if "clean" not in variants:
        variants.insert(0, "clean")
    results = {v: one(args.model, v, args.steps, args.seed) for v in variants}
    base = results["clean"][0]
    print(f"tiny {args.model}, {args.steps} steps, seed {args.seed}; fault over steps {FAULT.start}-{FAULT.stop - 1}")
    for v, (loss, secs) in results.items():
        print(f"  {v:12s} final task loss {loss:.4f}  ratio to clean {loss / base:6.2f}  ({secs:.1f} s)")


if __name__ == "__main__":
    main()
