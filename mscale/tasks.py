"""The agent's background tasks, ended in one way: cancelled, awaited, forgotten.

A leaf beside the rooms: it imports nothing of the package, so the agent's rooms (daemon, kube)
share it without importing one another.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel every task, wait until each has ended (what it raised, its cancellation included,
    is dropped: a stopping service has no one to tell), and empty the list."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    tasks.clear()
