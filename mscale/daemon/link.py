"""The link feature of the agent (filled in by its issue)."""
from __future__ import annotations

from aiohttp import web


def setup(app: web.Application) -> None:
    pass
