"""Idle connections to a Unix socket, as a given user: opens COUNT connections that send
nothing (`silent`), half an HTTP request head (`half_head`), then waits at most SECONDS for the
agent to close them, and prints {"opened": N, "closed": M} as one JSON line. Bounded in count
and time.

    python idle_connections.py UID SOCKET COUNT SECONDS MODE    (started as root, drops to UID)
"""

from __future__ import annotations

import json
import os
import pwd
import selectors
import socket
import sys
import time


def become(uid: int) -> None:
    """Drop to the other user for good, unless it is this one."""
    if uid != os.getuid():
        os.setgroups([])
        os.setgid(pwd.getpwuid(uid).pw_gid)
        os.setuid(uid)


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except BlockingIOError:
        return False


def main(path: str, count: int, seconds: float, mode: str) -> None:
    socks = []
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            continue
        if mode == "half_head":
            s.sendall(b"GET /v1/link HTTP/1.1\r\nHost: localhost\r\n")
        s.setblocking(False)
        socks.append(s)
    opened, done = len(socks), 0
    deadline = time.monotonic() + seconds
    sel = selectors.DefaultSelector()  # epoll: select() takes no descriptor past 1,023
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    while done < opened and time.monotonic() < deadline:
        for key, _ in sel.select(max(0.0, min(1.0, deadline - time.monotonic()))):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if closed(s):
                sel.unregister(s)
                s.close()
                done += 1
    sel.close()
    print(json.dumps({"opened": opened, "closed": done}), flush=True)


if __name__ == "__main__":
    become(int(sys.argv.pop(1)))
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
