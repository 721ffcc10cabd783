"""One training run of the tiny LLaVA / Qwen2-VL (tests/support/tiny_hf.py) under the one-line
protection, with a persistent fault in its vision tower (one element of its first linear
layer's output scaled by 64, as a faulty GEMM would) over a range of steps, and the task loss
on held-out batches at the end: what tests/test_fuse_task_loss.py asserts and
benchmarks/fuse_real_models.py prints.

Variants: "clean" (no fault), "no-fuse" (the fault, the guard only), "fuse" (as shipped),
"fuse-no-l2" (no L2 reduction), "fuse-no-l3" (the L3 term's weight 0), "fuse-bare" (neither).
"""

from __future__ import annotations

import math
import time

import torch

import mscale
from mscale.healing.engine import Decision
from mscale.hook.core.mpu import Mpu
from mscale.hook.fuse.fuse import FusePlugin
from support.tiny_hf import CAPTION, CLASSES, tiny_llava, tiny_qwen2vl

VARIANTS = ("clean", "no-fuse", "fuse", "fuse-no-l2", "fuse-no-l3", "fuse-bare")
HELD_OUT = 16  # held-out batches (their own generator seeds, never trained on)


def image_levels(endings: int) -> tuple[float, float, float]:
    """The task loss per caption token of a model that reads its images (it can only miss the
    random ending: the floor), of one blind to them (it also misses which of the classes it
    sees), and the level a run must end below to count as having learned from its images: two
    thirds of the way from blind to floor (with 4 endings: 0.23, 0.58, 0.35)."""
    floor = math.log(endings) / CAPTION
    blind = (math.log(CLASSES) + math.log(endings)) / CAPTION
    return floor, blind, floor + (blind - floor) / 3


class Timeline:
    """The fuse's state changes of the vision MPU, by step (a guard plugin)."""

    def __init__(self) -> None:
        self.states: list[tuple[int, str]] = []
        self.applied: list[tuple[int, str]] = []  # (step, action) booked "applied" on the vision MPU

    def on_finding(self, f) -> None:
        from mscale.findings import Reason

        if f.labels.get("mpu_id") != "001":
            return
        if f.reason is Reason.FUSE_STATE:
            self.states.append((int(f.labels.get("step", -1)), f.labels["state"]))
        elif f.reason is Reason.HEAL_ACTION and f.labels.get("result") == "applied":
            self.applied.append((int(f.labels.get("step", -1)), f.labels.get("action", "")))


def held_out_loss(model, make_batch) -> float:
    """The task loss on batches never trained on (eval mode, no gradients)."""
    model.eval()
    with torch.no_grad():
        xs = [
            float(model(**make_batch(-1, torch.Generator().manual_seed(1_000_000 + i))).loss) for i in range(HELD_OUT)
        ]
    model.train()
    return sum(xs) / len(xs)


def fuse_run(
    model_name: str,
    variant: str,
    steps: int,
    seed: int,
    resolution: float | None = None,
    image: int = 16,
    fault: range = range(5, 60),
    endings: int = 1,
) -> dict:
    """One training run; its held-out task loss at the end, its last 30 steps' training loss,
    the vision MPU's fuse states by step, the seconds it took."""
    if model_name == "llava":
        model, make_batch = tiny_llava(seed, image, endings)
    else:
        model, make_batch = tiny_qwen2vl(seed, endings, normalize=True)  # raw pixels: never read
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    timeline = Timeline()
    guard = mscale.attach(model, opt, job_id=variant, snapshots=variant != "no-fuse", connect=False, plugins=[timeline])
    if guard.fuse is not None:
        if resolution is not None:
            guard.fuse.states["l2_degrade"].resolution = resolution
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
        on["fault"] = variant != "clean" and s in fault
        out = model(**make_batch(s, torch.Generator().manual_seed(s)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        task.append(guard.summary().get("loss"))  # the task loss the guard saw (without the L3 term)
    secs = time.perf_counter() - t0
    guard.detach()
    tail = [x for x in task[-30:] if x is not None]
    return {
        "held_out": held_out_loss(model, make_batch),
        "train": sum(tail) / len(tail),
        "states": timeline.states,
        "applied": timeline.applied,
        "seconds": secs,
    }


def fuse_decision(fuse: FusePlugin, mpu: Mpu, action: str, *, step: int | None) -> Decision:
    """The decision a test hands the fuse to apply `action` to `mpu` now, as the healing
    engine would have decided it (its level from the action's name: l2_degrade -> L2)."""
    level = action.split("_", 1)[0].upper()
    target = fuse._target(mpu)
    return Decision(
        rule="t", action=action, level=level, target=target, before=mpu.fuse_level, reason="test", step=step
    )
