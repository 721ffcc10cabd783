"""What the README's protection line prints in a job that configured no logging: no debug lines
unless MSCALE_LOG_LEVEL=debug asks for them, and a NaN's rollback logged once (not once by the
snapshot engine and again by the guard). Run as a process: structlog's state is per process."""

from __future__ import annotations

import os
import subprocess
import sys

from support import REPO

JOB = """
import torch, mscale
from support.tiny_hf import tiny_llava
model, make_batch = tiny_llava(seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
guard = mscale.attach(model, opt, job_id="logs", snapshots=mscale.SnapshotConfig(memory_every=2), connect=False)
poisoned = False
while guard.current_step < 8:
    step = guard.current_step
    out = model(**make_batch(step, torch.Generator().manual_seed(step)))
    nan = step == 5 and not poisoned  # the test's own fault: one NaN loss, once
    poisoned = poisoned or nan
    (out.loss * float("nan") if nan else out.loss).backward()
    opt.step(); opt.zero_grad()
guard.detach()
"""


def run(**env: str) -> list[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "MSCALE_LOG_LEVEL"}
    full_env.update(PYTHONPATH=f"{REPO}:{REPO / 'tests'}", **env)
    out = subprocess.run(
        [sys.executable, "-c", JOB], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=180, check=True
    )
    return out.stdout.splitlines()


def test_no_debug_lines_by_default_and_one_line_per_rollback() -> None:
    lines = run()
    assert not [line for line in lines if "[debug" in line]
    rolled = [line for line in lines if "rolled back to the in-memory snapshot" in line]
    assert len(rolled) == 1, rolled  # the engine's finding, logged by the guard only
    heal = [line for line in lines if "heal_action" in line and "duplicate" in line]
    assert not heal
    assert [line for line in run(MSCALE_LOG_LEVEL="debug") if "[debug" in line and "memory snapshot" in line]
