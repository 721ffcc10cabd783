"""A guarded tiny LLaVA with CMSA on (the default) and a step-wise LR scheduler, SIGKILLed after
CMSA's cold start and restarted from its disk snapshot, ends bitwise as the uninterrupted run:
CMSA's fitted alpha, its cold-start progress and the kept GVC estimates come back with the
snapshot (mscale.hook.checks.cmsa.CmsaState), and the restart trains every step with the LR the
uninterrupted run used (the resume makes the loop's scheduler.step() of the snapshot's step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three tiny-LLaVA processes: about 30 s

JOB = Path(__file__).parent / "support" / "guarded_llava_job.py"
STEPS, KILL_AT = 24, 17  # the cold start is steps 0..9, alpha fitted at step 10


def run(directory: Path, result: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(JOB), "--dir", str(directory), "--steps", str(STEPS), "--result", str(result), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_killed_guarded_llava_with_cmsa_restarts_bitwise(tmp_path) -> None:
    plain = run(tmp_path / "plain", tmp_path / "plain.json")
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed = run(tmp_path / "killed", tmp_path / "killed.json", "--kill-at", str(KILL_AT))
    assert killed.returncode == -9, killed.stderr[-3000:]  # a real SIGKILL, mid-run
    restarted = run(tmp_path / "killed", tmp_path / "killed.json")
    assert restarted.returncode == 0, restarted.stderr[-3000:]

    ref = json.loads((tmp_path / "plain.json").read_text())
    got = json.loads((tmp_path / "killed.json").read_text())
    assert ref["resumed"] == [None] and got["resumed"] == [None, 16]  # the newest disk snapshot
    fitted = ref["alpha"][str(KILL_AT)]
    assert fitted is not None and fitted != 0.1  # fitted at step 10, not the probing alpha
    assert got["alpha"] == ref["alpha"]  # the restart clipped with the fitted alpha, no new cold start
    assert got["lr"] == ref["lr"]  # every step's LR, steps 17..23 from the restart
    assert got["digest"] == ref["digest"]  # weights and optimizer state, bitwise
