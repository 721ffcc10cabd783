"""`mscale demo --short` end to end, as `make demo` runs it: agent, faulted and reference runs,
every scripted fault detected and healed, summary and PNG written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import REPO


@pytest.mark.slow  # the whole demo: about 10 s
def test_demo_runs_end_to_end_and_writes_its_summary_and_plot(tmp_path):
    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "mscale", "demo", "--short", "--out", str(out), "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "metrics at http://127.0.0.1:" in res.stdout and "Summary" in res.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 120 and s["healed_all"] and not s["nan_reached_weights"]
    assert [f["detected"] != "no" for f in s["faults"]] == [True] * 5
    acts = {a.split("(")[0].split(":")[0].split(" ")[0] for f in s["faults"] for a in f["actions"]}
    assert {
        "l1_swap",
        "l2_degrade",
        "l3_distill",
        "recover",
        "lr_cool",
        "rollback",
        "emergency_snapshot",
        "quarantine_gpu",
    } <= acts
    assert s["loss_gap"] < 0.05 and s["steps_lost"] >= 1
    assert any("mpu_drift_count_total" in ln for ln in s["agent_metrics"])
    png = (out / "loss_health.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "HEALED" in (out / "summary.txt").read_text()
    assert "mscale_heal_actions_total" in (out / "metrics.txt").read_text()
    # what healed each fault: the actions its level calls for, and the evidence the effect ended
    by = [(f["healed_by"], f["evidence"]) for f in s["faults"]]
    assert [h.split("(")[0] for h in by[0][0]] == ["l1_swap"] and "clean checks on the new placement" in by[0][1]
    assert [h.split("(")[0] for h in by[1][0]] == ["l1_swap", "l2_degrade", "l3_distill"]
    assert by[2][0] == ["lr_cool"] and "loss back in its band" in by[2][1]
    assert by[3][0] == ["rollback"] and "loss back in its band" in by[3][1]
    assert [h.split("(")[0] for h in by[4][0]] == ["emergency_snapshot", "quarantine_gpu", "l1_swap"]


def _demo(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "mscale", "demo", "--short", "--out", str(out), "--listen", "127.0.0.1:0", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    return res, json.loads((out / "summary.json").read_text())


@pytest.mark.slow  # the whole demo: about 10 s
def test_demo_whose_fuse_only_marks_suspect_is_not_healed_and_exits_non_zero(tmp_path):
    """L1 never triggers (checksum_failures_l1 1000): the corrupted MPU is only marked suspect,
    which is detection, not healing; the two corruption faults are "no" and the exit status 1."""
    res, s = _demo(tmp_path, "--checksum-failures-l1", "1000")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    rows = s["faults"]
    assert [f["healed"] for f in rows[:2]] == [False, False] and not s["healed_all"]
    assert all(any(a.startswith("mark_suspect") for a in f["actions"]) for f in rows[:2])
    assert all(f["evidence"].startswith("not applied: l1_swap") for f in rows[:2])
    table = res.stdout[res.stdout.index("Summary") :]
    assert [ln.split()[0] for ln in table.splitlines() if " no " in ln] == ["1", "2"]


@pytest.mark.slow  # the whole demo: about 10 s
def test_demo_with_healing_off_heals_nothing_and_exits_non_zero(tmp_path):
    res, s = _demo(tmp_path, "--no-heal")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert [f["healed"] for f in s["faults"]] == [False] * 5
    assert [f["detected"] != "no" for f in s["faults"]] == [True] * 5  # detection goes on
    assert "faults healed: 0 of 5" in res.stdout


def _action(step: int, action: str, result: str = "applied", **labels: str):
    from mscale.findings import Finding, Reason, Severity

    return Finding(
        "fuse", Reason.HEAL_ACTION, Severity.INFO, "", {"step": str(step), "action": action, "result": result, **labels}
    )


def test_verdict_wants_the_levels_action_and_its_effect_ended():
    from mscale.demo.verdict import judge

    corrupt = {"kind": "corrupt", "gpu": 0, "mode": "noise", "steps": 6}
    mpus = {"001": ("vision", 0), "002": ("aligner", 1)}
    on_new = [(s, {"001": (3, True), "002": (1, True)}) for s in range(12, 20)]
    suspect = [_action(10, "mark_suspect", mpu_id="001")]
    assert judge(corrupt, 10, 20, suspect, on_new, [], mpus_at_start=mpus)[:1] == (False,)
    swapped = [*suspect, _action(12, "l1_swap", mpu_id="001", to_gpu="3")]
    assert judge(corrupt, 10, 20, swapped, on_new, [], mpus_at_start=mpus) == (
        True,
        ["l1_swap(001) -> gpu 3"],
        "3+ clean checks on the new placement",
    )
    still_failing = [*on_new[:-1], (19, {"001": (3, False), "002": (1, True)})]
    assert judge(corrupt, 10, 20, swapped, still_failing, [], mpus_at_start=mpus)[0] is False
    spike = {"kind": "loss_spike", "factor": 25.0}
    losses = [(s, 2.0) for s in range(10)] + [(10, 50.0)] + [(s, 5.0) for s in range(11, 20)]
    healed, _, why = judge(spike, 10, 20, [_action(10, "lr_cool")], [], losses, mpus_at_start=mpus)
    assert not healed and "2.50x" in why  # cooled, but the loss did not come back
    losses = losses[:11] + [(s, 2.1) for s in range(11, 20)]
    assert judge(spike, 10, 20, [_action(10, "lr_cool")], [], losses, mpus_at_start=mpus)[0] is True
