"""systemd notification protocol (sd_notify) over NOTIFY_SOCKET, without libsystemd.

READY=1 once serving, STATUS= lines, WATCHDOG=1 at half of WATCHDOG_USEC.
Outside systemd (no NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, address: str | None = None, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = address if address is not None else env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if addr:
            # '@name' is an abstract-namespace socket.
            self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ours = not pid or pid == str(os.getpid())
        valid = usec.isascii() and usec.isdigit() and len(usec) <= 12  # "²".isdigit() is True too
        self.watchdog_interval_s = int(usec) / 2e6 if valid and ours else None
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        if self.address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.sendto("\n".join(lines).encode(), self.address)
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []), f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
