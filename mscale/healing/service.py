"""Runs the healing engine inside the agent (filled in by the healing issue)."""
from __future__ import annotations

from aiohttp import web


def setup(app: web.Application) -> None:
    pass
