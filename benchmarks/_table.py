"""The benchmark table of docs/benchmarks.md, generated from a `make benchmarks` JSON file.

    .venv/bin/python benchmarks/_table.py benchmarks/results/latest.json            # print it
    .venv/bin/python benchmarks/_table.py benchmarks/results/readme.json --readme docs/benchmarks.md

One row per verdict (median, range over the repeats, target, verdict) and, for a benchmark
without verdicts, one per figure. With --readme, the table between the page's
`<!-- benchmarks:start -->` and `<!-- benchmarks:end -->` lines is replaced, and the JSON it
came from should be committed beside it as benchmarks/results/readme.json (a test checks the
two agree).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
ORDER = (
    "snapshot",
    "hook_overhead",
    "attach_overhead",
    "agreement_cost",
    "ebpf_overhead",
    "agent_overhead",
    "webhook_cost",
    "heal_latency",
)


def _num(x: float, unit: str) -> str:
    if unit == "x":
        return f"{x:.2f}x" if abs(x) < 100 else f"{x:.0f}x"
    if unit in ("%",):
        return f"{x:.2f}%"
    return f"{x:.3g} {unit.strip()}"


def _cell(entry: dict, *, fraction: bool = False) -> str:
    scale, unit = (100.0, "%") if fraction else (1.0, entry.get("unit", ""))
    med, lo, hi = (entry[k] * scale for k in ("median", "min", "max"))
    if entry["n"] == 1:
        return _num(med, unit)
    return f"{_num(med, unit)} ({_num(lo, unit)} to {_num(hi, unit)}, n={entry['n']})"


def render(results: dict) -> str:
    """The markdown table of `results` (the JSON file's content)."""
    lines = ["| benchmark | figure | median (range, repeats) | target | verdict |", "|---|---|---|---|---|"]
    benches = results.get("benchmarks", {})
    for name in sorted(benches, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        bench = benches[name]
        for label, v in bench.get("verdicts", {}).items():
            fraction = v["target"].startswith("<= ") and v["target"].endswith("%")
            lines.append(f"| `{name}.py` | {label} | {_cell(v, fraction=fraction)} | {v['target']} | {v['verdict']} |")
        if not bench.get("verdicts"):
            for label, f in bench.get("figures", {}).items():
                lines.append(f"| `{name}.py` | {label} | {_cell(f)} | reported | |")
    return "\n".join(lines) + "\n"


def replace_in(readme: str, table: str) -> str:
    start, end = readme.index(START) + len(START), readme.index(END)
    return readme[:start] + "\n" + table + readme[end:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--readme", type=Path, help="rewrite the table in this page (docs/benchmarks.md)")
    args = ap.parse_args()
    table = render(json.loads(args.json.read_text()))
    if args.readme is None:
        print(table, end="")
        return 0
    args.readme.write_text(replace_in(args.readme.read_text(), table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
