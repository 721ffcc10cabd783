"""Reading the project's data files (config, timelines, policy, Xid table) with one error shape."""
from __future__ import annotations

import os
from pathlib import Path


def read_text(path: str | os.PathLike, error: type[Exception], what: str) -> str:
    """The file's text; an unreadable file raises `error` naming the path, what it is and why."""
    p = Path(path)
    try:
        return p.read_text()
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror}") from None
