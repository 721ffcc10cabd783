"""What the localization on an event costs (mscale.hook.checks.locate), on
benchmarks/attach_overhead.py's 8.1M LLaVA at its realistic shape (batch 8, one torch thread,
the README's line): the CPU time of the training thread for a step and its forward, and for
each piece an event pays: the graph walk that traces a non-finite text output (a NaN put at one
`up_proj` output by this script's own forward hook), a profiled re-run of the vision and of the
text MPU (an output shift), the scan of the weights and AdamW's state (a non-finite loss).
Medians of 3 (the step: of 10, after 4 warm-up steps).

    python benchmarks/locate_cost.py
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import mscale  # noqa: E402
from benchmarks.attach_overhead import Captions, llava  # noqa: E402
from mscale.hook.checks.locate import call_order, graph_blame, nonfinite_state, owners  # noqa: E402


def cpu(f: Callable[[], Any], n: int = 3) -> tuple[float, Any]:
    """The median CPU time of `n` calls of `f`, and its last result."""
    times, out = [], None
    for _ in range(n):
        c = time.thread_time()
        out = f()
        times.append(time.thread_time() - c)
    return statistics.median(times), out


def main() -> int:
    torch.set_num_threads(1)
    model = llava(256, 4, 96)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = mscale.ResumableLoader(Captions(96, 64), batch_size=8, seed=0)
    guard = mscale.attach(model, opt, job_id="locate-cost", snapshots=True, data=loader, connect=False)
    batches = iter(loader)
    steps, forwards = [], []
    for i in range(14):
        c = time.thread_time()
        out = model(**next(batches))
        f = time.thread_time() - c
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 4:
            steps.append(time.thread_time() - c)
            forwards.append(f)
    step = statistics.median(steps)
    print(f"step {step * 1e3:.0f} ms CPU (its forward {statistics.median(forwards) * 1e3:.0f} ms)")
    loc, text, vision = guard.checksum.locate, guard.mpu("text"), guard.mpu("vision")
    seen: list[torch.Tensor] = []
    keep = text.module.register_forward_hook(lambda m, a, o: seen.append(o.last_hidden_state))
    state = {"on": True}

    def nan(module: torch.nn.Module, args: object, o: torch.Tensor) -> torch.Tensor | None:
        if not state["on"]:
            return None
        state["on"] = False
        bad = o.detach().clone()
        bad.view(-1)[5] = math.nan
        return o + (bad - o.detach())

    fault = text.module.layers[2].mlp.up_proj.register_forward_hook(nan, prepend=True)
    guard.checksum.replaying = True  # the guard leaves this forward alone: only its graph is wanted
    model(**next(batches))
    guard.checksum.replaying = False
    keep.remove()
    fault.remove()
    params, order = owners(text.module, text.path), call_order(loc._baseline(text))
    t, name = cpu(lambda: graph_blame(seen[-1:], params, order))
    print(f"graph walk, a NaN at a text up_proj: {t * 1e3:.0f} ms ({t / step:.2f} of a step), names {name}")
    seen.clear()
    for mpu in (vision, text):
        t, _ = cpu(functools.partial(loc.shifted, mpu))
        print(f"profiled re-run of the {mpu.name} MPU: {t * 1e3:.0f} ms ({t / step:.2f} of a step)")
    t, _ = cpu(lambda: nonfinite_state(model, opt))
    n = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"scan of the weights and optimizer state: {t * 1e3:.0f} ms ({t / step:.2f} of a step; {n:.1f}M params)")
    guard.detach()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
