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


def write_files(directory: str | os.PathLike, files: dict[str, str]) -> list[Path]:
    """Write each named text into `directory` (created if missing); returns the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written
