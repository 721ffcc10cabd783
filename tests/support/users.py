"""A real second local user for the attacks that need one (another uid on the socket, in a
shared directory): created with useradd when absent, so CI (root) always has it."""

from __future__ import annotations

import os
import pwd
import subprocess

from support import require

NAME = "mscale-other"


def second_uid() -> tuple[int, int]:
    """(uid, gid) of a local user other than root and the caller; needs root."""
    require(os.getuid() == 0, "needs root to act as a second local user")
    try:
        pw = pwd.getpwnam(NAME)
    except KeyError:
        # (two test workers may both find it absent: the second useradd fails, the user exists)
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
            capture_output=True,
            text=True,
            timeout=30,
        )
        try:
            pw = pwd.getpwnam(NAME)
        except KeyError:
            raise AssertionError(f"useradd {NAME} failed: {made.stderr.strip()}") from None
    return pw.pw_uid, pw.pw_gid
