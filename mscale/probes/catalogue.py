"""The line reader of the probes' CSV catalogues (the Xid table, the dcgm-exporter field names):
each data line as its cells, with where it is for the error that names it."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator


def rows(text: str, source: str, error: type[Exception]) -> Iterator[tuple[str, str, list[str]]]:
    """(where, the line, its stripped cells) for each line that is neither blank nor a comment;
    `error` raised, naming the line, for one that is not exactly one CSV row."""
    # Lines split on "\n" only, as an editor counts them (splitlines would also split on
    # \x0b, \x1c, U+2028 ... and the line numbers in messages would drift).
    for no, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {no}"
        try:
            parsed = list(csv.reader(io.StringIO(line, newline=""), strict=True))
        except csv.Error as e:
            raise error(f"{where}: not a CSV row ({e})") from None
        if len(parsed) != 1:  # a bare carriage return inside the line splits it
            raise error(f"{where}: not one CSV row (a carriage return inside the line?)")
        yield where, line, [c.strip() for c in parsed[0]]
