"""`mscale chaos` (filled in by its issue)."""
from __future__ import annotations

import argparse
import sys

HELP = "chaos (not built yet)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    print("mscale chaos: not built yet", file=sys.stderr)
    return 1
