"""Reading the project's data files (config, timelines, policy, Xid table) with one error shape.

`read_text` is the one reader of the files the agent reads at start-up: a regular file, at
most `MAX_BYTES`, UTF-8. Anything else raises the caller's error type naming the file (and,
for bytes that are not UTF-8, the line of the first bad one), never an OSError or a
UnicodeDecodeError, and never a hang (a FIFO or /dev/zero in place of the file is refused).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_BYTES = 16 << 20  # a config or catalogue is kilobytes; this bounds a mistake, not a use


def decode(data: bytes, source: str, error: type[Exception]) -> str:
    """`data` as UTF-8 text; other bytes raise `error` naming the line and column of the first."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(f"{source} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column})") from None


def read_text(path: str | os.PathLike, error: type[Exception], what: str) -> str:
    """The file's text; an unreadable file raises `error` naming the path, what it is and why."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror}") from None
    except ValueError:  # an embedded NUL byte in the path
        raise error(f"{p!r}: cannot read {what}: the path contains a NUL byte") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise error(f"{p}: cannot read {what}: {kind}")
        if st.st_size > MAX_BYTES:
            raise error(f"{p}: cannot read {what}: {st.st_size} bytes (at most {MAX_BYTES})")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise error(f"{p}: cannot read {what}: more than {MAX_BYTES} bytes")
    return decode(data, str(p), error)


def write_files(directory: str | os.PathLike, files: dict[str, str]) -> list[Path]:
    """Write each named text into `directory` (created if missing); returns the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written
