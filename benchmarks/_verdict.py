"""Verdicts that hold on a noisy machine, and the one JSON file of every figure.

Every benchmark measures each contender in rounds, back to back, and takes the ratio per
round; a verdict is on the median of those ratios, printed with their range. When the
benchmark's own control (the same measurement twice, or the baseline against itself: a
ratio whose truth is 1.00) strays from 1 by more than the effect's distance from its target,
the machine was too noisy to tell: the verdict is "inconclusive", not a guess.

    rep = Report("snapshot", args.json)
    rep.figure("torch.save", seconds_per_round, unit="s")
    rep.verdict("stall: torch.save / ours", ratios, target=20, control=save_a_over_save_b)
    rep.write()   # merged into the JSON file under "snapshot", other benchmarks' entries kept

The noise is the larger of the control's median distance from 1.00 and the ratios' own
median absolute deviation (relative to their median; absolute for an added fraction).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "latest.json"


def add_json_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"where the figures go (merged; default {DEFAULT_JSON})"
    )


def add_warmup_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--warmup",
        type=int,
        default=12,
        help="untimed steps per arm at each repeat's start (default 12: past the guard's cold start, CMSA's 10 "
        "steps of GVC every step, a one-off in a run of thousands)",
    )


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def mad(xs: list[float], around: float) -> float:
    return statistics.median(abs(x - around) for x in xs)


def noise_of(xs: list[float], control: list[float] | None = None) -> float:
    """Relative noise: the larger of the control's median distance from its truth, 1.00, and
    the samples' own median absolute deviation against their median. Medians both: one
    reading disturbed by a neighbour neither decides a verdict nor voids it."""
    m = statistics.median(xs)
    own = mad(xs, m) / abs(m) if m else float("inf")
    return max(own, mad(control, 1.0)) if control else own


def judge(xs: list[float], target: float, *, higher: bool = True, control: list[float] | None = None) -> str:
    """ "met", "MISSED" or "inconclusive": the median against the target, decisive only when
    its relative distance from the target exceeds the noise."""
    m = statistics.median(xs)
    margin = (m / target - 1.0) if higher else (target / m - 1.0 if m > 0 else float("inf"))
    if abs(margin) <= noise_of(xs, control):
        return "inconclusive"
    return "met" if margin > 0 else "MISSED"


def judge_at_most(xs: list[float], limit: float, *, control: list[float] | None = None) -> str:
    """For an added cost (a fraction, e.g. 0.01 for 1%): met when the median stays below the
    limit by more than the control's noise (an absolute fraction), MISSED when above by more."""
    m = statistics.median(xs)
    noise = max(mad(xs, m), mad(control, 1.0) if control else 0.0)
    if abs(m - limit) <= noise:
        return "inconclusive"
    return "met" if m < limit else "MISSED"


def paired(
    steps: list[float],
    base: list[float],
    rare: list[float] | None = None,
    charged: list[float] | None = None,
    base_rare: list[float] | None = None,
) -> float:
    """A contender's cost over a baseline's, round by round: `steps[i]` and `base[i]` ran in the
    same round of interleaved arms (back to back), so the median over the rounds of their ratio,
    each step's rare work (`rare`, `base_rare`: its seconds, timed where it ran) taken out, plus
    what that rare work costs a step over a run (`charged`, default `rare`) against the
    baseline's median step: a median alone would leave out work done one step in ten or a
    hundred (a snapshot, a replay).

    Why rounds, not a ratio of medians: a slowdown of the machine longer than a round (a
    neighbour's job, the VM's host) scales both steps of the rounds it covers alike and cancels
    in their ratio; one that starts or ends inside a round moves that round's ratio alone, which
    the median sets aside. A ratio of two medians lets a burst that covers more steps of one arm
    than of the other (it began between them) move it by the burst's whole size."""
    if len(steps) != len(base) or not steps:
        raise ValueError(f"paired: expected two equal, non-empty series of rounds, got {len(steps)} and {len(base)}")
    zeros = [0.0] * len(steps)
    own, theirs = rare or zeros, base_rare or zeros
    ratios = [(s - r) / (b - q) for s, r, b, q in zip(steps, own, base, theirs, strict=True)]
    extra = charged if charged is not None else own
    return statistics.median(ratios) + (sum(extra) / len(extra)) / statistics.median(
        b - q for b, q in zip(base, theirs, strict=True)
    )


def fmt(xs: list[float], unit: str = "x", digits: int = 2) -> str:
    s = stats(xs)
    return f"{s['median']:.{digits}f}{unit} (range {s['min']:.{digits}f}-{s['max']:.{digits}f}, n={s['n']})"


class Report:
    """The figures and verdicts of one benchmark run, printed as they come and written to the
    shared JSON file under the benchmark's name."""

    def __init__(self, name: str, path: Path | None) -> None:
        self.name, self.path = name, path
        self.data: dict[str, Any] = {"figures": {}, "verdicts": {}, "when": time.time()}

    def figure(self, label: str, xs: list[float], *, unit: str = "s", show: bool = True, digits: int = 3) -> None:
        self.data["figures"][label] = {**stats(xs), "unit": unit, "samples": xs}
        if show:
            print(f"  {label:<52} {fmt(xs, ' ' + unit if unit != 'x' else 'x', digits)}")

    def verdict(
        self,
        label: str,
        xs: list[float],
        target: float,
        *,
        higher: bool = True,
        control: list[float] | None = None,
        at_most: bool = False,
        unit: str = "x",
        digits: int = 2,
    ) -> str:
        """Records and prints a verdict. at_most: xs is an added fraction that must stay <= target."""
        if at_most:
            v = judge_at_most(xs, target, control=control)
            goal = f"<= {target:+.1%}"
        else:
            v = judge(xs, target, higher=higher, control=control)
            goal = f"{'>=' if higher else '<='} {target:g}"
        m = statistics.median(xs)
        noise = max(mad(xs, m), mad(control, 1.0) if control else 0.0) if at_most else noise_of(xs, control)
        self.data["verdicts"][label] = {
            **stats(xs),
            "samples": xs,
            "unit": unit,
            "target": goal,
            "verdict": v,
            "noise": noise,
            "control": {**stats(control), "samples": control} if control else None,
        }
        ctl = f"; control {fmt(control, '', 3)}" if control else ""
        shown = fmt([x * 100 for x in xs], "%", 2) if at_most else fmt(xs, unit, digits)
        print(f"  {label:<52} {shown}  target {goal}: {v}{ctl}")
        return v

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            everything = json.loads(self.path.read_text())
        except (OSError, ValueError):
            everything = {}
        everything.setdefault("machine", {"cpus": os.cpu_count(), "python": platform.python_version()})
        everything.setdefault("benchmarks", {})[self.name] = self.data
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(everything, indent=1) + "\n")
        os.replace(tmp, self.path)
        print(f"  figures written to {self.path} ({self.name})")
