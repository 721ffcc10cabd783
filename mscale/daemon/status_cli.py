"""`mscale status` (filled in by its issue)."""
from __future__ import annotations

import argparse
import sys

HELP = "status (not built yet)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    print("mscale status: not built yet", file=sys.stderr)
    return 1
