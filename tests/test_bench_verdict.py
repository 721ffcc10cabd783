"""The benchmarks' shared verdict logic (benchmarks/_verdict.py) and the benchmark table of
docs/benchmarks.md, which must be what benchmarks/_table.py makes of the committed results JSON."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _table import END, START, render  # noqa: E402
from _verdict import Report, judge, judge_at_most, paired  # noqa: E402


def test_a_ratio_is_judged_on_its_median_and_only_beyond_the_controls_noise():
    assert judge([30.0, 25.0, 400.0], 20.0) == "met"  # one wild reading does not decide
    assert judge([10.0, 12.0, 11.0], 20.0) == "MISSED"
    quiet, noisy = [1.0, 1.01, 0.99], [0.7, 1.0, 1.4]
    assert judge([1.05, 1.06, 1.04], 1.0, control=quiet) == "met"
    assert judge([1.05, 1.06, 1.04], 1.0, control=noisy) == "inconclusive"
    assert judge([0.5, 0.6, 0.55], 1.0, control=quiet) == "MISSED"
    assert judge([0.9, 0.95, 0.92], 1.0, higher=False, control=quiet) == "met"  # lower is better


def test_an_added_cost_is_met_missed_or_inconclusive_against_the_control():
    quiet = [1.002, 0.998, 1.001]
    assert judge_at_most([0.002, 0.004, 0.003], 0.01, control=quiet) == "met"
    assert judge_at_most([0.03, 0.025, 0.028], 0.01, control=quiet) == "MISSED"
    assert judge_at_most([0.002, 0.004, 0.003], 0.01, control=[0.95, 1.0, 1.05]) == "inconclusive"
    # a quiet-looking control does not rescue samples that scatter more than the margin
    assert judge_at_most([-0.17, -0.07, 0.09], 0.01, control=[0.93, 0.88, 1.07]) == "inconclusive"


def test_a_paired_cost_cancels_a_slowdown_that_began_between_the_arms_steps():
    """Ten rounds, the machine twice as slow from the middle of round 4 on: the arm (1% dearer)
    ran after the baseline in each round, so its slow steps are rounds 4-9, the baseline's 5-9.
    A ratio of medians reads +35%; round by round it is the 1% it is."""
    slow = [1.0] * 4 + [2.0] * 6
    base = [1.0] * 5 + [2.0] * 5
    arm = [1.01 * f for f in slow]
    assert statistics.median(arm) / statistics.median(base) > 1.34  # what a ratio of medians says
    assert abs(paired(arm, base) - 1.01) < 1e-12
    # rare work: taken out of each step, charged at its mean against the baseline's median step
    rare = [0.0] * 9 + [0.5]
    got = paired([a + r for a, r in zip(arm, rare, strict=True)], base, rare, [0.05] * 10)
    assert abs(got - (1.01 + 0.05 / 1.5)) < 1e-12
    with pytest.raises(ValueError, match="equal"):
        paired([1.0, 2.0], [1.0])


def test_a_report_merges_into_one_json_file_per_run(tmp_path, capsys):
    path = tmp_path / "results.json"
    a = Report("alpha", path)
    a.figure("seconds", [1.0, 3.0, 2.0])
    a.verdict("speed-up", [21.0, 25.0, 30.0], 20.0, control=[1.0, 1.01, 0.99])
    a.write()
    b = Report("beta", path)
    b.figure("other", [5.0])
    b.write()
    out = json.loads(path.read_text())["benchmarks"]
    assert out["alpha"]["figures"]["seconds"]["median"] == 2.0
    assert out["alpha"]["verdicts"]["speed-up"]["verdict"] == "met"
    assert out["beta"]["figures"]["other"]["n"] == 1
    printed = capsys.readouterr().out
    assert "25.00x (range 21.00-30.00, n=3)" in printed and "target >= 20: met" in printed


def test_the_benchmark_table_is_generated_from_the_committed_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "readme.json").read_text())
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    table = page[page.index(START) + len(START) : page.index(END)]
    assert table == "\n" + render(results), (
        "docs/benchmarks.md's benchmark table differs: .venv/bin/python benchmarks/_table.py "
        "benchmarks/results/readme.json --readme docs/benchmarks.md"
    )
    assert all(v["n"] >= 3 for b in results["benchmarks"].values() for v in b["verdicts"].values())
