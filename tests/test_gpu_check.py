"""`make gpu-check` without a GPU: it says so, lists what it would check, writes nothing and
exits 0. Run with CUDA_VISIBLE_DEVICES="" so a GPU machine takes the same path (the check
itself runs there through `make gpu-check`, not through this test)."""

from __future__ import annotations

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
