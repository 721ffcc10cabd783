#!/usr/bin/env python3
"""Per-step cost of the step agreement (mscale.hook.core.agree) and of the replica fingerprint check
(mscale.hook.checks.replicas) against the step time, on 2 and 4 gloo ranks on this machine, the tiny
model at its realistic shape under DDP.

Each rank trains TinyMultimodal (hidden 512, 2+2 layers, FFN 4x, 144 image patches + 64
caption tokens per sample, batch 8; one torch thread) wrapped in DistributedDataParallel, two
arms per batch, their order alternating:

- plain: forward, backward (DDP's gradient all-reduce), optimizer step;
- agreed: the same plus what the agreement adds to a step: the all_reduce of its numbers at
  the decision point (`Agreement.reduce`, after the backward; with it the fuse's rollback
  needs no commit collective of its own unless a rank has a fault); then the replica
  check (`ReplicaCheck.check`: fingerprint every MPU's weights, one all_reduce), run here at
  every step to measure it, in the job every `healing.replica_check_steps` (default 8).

Printed per world size, over --repeats repeats of --steps steps each (after --warmup):

- direct: the median time of the agreement's collective as measured around it, over the
  median plain step (the headline against the < 1% target); the same for one replica check,
  and per step at the default interval (the check's time / 100);
- paired: the median of (agreed - plain) over the median plain step, a cross-check that
  includes any effect on the rest of the step. Each arm starts and ends at a barrier: a
  collective placed after the optimizer step would otherwise be charged the other ranks'
  lag, which without it is paid at the next step's gradient all-reduce (a shift, not a cost).
  The paired figure is "inconclusive" when the control (plain against plain: the median
  absolute difference of consecutive plain steps) is larger than the effect, or when the
  repeats disagree on its sign, as they do when the effect is milliseconds on a step of
  seconds on a shared CPU.

The verdict is the median over repeats. Ranks are forked processes on 127.0.0.1.

    .venv/bin/python benchmarks/agreement_cost.py [--worlds 2,4] [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _verdict import Report, add_json_arg  # noqa: E402

from mscale.healing.settings import HealingSection  # noqa: E402
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal  # noqa: E402

TARGET = 0.01
DEFAULT_EVERY = HealingSection().replica_check_steps
REALISTIC = TinyConfig(
    patch=4, vision_hidden=512, text_hidden=512, heads=8, vision_layers=2, text_layers=2, vocab=1024,
    image_size=48, ffn_mult=4, seq_len=64,
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from types import SimpleNamespace

    from mscale.hook.checks.replicas import ReplicaCheck
    from mscale.hook.core.agree import Agreement
    from mscale.hook.core.mpu import discover

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyMultimodal(REALISTIC))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = SyntheticCaptions(REALISTIC, size=64, seed=rank)
    batches = [torch.utils.data.default_collate([data[(8 * i + j) % 64] for j in range(8)]) for i in range(8)]
    agreement = Agreement()
    replicas = ReplicaCheck(1)
    replicas.on_attach(SimpleNamespace(mpus=discover(model), optimizer=opt))
    n = args.warmup + args.steps
    rows: list[dict] = []
    for i in range(n):
        b = batches[i % len(batches)]
        took: dict[str, float] = {}
        for arm in ("plain", "agreed") if i % 2 == 0 else ("agreed", "plain"):
            dist.barrier()  # every arm starts with the ranks aligned and ends at a barrier (below),
            t0 = time.perf_counter()  # so the skew between ranks is charged to neither arm
            loss = model(b["images"], b["tokens"])["loss"]
            loss.backward()
            c = 0.0
            if arm == "agreed":
                c0 = time.perf_counter()
                agreement.reduce([0.0, 0.0, 0.0, 0.0, 0.0, float(loss.detach()), 1.0, 1.0, 1.0, 1.0])
                c = time.perf_counter() - c0
            opt.step()
            opt.zero_grad(set_to_none=True)
            if arm == "agreed":
                took["collectives"] = c
                c0 = time.perf_counter()
                if replicas.check(i):
                    raise SystemExit("the replicas diverged in the benchmark")
                took["replica"] = time.perf_counter() - c0
            dist.barrier()
            took[arm] = time.perf_counter() - t0
        if i >= args.warmup:
            rows.append(took)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> list[dict]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mscale-agree-") as tmp:
        out = str(Path(tmp) / "rows.json")
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    rank_main(rank, world, port, args, out)
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"a rank of the {world}-rank run failed")
        return json.loads(Path(out).read_text())


def summarise(rows: list[dict]) -> dict:
    plain = [r["plain"] for r in rows]
    step = statistics.median(plain)
    effect = statistics.median(r["agreed"] - r["plain"] for r in rows)
    control = statistics.median(abs(a - b) for a, b in zip(plain, plain[1:], strict=False))
    return {
        "step_s": step,
        "collectives_s": statistics.median(r["collectives"] for r in rows),
        "direct": statistics.median(r["collectives"] for r in rows) / step,
        "replica_s": statistics.median(r["replica"] for r in rows),
        "replica": statistics.median(r["replica"] for r in rows) / step,
        "paired": effect / step,
        "effect_s": effect,
        "control_s": control,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2", help="world sizes to run (default 2, the quick run; 2,4 for both)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per repeat (each runs both arms)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    add_json_arg(ap)
    args = ap.parse_args()
    report = Report("agreement_cost", args.json)
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    missed = False
    print(f"agreement cost per step, tiny model realistic shape under DDP (gloo, CPU), target < {TARGET:.0%}")
    for world in (int(w) for w in args.worlds.split(",")):
        reps = [summarise(run(world, args)) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        paired = [r["paired"] for r in reps]
        # the control: plain against plain within a repeat, and the repeats against each other
        inconclusive = med["control_s"] > abs(med["effect_s"]) or min(paired) < 0 < max(paired)
        missed |= med["direct"] >= TARGET or med["replica"] / DEFAULT_EVERY >= TARGET
        print(
            f"{world} ranks: step {med['step_s'] * 1e3:.1f} ms, agreement all_reduce "
            f"{med['collectives_s'] * 1e6:.0f} us: direct ratio {med['direct'] * 100:.3f}% "
            f"({'meets' if med['direct'] < TARGET else 'MISSES'} < {TARGET:.0%}); paired "
            f"{med['paired'] * 100:+.3f}% ({med['effect_s'] * 1e3:+.2f} ms against a control of "
            f"{med['control_s'] * 1e3:.2f} ms, repeats {min(paired) * 100:+.1f}%..{max(paired) * 100:+.1f}%: "
            f"{'inconclusive' if inconclusive else 'conclusive'}); "
            f"median of {args.repeats} repeats x {args.steps} steps"
        )
        per_step = med["replica"] / DEFAULT_EVERY
        print(
            f"{world} ranks: replica check {med['replica_s'] * 1e3:.2f} ms: {med['replica'] * 100:.3f}% of a step "
            f"when run every step; {per_step * 100:.4f}% per step at every {DEFAULT_EVERY} steps, the default "
            f"({'meets' if per_step < TARGET else 'MISSES'} < {TARGET:.0%})"
        )
        report.verdict(f"{world} ranks: agreement all_reduce / step", [r["direct"] for r in reps], TARGET, at_most=True)
        report.verdict(
            f"{world} ranks: replica check per step at every {DEFAULT_EVERY}",
            [r["replica"] / DEFAULT_EVERY for r in reps],
            TARGET,
            at_most=True,
        )
        report.figure(
            f"{world} ranks: paired step time, agreement + check", [r["paired"] * 100 for r in reps], unit="%"
        )
        for i, r in enumerate(reps):
            print(
                f"    repeat {i}: agreement direct {r['direct'] * 100:.3f}%, paired {r['paired'] * 100:+.3f}% "
                f"(agreement and replica check), replica check {r['replica'] * 100:.3f}%"
            )
    report.write()
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    raise SystemExit(main())
