"""The socket race, as another user who can write the socket's directory: whenever the
agent's socket appears, move it aside and put a symlink to TARGET in its place, so an agent
that chmods the path after bind chmods TARGET. Bounded in swaps and in time.

    python socket_swapper.py UID SOCKET TARGET SECONDS MAX_SWAPS    (started as root, drops to UID)
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
import time


def become(uid: int) -> None:
    """Drop to the other user for good (the test starts this as root)."""
    os.setgroups([])
    os.setgid(pwd.getpwuid(uid).pw_gid)
    os.setuid(uid)


def main(path: str, target: str, seconds: float, max_swaps: int) -> None:
    deadline, swaps = time.monotonic() + seconds, 0
    print("ready", flush=True)
    while time.monotonic() < deadline and swaps < max_swaps:
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.rename(path, f"{path}.{swaps}")
                os.symlink(target, path)
                swaps += 1
        except OSError:
            pass
        os.sched_yield()
    print(f"swaps {swaps}", flush=True)


if __name__ == "__main__":
    become(int(sys.argv.pop(1)))  # after the imports: the interpreter's files are root's
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
