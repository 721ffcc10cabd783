"""pytest set-up: torch thread count for every test process, shared fixtures. Helpers live in tests/support/."""

from __future__ import annotations

import os
import sys

# One intra-op thread per torch process: on a shared 2-core machine two threads spin
# against each other and make tiny-model steps 10-30x slower. Set before torch is imported,
# so subprocesses the tests start inherit it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from support import IN_CI, REPO  # noqa: E402,F401  (fixtures below may use them)

# Fuzz tests: a fixed example budget so the suite's time is bounded, no per-example deadline
# (a loaded 2-core machine makes timings noise), and in CI the same examples every run, so a
# red CI reproduces.
settings.register_profile(
    "mscale",
    max_examples=150,
    deadline=None,
    derandomize=IN_CI,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("mscale")


@pytest.fixture
def python_exe() -> str:
    return sys.executable
