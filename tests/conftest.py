"""pytest set-up: torch thread count for every test process, shared fixtures. Helpers live in tests/support/."""

from __future__ import annotations

import os
import sys

# One intra-op thread per torch process: on a shared 2-core machine two threads spin
# against each other and make tiny-model steps 10-30x slower. Set before torch is imported,
# so subprocesses the tests start inherit it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from support import IN_CI, REPO  # noqa: E402,F401  (fixtures below may use them)


@pytest.fixture
def python_exe() -> str:
    return sys.executable
