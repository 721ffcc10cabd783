"""The eBPF probe on the CUDA runtime as well as the driver, with real BCC uprobes on a stub
libcudart.so.12 that calls a stub libcuda.so.1 as the real runtime calls the driver: each
launch, copy and synchronise counts once, whichever layer it was seen in."""

from __future__ import annotations

import importlib.util
import os
import time
import types
from collections import Counter

import pytest

from support import require
from support.cuda_stub import (
    Caller,
    build_cuda_stubs,
    ebpf_probes,
    poll,
    proc_of,
    register,
    sync_slots,
    wait_duty_state,
)

pytestmark = pytest.mark.slow  # gcc builds four binaries; BCC compiles the program per test


@pytest.fixture(scope="module")
def cuda_bins(tmp_path_factory) -> types.SimpleNamespace:
    return build_cuda_stubs(tmp_path_factory.mktemp("cudart"))


@pytest.fixture(scope="module")
def bpf_ok() -> None:
    require(importlib.util.find_spec("bcc") is not None, "BCC (python3-bpfcc) is not importable")
    require(os.geteuid() == 0, "BPF uprobes need root (CAP_BPF, CAP_PERFMON)")


@pytest.fixture
def caller(cuda_bins):
    made: list[Caller] = []

    def start(runtime: bool = True) -> Caller:
        made.append(Caller(cuda_bins.caller_rt if runtime else cuda_bins.caller))
        return made[-1]

    yield start
    for c in made:
        c.stop()


@pytest.fixture
def make_probe(bpf_ok):
    with ebpf_probes() as build:
        yield build


@pytest.mark.parametrize("mode", ["uprobe_multi", "perf_event"])
def test_each_layer_counts_and_a_runtime_call_counts_once(bpf_ok, caller, cuda_bins, mode) -> None:
    """The runtime's probes alone count runtime calls; with the driver's attached too, a
    runtime launch (which calls cuLaunchKernel inside) still counts once, and a direct
    driver launch counts at the driver."""
    from mscale.probes.ebpf_loader import DRIVER, ROLES, RUNTIME, CudaBpf

    bpf = CudaBpf(max_pids=4, max_threads=64, attach_mode=mode)
    try:
        c = caller()
        bpf.add_pid(c.pid)
        links = []
        for library, path in ((RUNTIME, cuda_bins.runtime), (DRIVER, cuda_bins.lib)):
            offsets = bpf.offsets(path, library)
            links += [
                bpf.attach(c.pid, path, r, offsets[r.prog]) for r in ROLES if r.library == library and offsets[r.prog]
            ]
            if library == RUNTIME:  # the runtime's probes alone
                c.cmd("rtlaunch 100")
                c.cmd("launch 7")  # straight to the driver: no probe there yet
                assert bpf.read_stats()[c.pid].launches == 100
        c.cmd("rtlaunch 100")
        c.cmd("rtlaunch 10 ex")
        c.cmd("rtlaunch 3 graph")
        c.cmd("launch 50")
        c.cmd("launch 2 graph")
        stats = bpf.read_stats()[c.pid]
        assert (stats.launches, stats.graph_launches) == (100 + 100 + 10 + 50, 3 + 2)
        assert not {k.value >> 32 for k in bpf.in_runtime.keys()}  # every mark cleared on return
        for link in links:
            bpf.detach(link)
    finally:
        bpf.close()


@pytest.mark.parametrize("mode", ["uprobe_multi", "perf_event"])
def test_the_probe_attaches_to_the_runtime_a_process_maps(make_probe, caller, cuda_bins, mode) -> None:
    probe, state = make_probe(attach_mode=mode)
    c = caller()
    register(state, "job-rt", c.pid)
    snap = poll(probe, lambda s: (p := proc_of(s, c.pid)) is not None and p.runtime_library, "runtime attached")
    assert proc_of(snap, c.pid).runtime_library == cuda_bins.runtime and not proc_of(snap, c.pid).error
    measured: Counter[int] = Counter()
    for line in (
        "rtlaunch 500",
        "rtlaunch 20 ex",
        "rtlaunch 4 graph",
        "launch 30",
        "rthtod 4096 3",
        "rtdtoh 1000 2",
        "rtdtod 64 1",
        "rtcopy 7 5",
        "htod 10 1",
        "syncsleep 20000",  # 20 ms: log2 slot 25
        "rtsync 2",
        "rtdevsync 2",
        "rteventsync 1",
        "eventsync 1",
        "sync 1",
    ):
        measured += sync_slots(c.cmd(line))
    snap = poll(probe, lambda s: proc_of(s, c.pid).sync_calls >= 7, "sync counts")
    p = proc_of(snap, c.pid)
    assert (p.launches_observed, p.graph_launches_observed) == (550, 4)
    assert dict(p.memcpy_bytes_observed) == {"htod": 4096 * 3 + 10, "dtoh": 2000, "dtod": 64, "default": 35}
    assert p.sync_calls == 7 and sum(measured.values()) == 7 and min(measured) >= 25
    assert {s: n for s, n in enumerate(p.sync_hist) if n} == dict(measured)


def test_a_process_without_a_runtime_is_traced_at_the_driver(make_probe, caller) -> None:
    probe, state = make_probe()
    c = caller(runtime=False)
    register(state, "job-drv", c.pid)
    poll(probe, lambda s: proc_of(s, c.pid) is not None, "attached")
    c.cmd("launch 40")
    snap = poll(probe, lambda s: proc_of(s, c.pid).launches_observed >= 40, "launches")
    p = proc_of(snap, c.pid)
    assert (p.launches_observed, p.runtime_library, p.error) == (40, "", "")


def test_a_blocked_runtime_sync_is_in_flight_once(make_probe, caller) -> None:
    """While a cudaStreamSynchronize blocks, one call is in flight (the runtime's), and its
    return counts one call, not two."""
    probe, state = make_probe()
    c = caller()
    register(state, "job-blk", c.pid)
    poll(probe, lambda s: (p := proc_of(s, c.pid)) is not None and p.runtime_library, "runtime attached")
    c.cmd("syncsleep 300000")  # 0.3 s
    c.send("rtsync 1")
    snap = poll(probe, lambda s: proc_of(s, c.pid).sync_inflight_s > 0, "a sync in flight")
    assert len(probe.bpf.read_inflight()) == 1
    c.expect("ok rtsync 1")
    snap = poll(probe, lambda s: proc_of(s, c.pid).sync_calls >= 1, "the sync's return")
    assert proc_of(snap, c.pid).sync_calls == 1 and not probe.bpf.read_inflight()
    del snap


def test_runtime_launch_probes_follow_the_duty_cycle_and_still_count_once(make_probe, caller) -> None:
    """Duty-cycled: the runtime's launch probes (and their returns) come and go with each
    window; a burst inside a window counts each launch once, a burst in a gap not at all."""
    probe, state = make_probe(duty_window_s=0.3, duty_period_s=0.9)
    c = caller()
    register(state, "job-dc", c.pid)
    poll(probe, lambda s: (p := proc_of(s, c.pid)) is not None and p.runtime_library, "runtime attached")
    seen = proc_of(probe.sample(), c.pid).launches_observed
    clean = {True: 0, False: 0}
    deadline = time.monotonic() + 60
    while min(clean.values()) < 2:
        assert time.monotonic() < deadline, f"no clean bursts: {clean}"
        attached = clean[True] <= clean[False]
        seq, _ = wait_duty_state(probe, attached)
        c.cmd("rtlaunch 40")
        now = proc_of(probe.sample(), c.pid).launches_observed
        if probe.duty_state() == (seq, attached):  # the burst lay wholly in a window or a gap
            assert now - seen == (40 if attached else 0), (attached, now - seen)
            clean[attached] += 1
        seen = now
    assert not {k.value >> 32 for k in probe.bpf.in_runtime.keys()}  # no mark left behind


def test_runtime_probes_off_counts_at_the_driver_alone(make_probe, caller) -> None:
    """probes.ebpf.runtime_probes = false: the runtime is left alone and each runtime launch
    is still counted once, by the driver's probe on the cuLaunchKernel the runtime calls."""
    probe, state = make_probe(runtime_probes=False)
    c = caller()
    register(state, "job-off", c.pid)
    poll(probe, lambda s: proc_of(s, c.pid) is not None, "attached")
    c.cmd("rtlaunch 25")
    snap = poll(probe, lambda s: proc_of(s, c.pid).launches_observed >= 25, "launches")
    p = proc_of(snap, c.pid)
    assert (p.launches_observed, p.runtime_library) == (25, "")
