"""Contract validation on the real /sys and /proc of this machine: p99 against the 15 ms target.

One validation is what `mscale.contract(...)` does before the first step: read the host
(CPUs and SMT siblings, isolcpus, NUMA nodes, hugepages, PCI GPUs, NVMe, RDMA) and check a
contract naming a loader thread, a hugepage pool and the main thread's neighbour cores
against it. The baseline, measured in the same run, is the bare cost of touching the same
tree: an os.listdir of every directory the view reads and one read of every file it opens,
with no parsing or checking (what any reader of these paths pays).

Each repeat times --n validations and --n baseline walks interleaved (so drift hits both);
the headline is the median over --repeats of each repeat's p99, and the ratio of the two
medians. Verdict "meets" when the median p99 is under the target, "misses" when over it by
more than the repeats' spread, "inconclusive" otherwise.

    .venv/bin/python benchmarks/contract_validate.py [--n 200] [--repeats 5] [--target-ms 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verdict import Report, add_json_arg  # noqa: E402

from mscale.contracts.hardware import read_host  # noqa: E402
from mscale.contracts.spec import ContractRefused, parse  # noqa: E402
from mscale.contracts.validate import validate  # noqa: E402


class Recorder:
    """Which paths a view reads: recorded once through the builtins the reader uses."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []
        self.files: list[Path] = []

    def __enter__(self) -> Recorder:
        import builtins

        self._open, self._listdir = builtins.open, os.listdir
        rec = self

        def open_(file, *a, **k):
            rec.files.append(Path(file))
            return rec._open(file, *a, **k)

        def listdir(path="."):
            rec.dirs.append(Path(path))
            return rec._listdir(path)

        builtins.open, os.listdir = open_, listdir
        return self

    def __exit__(self, *exc) -> None:
        import builtins

        builtins.open, os.listdir = self._open, self._listdir


def baseline(dirs: list[Path], files: list[Path]) -> None:
    for d in dirs:
        try:
            os.listdir(d)
        except OSError:
            pass
    for f in files:
        try:
            with open(f, "rb") as fh:
                fh.read(65536)
        except OSError:
            pass


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=15.0)
    add_json_arg(ap)
    args = ap.parse_args()
    rep = Report("contract_validate", args.json)
    cpus = sorted(os.sched_getaffinity(0))
    contract = parse(
        "balanced",
        {"image_loader": {"cpu_cores": [cpus[-1]], "numa_node": 0}, "main": {"cpu_cores": cpus[:1]}},
        {"recovery_point": "latest"},
    )

    def once() -> None:
        try:
            validate(contract, read_host("/sys", "/proc"), allowed_cpus=os.sched_getaffinity(0))
        except ContractRefused:  # a host that refuses still pays the whole check
            pass

    with Recorder() as rec:
        once()
    print(f"the view reads {len(rec.dirs)} directories and {len(rec.files)} files")
    v99, b99, v50, b50 = [], [], [], []
    for r in range(args.repeats):
        vt, bt = [], []
        for _ in range(args.n):
            t0 = time.perf_counter()
            once()
            t1 = time.perf_counter()
            baseline(rec.dirs, rec.files)
            t2 = time.perf_counter()
            vt.append(t1 - t0)
            bt.append(t2 - t1)
        v99.append(p99(vt) * 1e3)
        b99.append(p99(bt) * 1e3)
        v50.append(statistics.median(vt) * 1e3)
        b50.append(statistics.median(bt) * 1e3)
        print(
            f"repeat {r + 1}: validation p99 {v99[-1]:.3f} ms (median {v50[-1]:.3f}), "
            f"baseline walk p99 {b99[-1]:.3f} ms (median {b50[-1]:.3f})"
        )
    med_v, med_b = statistics.median(v99), statistics.median(b99)
    spread = (max(v99) - min(v99)) / 2
    verdict = "meets" if med_v < args.target_ms else "misses" if med_v - args.target_ms > spread else "inconclusive"
    print(
        f"validation p99 {med_v:.3f} ms (median of {args.repeats} repeats of {args.n}; target {args.target_ms:g} ms): "
        f"{verdict}; baseline walk p99 {med_b:.3f} ms; ratio {med_v / med_b:.2f}x the bare walk "
        f"(medians: {statistics.median(v50):.3f} ms vs {statistics.median(b50):.3f} ms, "
        f"{statistics.median(v50) / statistics.median(b50):.2f}x)"
    )
    rep.figure("baseline walk p99, ms", b99, unit="ms")
    rep.verdict("validation p99, ms", v99, args.target_ms, higher=False, unit=" ms")
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
