"""The layout measures of issue 24's closing note, taken with the rules tests/test_layout.py
holds the package to (the same import graph: lazy imports, TYPE_CHECKING and string-named
modules counted for cycles).

    .venv/bin/python scripts/layout_measures.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import test_layout as layout  # noqa: E402  (the rules' own graph, not a copy)

GENERATED = ("kube/podresources_pb2.py",)
LONG = 60


def main() -> None:
    files = [p for p in layout._files() if str(p.relative_to(layout.PKG)) not in GENERATED]
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
    print(f"largest file: {sizes[0][1]} ({sizes[0][0]} lines); over 500 lines: {sum(n > 500 for n, _ in sizes)}")
    long = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > LONG:
                    long.append((n, f"{p.relative_to(REPO)}:{node.lineno} {node.name}"))
    print(f"functions over {LONG} lines: {len(long)}")
    for n, where in sorted(long, reverse=True):
        print(f"  {n:4d}  {where}")


if __name__ == "__main__":
    main()
