"""The plumbing both connection gates share (the HTTP server's, mscale.daemon.httpserver, and
the hook socket's, mscale.daemon.link_gate): an asyncio protocol in front of one aiohttp
RequestHandler (`inner`, made only once the connection is admitted) that passes every event on,
holds one deadline timer, and tells when the first request head has arrived."""

from __future__ import annotations

import asyncio
from typing import Any


class Gate(asyncio.Protocol):
    def __init__(self, make: Any) -> None:
        self.make = make
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        self._tail = b""  # the last bytes seen: a head's blank line may span two reads
        self._timer: asyncio.TimerHandle | None = None

    def _head_ends_in(self, data: bytes) -> bool:
        """Whether `data` completes the first request head (its blank line)."""
        buf = self._tail + data
        if b"\r\n\r\n" in buf or b"\n\n" in buf:
            return True
        self._tail = buf[-3:]
        return False

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
