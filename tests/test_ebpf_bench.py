"""benchmarks/ebpf_overhead.py's loop comparison against the real probes: a short run of it,
so that a change to the probe's roles cannot break `make benchmarks` unseen."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from support import REPO, require

sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def bench():
    require(importlib.util.find_spec("bcc") is not None, "BCC (python3-bpfcc) is not importable")
    require(os.geteuid() == 0, "BPF uprobes need root (CAP_BPF, CAP_PERFMON)")
    import ebpf_overhead

    return ebpf_overhead


def test_traced_chunks_run_with_the_launch_probes_attached(bench, tmp_path) -> None:
    lib, caller = bench.build(tmp_path)
    kw = dict(work_ns=200, chunk_s=0.02, seconds=1.0, repeats=1, attach_mode="auto")
    traced, _ = bench.alternating(caller, lib, trace=True, **kw)
    # a launch probe costs ~0.4 us against 0.2 us of work per launch: B chunks are far slower
    assert len(traced) == 1 and traced[0] > 1.5
    control, _ = bench.alternating(caller, lib, trace=False, **kw)
    assert len(control) == 1 and control[0] < 1.5  # nothing attached to either side
