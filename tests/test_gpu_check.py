"""`make gpu-check` without a GPU: it says so, lists what it would check, writes nothing and
exits 0. Run with CUDA_VISIBLE_DEVICES="" so a GPU machine takes the same path (the check
itself runs there through `make gpu-check`, not through this test)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from support import REPO


def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path) -> None:
    out = tmp_path / "gpu-check"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(out)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no GPU here" in proc.stdout
    assert "eBPF launch counts against torch.profiler" in proc.stdout
    assert not out.exists()


def test_a_part_that_runs_past_its_deadline_is_cut_and_the_check_goes_on(tmp_path) -> None:
    """Each part of the check runs in its own process under a deadline (real processes)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    hung = gpu_check.run_part([sys.executable, "-c", "import time; time.sleep(600)"], 1.0)
    assert hung == {"error": "timed out after 1 s"}
    ok = gpu_check.run_part([sys.executable, "-c", "print('noise'); print('{\"x\": 1}')"], 30)
    assert ok == {"x": 1}
    broken = gpu_check.run_part([sys.executable, "-c", "raise SystemExit('no CUDA')"], 30)
    assert broken["error"].startswith("exit status 1") and "no CUDA" in broken["error"]
    # every measurement has its own deadline, and together with the tests they fit the budget
    assert set(gpu_check.PART_TIMEOUT_S) == set(gpu_check.MEASUREMENTS)
    assert gpu_check.TEST_BUDGET_S + sum(gpu_check.PART_TIMEOUT_S.values()) <= gpu_check.TOTAL_BUDGET_S < 8 * 60
