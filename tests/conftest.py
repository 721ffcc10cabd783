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


def _shm_dir(prefix: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


# The node snapshot tier (mscale.snapshot.node_tier) of everything this session starts, fixtures
# of a wider scope than a test's included, in one directory removed at the session's end; each
# test gets its own inside it (node_root below).
_SESSION_NODE_ROOT = _shm_dir("mscale-test-session-")
os.environ["MSCALE_SNAPSHOT_NODE_ROOT"] = _SESSION_NODE_ROOT


@pytest.fixture(scope="session", autouse=True)
def _session_node_root():
    import shutil

    yield _SESSION_NODE_ROOT
    shutil.rmtree(_SESSION_NODE_ROOT, ignore_errors=True)


@pytest.fixture(autouse=True)
def node_root(monkeypatch: pytest.MonkeyPatch):
    """Every test's node snapshot tier in a fresh directory under /dev/shm (a temporary
    directory where there is none), removed after the test: no test resumes another's, none
    leaves shared memory behind. Its subprocesses inherit it."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="test-", dir=_SESSION_NODE_ROOT)
    monkeypatch.setenv("MSCALE_SNAPSHOT_NODE_ROOT", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def python_exe() -> str:
    return sys.executable


_NO_GPU: list[str | None] = []  # the reason there is no GPU (None: there is one), found once


def no_gpu_reason() -> str | None:
    """Why `gpu` tests cannot run here, or None on a machine with an NVIDIA GPU: torch must see
    a CUDA device and NVML must list one (the tests compare against both)."""
    if not _NO_GPU:
        _NO_GPU.append(_probe_gpu())
    return _NO_GPU[0]


def _probe_gpu() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no GPU: torch.cuda.is_available() is False"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # no driver library, or NVML refuses: the tests need it
        return f"no GPU: NVML unavailable ({e})"
    return None if count else "no GPU: NVML lists no device"


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A `gpu` test skips with the reason where there is no GPU, in CI too (CI never has one),
    # unlike a missing system tool (support.require_tool fails in CI). Nothing else skips here.
    if item.get_closest_marker("gpu") is not None:
        reason = no_gpu_reason()
        if reason is not None:
            pytest.skip(reason)
