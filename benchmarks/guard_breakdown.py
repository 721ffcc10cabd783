"""Where the README's whole line spends its time: a per-component breakdown of what
`mscale.attach(model, opt, job_id=..., snapshots=True, data=loader)` adds to a step of the
Hugging Face LLaVA of benchmarks/attach_overhead.py, against the loop with `clip_grad_norm_`.

Not a verdict (attach_overhead.py gives that): the figures here say where the overhead goes,
measured so that a shared, noisy machine changes them little.

- Component CPU time. Every guard, detector, plugin and fuse entry point that runs in a step
  (the list in COMPONENTS) is wrapped at class level, for the run, with a timer of the training
  thread's CPU time (time.thread_time_ns: another process on the core does not count) that
  keeps each component's *self* time (nested components' time taken out), so the parts add up
  without double counting. Calls per step are counted exactly.
- Hook dispatch. A module with any hook leaves `nn.Module.__call__`'s fast path, and every
  Python hook the autograd engine calls is a Python call from C++: costs no wrapper sees. The
  hooks on the model are counted (forward hooks, pre-hooks, tensor and post-accumulate-grad
  hooks called per step: exact counts) and priced with a micro-measure of one hooked call
  against an unhooked one, in this process (median of many).
- The baseline's own extra: `clip_grad_norm_`, which CMSA replaces, timed the same way in the
  clip arm: the guard's net cost is its components minus that.
- Step CPU time of both arms, interleaved (one step of each per batch), without the wrappers:
  the measured total the breakdown should explain; and the snapshot's background copy, its
  thread's CPU time a step, apart (it runs beside the step, not in it).
- `--load busy`: a second process spinning on one core, pinned apart as attach_overhead.py
  does (the training thread and the copier on the other core): which parts grow under load.

    PYTHONPATH=. .venv/bin/python benchmarks/guard_breakdown.py [--steps 24] [--warmup 4] [--load busy]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import structlog
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attach_overhead import COPY_CPU, SHAPES, Arm, busy_core, time_background_copies  # noqa: E402

from mscale.healing.settings import HealingSection  # noqa: E402

# (module, class or "" for a module function, attribute): each entry point timed
COMPONENTS: list[tuple[str, str, str]] = [
    ("mscale.hook.core.guard", "Guard", "_model_pre"),
    ("mscale.hook.core.guard", "Guard", "_model_post"),
    ("mscale.hook.core.guard", "Guard", "_begin_step"),
    ("mscale.hook.core.guard", "Guard", "poll_commands"),
    ("mscale.hook.core.guard", "Guard", "_mpu_pre"),
    ("mscale.hook.core.guard", "Guard", "_mpu_post"),
    ("mscale.hook.core.guard", "Guard", "_pre_step"),
    ("mscale.hook.core.guard", "Guard", "_commit_checks"),
    ("mscale.hook.checks.stepstats", "StepStatistics", "measure"),
    ("mscale.hook.core.guard", "Guard", "_post_step"),
    ("mscale.hook.core.guard", "Guard", "_end_step"),
    ("mscale.hook.core.guard", "Guard", "_report"),
    ("mscale.hook.checks.inputs", "InputCheck", "begin"),
    ("mscale.hook.checks.inputs", "InputCheck", "bad"),
    ("mscale.hook.core.mpu", "Mpu", "_mark_backward_start"),
    ("mscale.hook.core.mpu", "Mpu", "_mark_backward_end"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "begin_step"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "before_forward"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "_linear"),
    ("mscale.hook.checks.weight_sums", "WeightSums", "of"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "_abft_sums"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "after_forward"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "_replay"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "pack"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "judge"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "end_step"),
    ("mscale.hook.checks.checksum", "ChecksumDetector", "figures"),
    ("mscale.hook.checks.cmsa", "GradStatistics", "measure"),
    ("mscale.hook.checks.cmsa", "Cmsa", "apply"),
    ("mscale.hook.checks.loss", "LossDetector", "observe"),
    ("mscale.hook.checks.gradcheck", "GradCheck", "on_step_begin"),
    ("mscale.hook.checks.gradcheck", "GradCheck", "_accumulated"),
    ("mscale.hook.checks.gradcheck", "GradCheck", "on_step_decide"),
    ("mscale.hook.core.goodput", "GoodputAccountant", "on_step_begin"),
    ("mscale.hook.core.goodput", "GoodputAccountant", "on_report"),
    ("mscale.hook.fuse.fuse", "FusePlugin", "on_step_begin"),
    ("mscale.hook.fuse.fuse", "FusePlugin", "on_mpu_output"),
    ("mscale.hook.fuse.fuse", "FusePlugin", "on_finding"),
    ("mscale.hook.fuse.fuse", "FusePlugin", "on_step_end"),
    ("mscale.hook.checks.weights", "WeightWatch", "check"),
    ("mscale.hook.checks.weights", "WeightWatch", "settle"),
    ("mscale.snapshot.engine", "SnapshotEngine", "step_end"),
    ("torch.nn.utils", "", "clip_grad_norm_"),
]


class Clock:
    """Self CPU time (training thread) and calls per component, nested calls taken out; with
    `ops` on, the aten operations each component runs and the elements they read, counted
    exactly (a TorchDispatchMode attributes each op to the innermost open component)."""

    def __init__(self) -> None:
        self.on = False
        self.self_ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.ops: dict[str, int] = defaultdict(int)
        self.elements: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # per open call: [name, children's ns]

    def wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            self._stack.append([name, 0])
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - t0
                children = self._stack.pop()[1]
                self.self_ns[name] += spent - children
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][1] += spent

        return timed

    def counting(self) -> Any:
        """A dispatch mode counting ops and the elements of their tensor inputs (views read
        nothing and are not counted) per component ("model": none open)."""
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        clock = self

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                who = clock._stack[-1][0] if clock._stack else "model"
                clock.ops[who] += 1
                if not func.is_view:  # a view reads nothing
                    clock.elements[who] += sum(
                        t.numel() for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)
                    )
                return func(*args, **(kwargs or {}))

        return Count()


def instrument(clock: Clock) -> list[tuple[Any, str, Any]]:
    """Wrap every COMPONENTS entry at class level; returns what to put back."""
    undo = []
    for modname, cls, attr in COMPONENTS:
        try:
            mod = importlib.import_module(modname)
            owner = getattr(mod, cls) if cls else mod
            fn = owner.__dict__[attr] if cls else getattr(owner, attr)
        except (ImportError, AttributeError, KeyError):
            print(f"  (no {modname}.{cls + '.' if cls else ''}{attr} in this tree: not timed)")
            continue
        undo.append((owner, attr, fn))
        setattr(owner, attr, clock.wrap(f"{cls + '.' if cls else ''}{attr}", fn))
    return undo


def hook_counts(model: torch.nn.Module) -> dict[str, int]:
    """Hooks registered on the model's modules and parameters, by kind (exact)."""
    out = {"forward hooks": 0, "forward pre-hooks": 0, "post-accumulate-grad hooks": 0, "hooked modules": 0}
    for m in model.modules():
        f, p = len(m._forward_hooks), len(m._forward_pre_hooks)
        out["forward hooks"] += f
        out["forward pre-hooks"] += p
        out["hooked modules"] += 1 if f or p else 0
    for p in model.parameters():
        out["post-accumulate-grad hooks"] += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return out


def hooked_module_calls(model: torch.nn.Module, step: Any) -> tuple[int, int]:
    """(calls of modules carrying a forward hook or pre-hook, all module calls) in one step."""
    counts = [0, 0]

    def count(mod: torch.nn.Module, args: Any) -> None:
        counts[1] += 1
        if mod._forward_hooks or mod._forward_pre_hooks:
            counts[0] += 1

    h = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        step()
    finally:
        h.remove()
    return counts[0], counts[1]


def price_of_hooks(n: int = 20000) -> tuple[float, float]:
    """(extra CPU seconds of one module call with a no-op forward hook over one without, of one
    Python post-accumulate-grad hook call): medians of 9 rounds of `n` calls, this process."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def per_call(fn: Any) -> float:
        rounds = []
        for _ in range(9):
            t0 = time.thread_time()
            for _ in range(n):
                fn()
            rounds.append((time.thread_time() - t0) / n)
        return statistics.median(rounds)

    with torch.no_grad():
        bare = per_call(lambda: lin(x))
        h = lin.register_forward_hook(lambda m, a, o: None)
        hooked = per_call(lambda: lin(x))
        h.remove()
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(64)]

    def backward() -> None:
        torch.stack([p.sum() for p in ps]).sum().backward()

    m = max(1, n // 400)
    plain = per_call_n(backward, m)
    hs = [p.register_post_accumulate_grad_hook(lambda p: None) for p in ps]
    with_hooks = per_call_n(backward, m)
    for h in hs:
        h.remove()
    return hooked - bare, (with_hooks - plain) / len(ps)


def per_call_n(fn: Any, n: int) -> float:
    rounds = []
    for _ in range(9):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        rounds.append((time.thread_time() - t0) / n)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="timed steps per arm and phase")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default="realistic", help="tokens a sample (attach_overhead.SHAPES)"
    )
    ap.add_argument(
        "--load",
        choices=("idle", "busy"),
        default="idle",
        help="busy: a second process spinning on one core, pinned apart as in attach_overhead.py",
    )
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    time_background_copies()
    clock = Clock()
    undo = instrument(clock)  # before attach: the hooks bind the wrapped methods
    busy = args.load == "busy"
    with busy_core(busy):  # stopped after the arms are closed
        clip = Arm("clip", args, clip=True)
        line = Arm("attached", args, healing=HealingSection(), clip=False)
        arms = [clip, line]
        taken, inner = [0], line.step  # the line's steps, for the snapshot copy's CPU time a step

        def counted(keep: bool) -> None:
            taken[0] += 1
            inner(keep)

        line.step = counted  # type: ignore[method-assign]
        try:
            for i in range(args.warmup):
                for a in arms[i % 2 :] + arms[: i % 2]:
                    a.step(keep=False)
            # phase 1: uninstrumented, interleaved, order alternating: the measured total
            for i in range(args.steps):
                for a in arms[i % 2 :] + arms[: i % 2]:
                    a.step(keep=True)
            # phase 2: the components, timed (the wrappers cost a little themselves)
            clock.on = True
            for i in range(args.steps):
                for a in arms[i % 2 :] + arms[: i % 2]:
                    a.step(keep=False)
            timed_ns, timed_calls = dict(clock.self_ns), dict(clock.calls)
            # phase 3: aten ops and elements read per component, a few steps of each arm (slow)
            clock.ops_steps = ops_steps = min(4, args.steps)
            with clock.counting():
                for _ in range(ops_steps):
                    line.step(keep=False)
                    clip.step(keep=False)
            clock.on = False
            clock.self_ns, clock.calls = defaultdict(int, timed_ns), defaultdict(int, timed_calls)
            hooked, calls = hooked_module_calls(line.model, lambda: line.step(keep=False))
            bwd_calls = clock.calls.get("Mpu._mark_backward_end", 0) + clock.calls.get("GradCheck._accumulated", 0)
            counts = hook_counts(line.model)
            figures = line.guard.checksum.figures()
            budget = line.guard.budget.figures()
            copy_s = sum(COPY_CPU.values())
        finally:
            for owner, attr, fn in undo:
                setattr(owner, attr, fn)
            for a in arms:
                a.close()
    fwd_price, bwd_price = price_of_hooks()
    n = args.steps
    base_cpu, line_cpu = statistics.median(clip.cpu), statistics.median(line.cpu)
    print(
        f"guard_breakdown: LLaVA {args.hidden}x{args.layers} + {args.hidden}x{args.layers}, batch {args.batch}, "
        f"{n} steps per arm and phase, one torch thread"
        + (", a second process spinning on one core (pinned apart)" if busy else "")
    )
    print(
        f"  step CPU time (median): clip {base_cpu * 1e3:.1f} ms, the line {line_cpu * 1e3:.1f} ms: "
        f"{(line_cpu / base_cpu - 1) * 100:+.2f}%"
    )
    k = clock.ops_steps
    print(
        f"  {'component (self CPU time)':<40} {'calls/step':>10} {'us/step':>9} {'% of step':>9} "
        f"{'aten ops/step':>13} {'M elements/step':>15}"
    )
    rows = sorted(clock.self_ns.items(), key=lambda kv: -kv[1])
    total_us = 0.0
    for name, ns in rows:
        if name == "clip_grad_norm_":
            continue
        us = ns / 1e3 / n
        total_us += us
        print(
            f"  {name:<40} {clock.calls[name] / n:>10.1f} {us:>9.0f} {us / (base_cpu * 1e4):>8.3f}% "
            f"{clock.ops[name] / k:>13.0f} {clock.elements[name] / k / 1e6:>15.2f}"
        )
    guard_ops = sum(v for w, v in clock.ops.items() if w not in ("model", "clip_grad_norm_"))
    guard_el = sum(v for w, v in clock.elements.items() if w not in ("model", "clip_grad_norm_"))
    print(
        f"  aten ops a step: the guard's {guard_ops / k:.0f} ({guard_el / k / 1e6:.1f}M elements read), "
        f"clip_grad_norm_'s {clock.ops['clip_grad_norm_'] / k:.0f} "
        f"({clock.elements['clip_grad_norm_'] / k / 1e6:.1f}M), the model's own (both arms) "
        f"{clock.ops['model'] / k:.0f} ({clock.elements['model'] / k / 1e6:.1f}M)"
    )
    dispatch_us = (hooked / 1 * fwd_price + bwd_calls / n * bwd_price) * 1e6
    print(
        f"  {'hook dispatch (priced, not timed)':<40} {hooked + bwd_calls / n:>10.1f} {dispatch_us:>9.0f} "
        f"{dispatch_us / (base_cpu * 1e4):>8.3f}%"
    )
    clip_us = clock.self_ns.get("clip_grad_norm_", 0) / 1e3 / n
    print(
        f"  {'baseline clip_grad_norm_ (subtracted)':<40} {1.0:>10.1f} {-clip_us:>9.0f} {-clip_us / (base_cpu * 1e4):>8.3f}%"
    )
    net = total_us + dispatch_us - clip_us
    print(f"  {'net, explained':<40} {'':>10} {net:>9.0f} {net / (base_cpu * 1e4):>8.3f}%")
    copy_us = copy_s / max(1, taken[0]) * 1e6
    print(
        f"  {'snapshot copy (background thread)':<40} {'':>10} {copy_us:>9.0f} {copy_us / (base_cpu * 1e4):>8.3f}% "
        "(its CPU time, off the training thread: on its core when pinned busy)"
    )
    print(
        f"  hooks on the model: {counts}; per step {hooked} of {calls} module calls hooked, {bwd_calls / n:.0f} "
        f"Python hooks from backward; one hooked module call costs {fwd_price * 1e6:.2f} us more, "
        f"one post-accumulate-grad hook {bwd_price * 1e6:.2f} us"
    )
    cov = ", ".join(
        f"MPU {k} coverage {f['coverage_ratio']:.0%} max gap {f['max_gap_steps']:.0f}" for k, f in figures.items()
    )
    print(f"  checks: {cov}")
    print(
        f"  the guard's own measure: overhead ratio {budget['overhead_ratio']:.2%} of {budget['step_s'] * 1e3:.0f} ms; "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(budget["cost_s"].items()))
    )


if __name__ == "__main__":
    main()
