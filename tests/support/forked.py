"""Forks one child per rank for the multi-rank job scripts (tests/support/ddp_job.py,
rank_job.py), after they imported torch once and before any thread starts."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable


def fork_ranks(ranks: int, rank_main: Callable[[int], int]) -> int:
    """Runs rank_main(rank) in a forked child per rank (an exception: its traceback, exit 1);
    waits for them all and returns the first non-zero exit code, else 0."""
    children = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = rank_main(rank)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    worst = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        worst = worst or os.waitstatus_to_exitcode(status)
    return worst
