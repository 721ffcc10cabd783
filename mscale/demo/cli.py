"""`mscale demo`: the main job, on an embedded default.

An agent on a simulated 8-GPU node (in this process, its own thread: probes, link socket,
webhook, chaos API, healing engine, /metrics on the printed address) and the tiny multimodal
model trained on CPU with the hook library attached (guard, snapshot engine, fuse). A scripted
fault sequence, injected through the agent's chaos API as an operator would, walks through
the fuse: L1 (SDC on the vision MPU's GPU), L2 and L3 (the corruption follows the MPU to its
standby), a 25x loss spike, a NaN loss and an Xid 79 on a GPU, each healed. A progress bar and
a live line of health and fuse levels while it runs; at the end a summary table (faults
injected, detected, actions, steps lost, whether it healed and by what, final loss against a
fault-free reference run) and a plot of loss and health over the steps with the faults marked,
under ./mscale-demo/. HEALED means the action the fault's level calls for was applied and the
fault's effect ended (mscale/demo/verdict.py); the exit status is 1 when any fault is not
healed (`--no-heal` shows that: detection only).
"""

from __future__ import annotations

import argparse
import sys

from mscale.link import DEFAULT_LISTEN

HELP = "run the demo: a simulated 8-GPU node and a small multimodal model trained on CPU, faults injected and healed"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help="where the agent serves /metrics and its API (busy: a free port is used)",
    )
    p.add_argument("--out", default="mscale-demo", metavar="DIR", help="where the summary and the plot go")
    p.add_argument("--steps", type=int, default=360, help="training steps (the fault script scales with it)")
    p.add_argument("--short", action="store_true", help="a short run (120 steps) for tests and a quick look")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hold", action="store_true", help="keep the agent serving after the run until Ctrl-C")
    p.add_argument(
        "--no-heal",
        dest="heal",
        action="store_false",
        help="detect and report only (healing.enabled false): the faults stay unhealed and the exit status is 1",
    )
    p.add_argument(
        "--checksum-failures-l1",
        type=int,
        default=3,
        metavar="N",
        help="consecutive checksum failures that trigger L1 (healing.checksum_failures_l1); a large N "
        "leaves corrupted MPUs marked suspect, which the summary does not count as healed",
    )
    p.add_argument("--nodes", type=int, default=1, help="several nodes on this machine, one agent each (1..4)")
    p.add_argument("--ranks", type=int, default=1, help="ranks per node, one DDP job across the nodes (1..4)")


def run(args: argparse.Namespace) -> int:
    if (args.nodes, args.ranks) != (1, 1):  # mscale.demo.nodes: agents per node, a job across them
        if not (1 <= args.nodes <= 4 and 1 <= args.ranks <= 4 and args.nodes * args.ranks >= 2):
            print("mscale demo: --nodes and --ranks must be 1..4, with at least 2 ranks in all", file=sys.stderr)
            return 2
        from mscale.demo.nodes import main as nodes_main

        return nodes_main(nodes=args.nodes, ranks=args.ranks, out=args.out)
    from mscale.demo.run import main

    steps = 120 if args.short else args.steps
    if steps < 100:
        print("mscale demo: --steps must be at least 100 (the fault script needs room)", file=sys.stderr)
        return 2
    if not 1 <= args.checksum_failures_l1 <= 1000:
        print("mscale demo: --checksum-failures-l1 must be between 1 and 1000", file=sys.stderr)
        return 2
    return main(
        steps=steps,
        out=args.out,
        listen=args.listen,
        seed=args.seed,
        hold=args.hold,
        heal=args.heal,
        checksum_failures_l1=args.checksum_failures_l1,
    )
