"""The eBPF CUDA-driver probe, with real BCC uprobes on a stub libcuda.so.1.

The stub (fixtures/libcuda_stub.c) and a driver program (fixtures/cuda_caller.c) are
compiled with gcc into a temp dir. The caller answers each stdin command once its calls
have returned, so the tests know what happened without sleeping; conditions on the probe
are polled with deadlines.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mscale.daemon.config import from_dict
from mscale.daemon.exporters import make_registry
from mscale.daemon.state import AgentState
from mscale.findings import Reason
from mscale.probes import spec
from mscale.probes.base import ProbeContext, ProbeUnavailable
from mscale.probes.ebpf_detect import BlockedShare, LaunchWatch
from mscale.probes.ebpf_loader import SOURCE, specialise
from mscale.probes.ebpf_procfs import Procfs
from support import REPO, require, require_tool
from support.cuda_stub import (
    DEADLINE_S,
    Caller,
    build_cuda_stubs,
    ebpf_probes,
    events,
    poll,
    proc_of,
    register,
    sync_slots,
    wait_duty_state,
)

# --- pure logic: no BPF needed ------------------------------------------------------------


def test_specialise_fills_tokens_and_refuses_leftovers() -> None:
    assert specialise("a @@X@@ b @@Y@@", {"X": 1, "Y": "two"}) == "a 1 b two"
    with pytest.raises(ValueError, match="no value: Y"):
        specialise("@@X@@ @@Y@@", {"X": 1})
    with pytest.raises(ValueError, match="not used.*Z"):
        specialise("@@X@@", {"X": 1, "Z": 2})
    with pytest.raises(ValueError, match="left after"):
        specialise("@@X@@", {"X": "@@W@@"})
    # the shipped source takes exactly the tokens the loader gives it
    specialise(SOURCE.read_text(), {"MAX_PIDS": 8, "MAX_THREADS": 64})


def test_launch_watch_judges_only_over_attached_time() -> None:
    # always on: attached from t=0, last launch at 10
    w = LaunchWatch(hang_timeout_s=5, min_evidence_s=math.inf)
    w.attached(0.0)
    assert not w.hung(100.0)  # never launched: not judged
    w.launched(10.0)
    assert not w.hung(14.9)
    assert w.hung(15.1)
    w.launched(15.0)
    assert not w.hung(15.2)

    # duty-cycled, window 1 s every 10 s: a launch at 0.5 in the first window
    d = LaunchWatch(hang_timeout_s=5, min_evidence_s=1.0)
    d.attached(0.0)
    d.launched(0.5)
    d.detached(1.0)
    assert d.evidence_s(9.0) == pytest.approx(0.5)
    assert not d.hung(9.0)  # 8.5 s quiet, but only 0.5 s of it observed
    d.attached(10.0)
    assert not d.hung(10.4)  # 0.9 s observed
    assert d.hung(10.6)  # a whole window's worth of observed silence
    d.detached(11.0)
    d.attached(20.0)
    d.launched(20.1)
    d.detached(21.0)
    assert d.quiet_s(30.0) == pytest.approx(9.9) and not d.hung(30.0)  # 0.9 s observed since


def test_blocked_share_needs_a_whole_window() -> None:
    s = BlockedShare(window_s=10)
    s.add(0.0, 0.0)
    s.add(5.0, 5.0)
    assert s.ratio() is None
    s.add(10.0, 8.0)
    assert s.ratio() == pytest.approx(0.8)
    s.add(20.0, 8.0)  # nothing blocked in the last 10 s
    assert s.ratio() == pytest.approx(0.0)
    s.add(30.0, 48.0)  # four threads blocked all the time: capped
    assert s.ratio() == 1.0


def test_procfs_reads_under_its_root(tmp_path) -> None:
    """The probe's procfs reads go under `probes.ebpf.proc_root`, as the host probe's do."""
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"")

    def proc(pid: int, state: str, maps: str, cmdline: bytes, tids: tuple[int, ...] = ()) -> None:
        d = tmp_path / "proc" / str(pid)
        (d / "task").mkdir(parents=True)
        fields = [state] + ["0"] * 18 + [str(pid * 10)]  # field 22 of stat: starttime
        (d / "stat").write_text(f"{pid} (a) b) {' '.join(fields)}\n")
        (d / "maps").write_text(maps)
        (d / "cmdline").write_bytes(cmdline)
        for tid in tids:
            (d / "task" / str(tid)).mkdir()

    ino = lib.stat().st_ino
    proc(7, "S", f"7f00-7f01 r-xp 0 08:01 {ino} {lib}\n", b"python\0train.py\0", tids=(8,))
    proc(9, "Z", "7f00-7f01 r-xp 0 08:01 1 /usr/lib/libcudart.so.12\n", b"")
    (tmp_path / "proc" / "self").mkdir()
    fs = Procfs(str(tmp_path / "proc"))
    assert fs.start_time(7) == 70 and fs.start_time(9) is None and fs.start_time(5) is None
    assert fs.libcuda(7) == str(lib)  # the same file from here
    assert fs.libcudart(9) == f"{tmp_path}/proc/9/root/usr/lib/libcudart.so.12"  # another namespace
    assert fs.libcuda(9) is None
    assert fs.matching(re.compile(r"train\.py$"), skip=set()) == [7]
    assert fs.matching(re.compile(r"train\.py$"), skip={7}) == []
    assert fs.thread_alive(7, 8) and not fs.thread_alive(7, 9)


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_bins(tmp_path_factory) -> types.SimpleNamespace:
    return build_cuda_stubs(tmp_path_factory.mktemp("cuda"))


@pytest.fixture(scope="module")
def bpf_ok() -> None:
    require(importlib.util.find_spec("bcc") is not None, "BCC (python3-bpfcc) is not importable")
    require(os.geteuid() == 0, "BPF uprobes need root (CAP_BPF, CAP_PERFMON)")


@pytest.fixture
def callers(cuda_bins):
    made: list[Caller] = []

    def start(*args: str) -> Caller:
        c = Caller(cuda_bins.caller, *args)
        made.append(c)
        return c

    yield start
    for c in made:
        c.stop()


@pytest.fixture
def make_probe(bpf_ok):
    with ebpf_probes() as build:
        yield build


def scrape(state: AgentState) -> dict:
    """name -> list of samples, from the cuda exporter through prometheus_client."""
    text = generate_latest(make_registry(state, ("mscale.daemon.exporters.cuda",))).decode()
    return {m.name: m.samples for m in text_string_to_metric_families(text)}, text


def sample_value(samples, name: str, **labels) -> float:
    hits = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples)
    return hits[0]


def traced(probe, pid: int, what: str = "attached"):
    return poll(probe, lambda s: proc_of(s, pid) is not None, f"process {pid} {what}")


# --- counts (always on) ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["uprobe_multi", "perf_event"])
def test_exact_counts_bytes_and_alloc_failures(make_probe, callers, mode) -> None:
    probe, state = make_probe(attach_mode=mode)
    c = callers()
    register(state, "job-a", c.pid)
    snap = traced(probe, c.pid)
    assert snap.sampled is False and snap.attach_mode == mode
    for line in (
        "launch 1000",
        "launch 200 ptsz",
        "launch 30 ex",
        "launch 4 graph",
        "thread 77",
        "htod 4096 3",
        "dtoh 1000 5",
        "dtod 64 2",
        "copy 7 11",
        "allocfail 2",
        "alloc 1048576",
        "alloc 1048576",
        "alloc 16",
    ):
        c.cmd(line)
    snap = poll(probe, lambda s: proc_of(s, c.pid).launches_observed >= 1307, "launch counts")
    p = proc_of(snap, c.pid)
    assert p.launches_observed == p.launches == 1000 + 200 + 30 + 77
    assert p.graph_launches_observed == 4
    assert dict(p.memcpy_bytes_observed) == {"htod": 4096 * 3, "dtoh": 5000, "dtod": 128, "default": 77}
    assert dict(p.memcpy_bytes) == dict(p.memcpy_bytes_observed)  # always on: nothing extrapolated
    assert p.alloc_failures == 2 and p.job_id == "job-a"
    [fail] = events(state, Reason.CUDA_ALLOC_FAILURE)
    assert fail.labels["pid"] == str(c.pid) and fail.labels["bytes"] == "1048576" and fail.labels["cuda_error"] == "2"

    state.publish("ebpf", snap)
    metrics, text = scrape(state)
    lab = {"pid": str(c.pid), "job_id": "job-a"}
    assert sample_value(metrics["mscale_cuda_kernel_launches"], "mscale_cuda_kernel_launches_total", **lab) == 1307
    assert (
        sample_value(metrics["mscale_cuda_memcpy_bytes"], "mscale_cuda_memcpy_bytes_total", direction="dtoh", **lab)
        == 5000
    )
    assert sample_value(metrics["mscale_cuda_alloc_failures"], "mscale_cuda_alloc_failures_total", **lab) == 2
    assert sample_value(metrics["mscale_cuda_sampled"], "mscale_cuda_sampled") == 0
    promtool = require_tool("promtool", why="checks the exposition")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("mode", ["uprobe_multi", "perf_event"])
def test_sync_histogram_buckets_hold_a_known_sleep(make_probe, callers, mode) -> None:
    probe, state = make_probe(attach_mode=mode)
    c = callers()
    register(state, "job-s", c.pid)
    traced(probe, c.pid)
    c.cmd("syncsleep 20000")  # 20 ms: log2 slot 25, [2^24, 2^25) ns = [16.8, 33.6) ms
    measured = sync_slots(c.cmd("sync 3")) + sync_slots(c.cmd("ctxsync 2"))
    assert sum(measured.values()) == 5 and min(measured) >= 25  # a sleep is never shorter
    snap = poll(probe, lambda s: proc_of(s, c.pid).sync_calls == 5, "5 sync calls")
    p = proc_of(snap, c.pid)
    assert {s: n for s, n in enumerate(p.sync_hist) if n} == dict(measured)
    low = sum(n * 2.0 ** (s - 1) for s, n in measured.items()) / 1e9
    high = sum(n * 2.0**s for s, n in measured.items()) / 1e9
    assert low <= p.sync_seconds_sum < high
    state.publish("ebpf", snap)
    metrics, _ = scrape(state)
    buckets = {
        s.labels["le"]: s.value
        for s in metrics["mscale_cuda_sync_seconds"]
        if s.name == "mscale_cuda_sync_seconds_bucket"
    }
    assert buckets[repr(2.0**24 / 1e9)] == 0
    assert buckets[repr(2.0**25 / 1e9)] == measured[25]  # each bucket counts the calls at or under it
    assert buckets["+Inf"] == 5


@pytest.mark.parametrize("multi", [True, False], ids=["uprobe_multi", "perf_event"])
def test_both_attach_modes_count_exactly_and_detach_stops_counting(bpf_ok, callers, cuda_bins, multi) -> None:
    from mscale.probes.ebpf_loader import ROLES, CudaBpf

    bpf = CudaBpf(max_pids=4, max_threads=64, attach_mode="uprobe_multi" if multi else "perf_event")
    try:
        c = callers()
        offsets = bpf.offsets(cuda_bins.lib)
        launch = next(r for r in ROLES if r.prog == "on_launch")
        bpf.add_pid(c.pid)
        link = bpf.attach(c.pid, cuda_bins.lib, launch, offsets["on_launch"])
        assert bpf.attach_mode == ("uprobe_multi" if multi else "perf_event")
        c.cmd("launch 100")
        c.cmd("launch 10 ex")
        bpf.detach(link)
        c.cmd("launch 1000")  # detached: not seen
        assert bpf.read_stats()[c.pid].launches == 110
    finally:
        bpf.close()


# --- detections ------------------------------------------------------------------------------


@pytest.mark.slow  # waits out a hang timeout: about 3 s
def test_hang_detected_when_launches_stop_and_cleared_when_they_resume(make_probe, callers, cuda_bins) -> None:
    probe, state = make_probe(hang_timeout_s=1.0, libcuda_path=cuda_bins.lib)  # configured path, not maps
    c = callers()
    register(state, "job-h", c.pid)
    traced(probe, c.pid)
    c.cmd("loop 1000")  # a launch every millisecond
    snap = poll(probe, lambda s: proc_of(s, c.pid).launches_observed > 0, "launches")
    # launching steadily for twice the timeout: no hang
    t_end = time.monotonic() + 2.0
    while time.monotonic() < t_end:
        assert not proc_of(probe.sample(), c.pid).hang
        time.sleep(0.05)
    assert events(state, Reason.TRAINING_HANG) == []

    c.cmd("stop")
    snap = poll(probe, lambda s: proc_of(s, c.pid).hang, "hang")
    [hang] = events(state, Reason.TRAINING_HANG)
    assert hang.labels == {"pid": str(c.pid), "job_id": "job-h", "cause": "no_launch"}
    assert proc_of(snap, c.pid).launch_quiet_s > 1.0

    c.cmd("resume")
    poll(probe, lambda s: not proc_of(s, c.pid).hang, "hang cleared")
    [cleared] = events(state, Reason.TRAINING_HANG_CLEARED)
    assert cleared.labels["job_id"] == "job-h"


def test_blocked_sync_is_a_hang_while_the_launch_probe_is_detached(make_probe, callers) -> None:
    # a 50 ms window every 10 minutes: the launch probe is detached for the whole test
    probe, state = make_probe(hang_timeout_s=0.5, duty_window_s=0.05, duty_period_s=600)
    c = callers()
    register(state, "job-b", c.pid)
    traced(probe, c.pid)
    poll(probe, lambda s: s.windows_total == 1 and not s.launch_probe_attached, "first window closed")
    c.cmd("loop 1000")
    c.cmd("syncsleep 1500000")
    c.cmd("bgsync")  # one cuStreamSynchronize blocked for 1.5 s
    snap = poll(probe, lambda s: proc_of(s, c.pid).hang, "hang from the blocked sync")
    assert not snap.launch_probe_attached
    [hang] = events(state, Reason.TRAINING_HANG)
    assert hang.labels["cause"] == "sync_blocked" and "cuStreamSynchronize" in hang.message
    assert proc_of(snap, c.pid).sync_inflight_s > 0.5
    c.expect("done bgsync")
    poll(probe, lambda s: not proc_of(s, c.pid).hang, "hang cleared once the sync returned")
    assert len(events(state, Reason.TRAINING_HANG_CLEARED)) == 1


@pytest.mark.slow  # fills a stall window: about 3 s
def test_sync_stall_over_the_window(make_probe, callers) -> None:
    probe, state = make_probe(sync_stall_window_s=1.0, sync_stall_ratio=0.5)
    c = callers()
    register(state, "job-st", c.pid)
    traced(probe, c.pid)
    c.cmd("syncsleep 50000")
    c.send("sync 40")  # 2 s spent in 40 back-to-back 50 ms synchronise calls
    snap = poll(probe, lambda s: proc_of(s, c.pid).sync_stall, "sync stall")
    assert proc_of(snap, c.pid).sync_blocked_ratio > 0.5
    [stall] = events(state, Reason.SYNC_STALL)
    assert stall.labels == {"pid": str(c.pid), "job_id": "job-st"}
    c.expect("ok sync 40")
    poll(probe, lambda s: not proc_of(s, c.pid).sync_stall, "stall cleared")
    assert len(events(state, Reason.SYNC_STALL_CLEARED)) == 1


# --- which processes -----------------------------------------------------------------------


def test_two_processes_are_kept_apart(make_probe, callers) -> None:
    tag = f"mscale-test-{os.getpid()}"
    probe, state = make_probe(cmdline_pattern=f"cuda_caller --tag={tag}$")
    a = callers()
    b = callers(f"--tag={tag}")  # traced by the pattern only, no job
    other = callers("--tag=someone-else")  # neither registered nor matching
    register(state, "job-a", a.pid)
    poll(probe, lambda s: proc_of(s, a.pid) and proc_of(s, b.pid), "both traced")
    a.cmd("launch 1234")
    a.cmd("htod 100 10")
    b.cmd("launch 567")
    b.cmd("dtoh 300 2")
    other.cmd("launch 99")
    snap = poll(
        probe,
        lambda s: proc_of(s, a.pid).launches_observed == 1234 and proc_of(s, b.pid).launches_observed == 567,
        "counts per process",
    )
    pa, pb = proc_of(snap, a.pid), proc_of(snap, b.pid)
    assert (pa.job_id, pb.job_id) == ("job-a", "")
    assert dict(pa.memcpy_bytes_observed) == {"htod": 1000, "dtoh": 0, "dtod": 0, "default": 0}
    assert dict(pb.memcpy_bytes_observed) == {"htod": 0, "dtoh": 600, "dtod": 0, "default": 0}
    assert proc_of(snap, other.pid) is None and other.pid not in probe.bpf.map_pids()


def test_a_job_without_libcuda_is_reported_not_traced(make_probe) -> None:
    probe, state = make_probe()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        register(state, "cpu-job", sleeper.pid)
        snap = probe.sample()
        assert snap.processes == ()
        [pending] = snap.pending
        assert pending.pid == sleeper.pid and "libcuda not mapped" in pending.reason
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_exited_process_is_cleaned_out_of_the_maps(make_probe, callers) -> None:
    probe, state = make_probe(hang_timeout_s=30)
    keep, gone = callers(), callers()
    register(state, "job-keep", keep.pid)
    register(state, "job-gone", gone.pid)
    poll(probe, lambda s: proc_of(s, keep.pid) and proc_of(s, gone.pid), "both traced")
    gone.cmd("launch 10")
    gone.cmd("syncsleep 30000000")
    gone.cmd("bgsync")  # dies inside the call: its in-flight entry must go too
    poll(probe, lambda s: proc_of(s, gone.pid).sync_inflight_s > 0, "sync in flight")
    assert gone.pid in probe.bpf.map_pids()
    gone.proc.send_signal(signal.SIGKILL)
    gone.proc.wait()
    snap = poll(probe, lambda s: proc_of(s, gone.pid) is None, "exited process dropped")
    assert gone.pid not in probe.bpf.map_pids()
    assert probe.bpf.map_pids() == {keep.pid}
    keep.cmd("launch 5")
    snap = poll(probe, lambda s: proc_of(s, keep.pid).launches_observed == 5, "the other still counted")
    # the job is still registered with a dead pid: reported, not traced, maps stay empty of it
    assert [p.pid for p in snap.pending] == [gone.pid]


# --- duty cycle --------------------------------------------------------------------------


@pytest.mark.slow  # spans duty windows: about 3 s
def test_duty_cycled_mode_exports_sampled_counts_with_the_window(make_probe, callers) -> None:
    probe, state = make_probe(duty_window_s=0.3, duty_period_s=0.9)  # scale 3
    c = callers()
    register(state, "job-d", c.pid)
    traced(probe, c.pid)
    expected = 0  # launches the probe must have seen
    clean = {True: 0, False: 0}  # bursts known to lie wholly inside a window / a gap
    deadline = time.monotonic() + 3 * DEADLINE_S
    while min(clean.values()) < 3:
        assert time.monotonic() < deadline, f"no clean bursts: {clean}"
        attached = clean[True] <= clean[False]
        seq, _ = wait_duty_state(probe, attached)
        n = 100 if attached else 50
        c.cmd(f"launch {n}")
        if probe.duty_state() == (seq, attached):
            clean[attached] += 1
            expected += n if attached else 0  # inside a window every launch counts; in a gap none
        else:  # the burst straddled a switch (a slow machine): re-baseline on what was seen
            expected = proc_of(probe.sample(), c.pid).launches_observed
    snap = poll(probe, lambda s: proc_of(s, c.pid).launches_observed >= expected, "window counts")
    p = proc_of(snap, c.pid)
    assert p.launches_observed == expected >= 300
    assert p.launches == pytest.approx(p.launches_observed * 3)  # extrapolated by period / window
    assert snap.sampled and snap.windows_total >= 3
    state.publish("ebpf", snap)
    metrics, _ = scrape(state)
    lab = {"pid": str(c.pid), "job_id": "job-d"}
    assert sample_value(
        metrics["mscale_cuda_kernel_launches"], "mscale_cuda_kernel_launches_total", **lab
    ) == pytest.approx(3 * expected)
    assert (
        sample_value(
            metrics["mscale_cuda_kernel_launches_observed"], "mscale_cuda_kernel_launches_observed_total", **lab
        )
        == expected
    )
    assert sample_value(metrics["mscale_cuda_sampled"], "mscale_cuda_sampled") == 1
    assert sample_value(metrics["mscale_cuda_duty_window_seconds"], "mscale_cuda_duty_window_seconds") == 0.3
    assert sample_value(metrics["mscale_cuda_duty_period_seconds"], "mscale_cuda_duty_period_seconds") == 0.9


# --- degrading -------------------------------------------------------------------------------


async def test_missing_libcuda_path_marks_the_probe_down_and_the_agent_serves(bpf_ok, tmp_path) -> None:
    from aiohttp import ClientSession, web

    from mscale.daemon.app import create_app

    cfg = from_dict(
        {
            "agent": {"listen": "127.0.0.1:0"},
            "probes": {
                "gpu": {"enabled": False},
                "host": {"enabled": False},
                "ebpf": {"libcuda_path": str(tmp_path / "nope" / "libcuda.so.1"), "interval_s": 0.05},
            },
        }
    )
    app = create_app(cfg, features=("mscale.daemon.api",))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with ClientSession() as http:
            deadline = time.monotonic() + DEADLINE_S
            while True:
                probes = await (await http.get(f"http://127.0.0.1:{port}/api/v1/probes")).json()
                if probes["ebpf"]["up"] is False or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            assert probes["ebpf"]["up"] is False
            assert "libcuda_path" in probes["ebpf"]["reason"] and "does not exist" in probes["ebpf"]["reason"]
            text = await (await http.get(f"http://127.0.0.1:{port}/metrics")).text()
            assert 'mscale_probe_up{probe="ebpf"} 0.0' in text
    finally:
        await runner.cleanup()


def test_a_bad_cmdline_pattern_is_reported_not_raised() -> None:
    cfg = from_dict({"probes": {"ebpf": {"cmdline_pattern": "train(("}}})
    state = AgentState(node="test")
    with pytest.raises(ProbeUnavailable, match="cmdline_pattern is not a valid regular expression"):
        spec("ebpf").factory(
            ProbeContext(config=cfg, emit=state.events.emit, clock=time.time, jobs=state.registered_jobs)
        )


UNPRIVILEGED = r"""
import time
from mscale.daemon.config import from_dict
from mscale.daemon.state import AgentState
from mscale.probes import spec
from mscale.probes.base import ProbeContext, ProbeUnavailable
from mscale.probes.ebpf import EbpfProbe
cfg = from_dict({})
st = AgentState(node="t")
ctx = ProbeContext(config=cfg, emit=st.events.emit, clock=time.time, jobs=st.registered_jobs)
try:
    spec("ebpf").factory(ctx)
    print("factory: ok")
except ProbeUnavailable as e:
    print("factory:", e)
# past the capability check, BCC itself must fail, and say so, on the first sample
p = EbpfProbe(ctx, cfg.probes.ebpf, None)
for _ in range(2):
    try:
        p.sample()
        print("sample: ok")
    except ProbeUnavailable as e:
        print("sample:", e)
"""


def test_without_bpf_capabilities_the_probe_says_why(bpf_ok) -> None:
    setpriv = require_tool("setpriv", why="drops every capability for the child")
    out = subprocess.run(
        [setpriv, "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-c", UNPRIVILEGED],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("factory:", "sample:"))]
    assert len(lines) == 3, out.stdout + out.stderr
    assert "CAP_BPF" in lines[0] and "CAP_PERFMON" in lines[0], lines
    assert lines[1].startswith("sample: BPF program failed to load"), lines
    assert lines[2] == lines[1]  # remembered, not recompiled every interval
