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
