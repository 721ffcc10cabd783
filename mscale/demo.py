"""`mscale demo`: the main job. Until the full demo lands it runs the agent on a simulated
8-GPU node with the default fault timeline and prints where its metrics are."""
from __future__ import annotations

import argparse
from importlib import resources

HELP = "run the demo: a simulated 8-GPU node (and, once built, a faulted training run healed live)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:9400", metavar="HOST:PORT")
    p.add_argument("--out", default="mscale-demo", metavar="DIR")


def run(args: argparse.Namespace) -> int:
    from mscale.daemon import main as agent_main

    timeline = resources.files("mscale.sim") / "timelines" / "default.yaml"
    ns = argparse.Namespace(config=None, simulate=str(timeline), listen=args.listen, socket=None, log_level=None)
    print(f"mscale demo: simulated 8-GPU node; metrics at http://{args.listen}/metrics (Ctrl-C stops)")
    return agent_main.run(ns)
