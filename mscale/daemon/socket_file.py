"""The hook socket's file: created with its mode, in a directory nobody else can change.

A root agent that binds `agent.socket_path` and then chmods the path can be made to chmod
whatever a user who can write the directory swaps in between (a symlink to a root-owned
file). So the socket is created with its mode set on the socket itself before `bind` (Linux
gives the new node the socket inode's mode, less the umask): it is never reachable with a
wider mode, and no path is followed. Where the umask took bits away, the mode is completed
through an `O_PATH | O_NOFOLLOW` descriptor of the node, checked to be a socket we own.

And a socket directory that another user can write, or that another user owns (or any of
whose ancestors they own or can write without the sticky bit), is refused at start-up: such
a user could swap the socket for their own and the jobs would talk to them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path


class UnsafeSocketDir(OSError):
    """The socket's directory (or an ancestor) can be changed by another user."""


def check_directory(directory: Path, *, uid: int | None = None) -> None:
    """Refuse a socket directory another user could change: owned by other than root or `uid`
    (the agent's), group- or world-writable; an ancestor likewise, unless sticky (e.g. /tmp)."""
    uid = os.geteuid() if uid is None else uid
    trusted = {0, uid}
    here = Path(os.path.abspath(directory))
    first = True
    while True:
        st = os.stat(here)  # the directory itself, or what a link names: the check is on that
        who = "the socket directory" if first else "an ancestor of the socket directory"
        if st.st_uid not in trusted:
            raise UnsafeSocketDir(
                f"{who} {here} is owned by uid {st.st_uid}, not root or the agent's uid {uid}: "
                "its owner could replace the socket (choose a directory root or the agent owns)"
            )
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable and (first or not st.st_mode & stat.S_ISVTX):
            raise UnsafeSocketDir(
                f"{who} {here} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {stat.S_IMODE(st.st_mode):04o}): another user could replace the socket "
                "(choose a directory only root or the agent can write)"
            )
        if here.parent == here:
            return
        here, first = here.parent, False


def bind(path: str, mode: int) -> socket.socket:
    """A listening Unix socket at `path` (which must not exist) with file mode `mode`, set
    before the socket is reachable; no path is followed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), mode)  # the node bind creates takes this mode, less the umask
        sock.bind(path)
        _complete_mode(path, mode)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _complete_mode(path: str, mode: int) -> None:
    """Add back the bits the umask took, through a descriptor of the node itself."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"{path} changed under the agent while it was created (not its socket)")
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(f"/proc/self/fd/{fd}", mode)  # the node the descriptor holds, not a path
    finally:
        os.close(fd)


async def in_use(path: str) -> bool:
    """Whether a listener answers at the socket `path` (another agent), within 1 s."""
    try:
        async with asyncio.timeout(1.0):
            _r, w = await asyncio.open_unix_connection(path)
    except (TimeoutError, OSError):
        return False
    w.close()
    return True
