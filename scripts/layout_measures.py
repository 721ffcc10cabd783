"""The layout measures of issue 24's closing note, taken with the rules tests/test_layout.py
holds the package to (the same import graph: lazy imports, TYPE_CHECKING and string-named
modules counted for cycles; the same size limits and their named exceptions).

    .venv/bin/python scripts/layout_measures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import test_layout as layout  # noqa: E402  (the rules' own graph, not a copy)


def main() -> None:
    files = layout.measured_files()
    cycles = layout.cycles_between_rooms()
    print(f"import cycles between rooms (TYPE_CHECKING and string imports counted): {len(cycles)}")
    reached: set[str] = set()
    for p in files:
        module = layout._module_name(p)
        if layout._room(module) == "healing":
            reached |= set(layout._closure(module))
    job = sorted(m for m in reached if layout._room(m) in layout.JOB_SIDE and m.startswith("mscale."))
    torch = sorted(m for m in reached if m in layout.TORCH)
    print(f"healing/ reaches job-side modules: {len(job)} {job}; torch and its frameworks: {len(torch)} {torch}")
    outside = sorted({m.split(".")[0] for m in reached if not m.startswith("mscale")})
    print(f"healing/ reaches outside the package: {', '.join(outside)}")
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(REPO))) for p in files), reverse=True)
    over = [(n, f) for n, f in sizes if n > layout.MAX_FILE_LINES]
    print(f"largest file: {sizes[0][1]} ({sizes[0][0]} lines); over {layout.MAX_FILE_LINES} lines: {len(over)}")
    for n, f in over:
        print(f"  {n:4d}  {f}  ({layout.LONG_FILES.get(str(Path(f).relative_to('mscale')), 'NOT NAMED')})")
    bases = layout.cross_file_bases()
    print(f"classes with a base from another file of the package (not a Protocol, ABC, exception, Enum): {len(bases)}")
    for cls, theirs in sorted(bases.items()):
        print(f"  mscale/{cls}({', '.join(theirs)})  ({layout.CROSS_FILE_BASES.get(cls, 'NOT NAMED')})")
    anys = layout.any_names()
    rooms = ", ".join(f"{room}/ {anys.get(room, 0)}" for room in ("hook", "snapshot", "healing", "daemon", "link"))
    print(
        "Any (names used, each use of an alias that holds it counted as its value, imports not counted): "
        f"{sum(anys.values())} in the package; {rooms}"
    )
    long = layout.long_functions()
    print(f"functions over {layout.MAX_FUNCTION_LINES} lines: {len(long)}")
    for where, n in sorted(long.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:4d}  mscale/{where}  ({layout.LONG_FUNCTIONS.get(where, 'NOT NAMED')})")


if __name__ == "__main__":
    main()
