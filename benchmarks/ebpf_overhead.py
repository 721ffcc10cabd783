"""What the eBPF CUDA-driver probe costs the traced process, measured in one run.

1. Per-call cost of each probe mode on the stub's cuLaunchKernel (no work behind it),
   over --calls calls (default 1,000,000): no probe, an entry uprobe (the launch
   program), entry plus return (the synchronise programs: map update at entry, histogram
   at return). Printed as ns per call and as a ratio to the bare call.
   The same for a launch through the stub CUDA runtime (cudaLaunchKernel, which calls the
   stub driver's cuLaunchKernel): no probe, the driver's launch probe alone, and both
   layers as the probe attaches them (runtime entry and return, the driver's entry finding
   the thread marked), so the price of counting each launch once is on the table. Twice:
   with the runtime's entry points starting with `push %rbp`, an instruction the kernel
   emulates at a uprobe, and with `sub $n,%rsp`, which it must single-step out of line (a
   real libcudart's first instructions decide which price it pays).
2. Added time on a launch-bound loop (each stub launch does --work-ns, default 5 us, of
   CPU work, like the CPU side of a real launch), in ONE process pinned to one CPU, its
   launches timed in short chunks (the loop thread's CPU time: a uprobe trap is charged to
   it, preemption by other work is not; wall time printed beside it):
   - control: alternate chunks labelled A and B, no probe at all: A/B is the noise floor
     (it reads 1.00 +- 0.02 when the measurement can be trusted);
   - always on: alternate chunks with the launch probes attached and detached;
   - default mode: the agent's own probe duty-cycles its launch probes (duty_window_s every
     duty_period_s) while the loop runs; every chunk is classed by whether the probes were
     attached all through it, outside every window, or both (dropped): the added cost is the
     time per launch over the probe's whole cycle (window fraction x in-window rate +
     the rest at the untraced rate) against the untraced rate; its noise is the control's
     scaled by the same window fraction.
   Each comparison is split into --repeats blocks whose ratios are judged on their median
   against the control's noise (benchmarks/_verdict.py).

Needs root (or CAP_BPF + CAP_PERFMON), BCC and gcc. Run: .venv/bin/python benchmarks/ebpf_overhead.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _verdict import Report, add_json_arg  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"


def build_runtime(d: Path, *, frame_pointer: bool) -> tuple[str, str]:
    """The stub libcudart (over the libcuda build() made in d, in a folder of its own) and a
    caller linking both; frame_pointer: its functions start with push %rbp."""
    sub = d / ("rt-push" if frame_pointer else "rt-sub")
    sub.mkdir()
    rt, caller = sub / "libcudart.so.12", sub / "cuda_caller_rt"
    link = [f"-L{d}", f"-L{sub}", "-l:libcuda.so.1", f"-Wl,-rpath,{sub}:{d}"]
    flags = ["-fno-omit-frame-pointer"] if frame_pointer else ["-fomit-frame-pointer"]
    subprocess.run(
        ["gcc", "-O2", *flags, "-shared", "-fPIC", "-Wl,-soname,libcudart.so.12", "-o", str(rt)]
        + [str(FIXTURES / "libcudart_stub.c"), *link],
        check=True,
    )
    subprocess.run(
        ["gcc", "-O2", "-DWITH_CUDART", "-o", str(caller), str(FIXTURES / "cuda_caller.c"), f"-L{sub}"]
        + ["-l:libcudart.so.12", *link, "-pthread"],
        check=True,
    )
    return str(rt), str(caller)


def build(d: Path) -> tuple[str, str]:
    lib, caller = d / "libcuda.so.1", d / "cuda_caller"
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-fno-ipa-icf",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(lib),
            str(FIXTURES / "libcuda_stub.c"),
        ],
        check=True,
    )
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-o",
            str(caller),
            str(FIXTURES / "cuda_caller.c"),
            f"-L{d}",
            "-l:libcuda.so.1",
            f"-Wl,-rpath,{d}",
            "-pthread",
        ],
        check=True,
    )
    return str(lib), str(caller)


class Caller:
    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().startswith("ready")
        self.pid = self.proc.pid

    def cmd(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline().strip()
        assert out.startswith("ok"), out
        return out

    def bench(self, n: int, command: str = "bench") -> tuple[float, float]:
        """(wall seconds, thread CPU seconds) for n launches, timed inside the caller
        (command rtbench: through the runtime)."""
        _, _, _, wall, cpu = self.cmd(f"{command} {n}").split()
        return int(wall) / 1e9, int(cpu) / 1e9

    def close(self) -> None:
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        self.proc.wait()


def per_call(lib: str, caller_path: str, calls: int, attach_mode: str) -> list[tuple[str, tuple[float, float]]]:
    from mscale.probes.ebpf_loader import ROLES, CudaBpf

    roles = {r.prog: r for r in ROLES}
    bpf = CudaBpf(max_pids=4, max_threads=64, attach_mode=attach_mode)
    c = Caller(caller_path)
    try:
        launch_off = bpf.offsets(lib)["on_launch"][:1]  # cuLaunchKernel only
        bpf.add_pid(c.pid)
        c.bench(calls // 10)  # warm up
        rows = [("no probe", c.bench(calls))]
        link = bpf.attach(c.pid, lib, roles["on_launch"], launch_off)
        rows.append(("entry uprobe", c.bench(calls)))
        bpf.detach(link)
        links = [
            bpf.attach(c.pid, lib, roles["on_stream_sync"], launch_off),
            bpf.attach(c.pid, lib, roles["on_sync_return"], launch_off),
        ]
        rows.append(("entry + return uprobe", c.bench(calls)))
        for link in links:
            bpf.detach(link)
        rows.append(("no probe, after detach", c.bench(calls)))
        assert bpf.read_stats()[c.pid].launches == calls  # the probes really ran
        return rows
    finally:
        c.close()
        bpf.close()


def per_runtime_call(lib: str, rt: str, caller_path: str, calls: int, attach_mode: str) -> list:
    from mscale.probes.ebpf_loader import ROLES, CudaBpf

    roles = {r.prog: r for r in ROLES}
    bpf = CudaBpf(max_pids=4, max_threads=64, attach_mode=attach_mode)
    c = Caller(caller_path)
    try:
        c.bench(calls // 10, "rtbench")  # warm up
        bpf.add_pid(c.pid)
        rows = [("no probe", c.bench(calls, "rtbench"))]
        driver = bpf.attach(c.pid, lib, roles["on_launch"], bpf.offsets(lib)["on_launch"])
        rows.append(("driver probe only", c.bench(calls, "rtbench")))
        bpf.detach(driver)
        links = bpf.attach_launches(c.pid, lib, rt)
        rows.append(("both layers, deduped", c.bench(calls, "rtbench")))
        for link in links:
            bpf.detach(link)
        assert bpf.read_stats()[c.pid].launches == 2 * calls  # each launch counted once per phase
        return rows
    finally:
        c.close()
        bpf.close()


def chunk_n(work_ns: int, chunk_s: float) -> int:
    return max(1, int(chunk_s * 1e9 / work_ns))


def pinned_caller(caller_path: str, work_ns: int) -> Caller:
    c = Caller(caller_path)
    c.cmd(f"work {work_ns}")
    os.sched_setaffinity(c.pid, {max(os.sched_getaffinity(0))})  # one CPU: the same neighbours throughout
    return c


def alternating(
    caller_path: str,
    lib: str,
    *,
    work_ns: int,
    chunk_s: float,
    seconds: float,
    repeats: int,
    attach_mode: str,
    trace: bool,
) -> tuple[list[float], list[float]]:
    """Per block: (CPU ratio, wall ratio) of chunks B over chunks A in one process, chunks
    alternating in shuffled pairs. trace: B chunks run with the launch probes attached (A
    detached); else nothing is attached to either (the control)."""
    from mscale.probes.ebpf_loader import ROLES, CudaBpf

    bpf = CudaBpf(max_pids=4, max_threads=64, attach_mode=attach_mode) if trace else None
    c = pinned_caller(caller_path, work_ns)
    n = chunk_n(work_ns, chunk_s)
    rng = random.Random(1)
    cpu_ratios, wall_ratios = [], []
    try:
        if bpf is not None:
            offsets = bpf.offsets(lib)
            bpf.add_pid(c.pid)
        c.bench(n)  # warm up
        for _ in range(repeats):
            sums = {"A": [0.0, 0.0], "B": [0.0, 0.0]}
            deadline = time.monotonic() + seconds / repeats
            while time.monotonic() < deadline:
                order = ["A", "B"]
                rng.shuffle(order)  # neither always first after a switch
                for label in order:
                    links = []
                    if bpf is not None and label == "B":
                        links = [
                            bpf.attach(c.pid, lib, r, offsets[r.prog])
                            for r in ROLES
                            if r.high_rate and offsets.get(r.prog)  # the driver's roles: lib is libcuda
                        ]
                    wall, cpu = c.bench(n)
                    for link in links:
                        bpf.detach(link)
                    sums[label][0] += wall
                    sums[label][1] += cpu
            cpu_ratios.append(sums["B"][1] / sums["A"][1])
            wall_ratios.append(sums["B"][0] / sums["A"][0])
    finally:
        c.close()
        if bpf is not None:
            bpf.close()
    return cpu_ratios, wall_ratios


def duty_cycled(
    caller_path: str, *, work_ns: int, chunk_s: float, periods: float, repeats: int, attach_mode: str
) -> tuple[list[float], float, int, int]:
    """The agent's probe in its default duty-cycled mode on one process: per block, the
    loop's CPU time per launch over the whole cycle against its rate outside the windows.
    Returns (ratios per block, fraction of chunks inside windows, launches seen, made)."""
    from mscale.daemon.config import from_dict
    from mscale.daemon.state import AgentState
    from mscale.probes import spec
    from mscale.probes.base import ProbeContext
    from mscale.probes.ebpf import EbpfProbeSection

    d = EbpfProbeSection()
    cfg = from_dict({"probes": {"ebpf": {"attach_mode": attach_mode}}})
    state = AgentState(node="bench")
    probe = spec("ebpf").factory(
        ProbeContext(config=cfg, emit=state.events.emit, clock=time.time, jobs=state.registered_jobs)
    )
    c = pinned_caller(caller_path, work_ns)
    state.jobs["bench"] = types.SimpleNamespace(job_id="bench", pid=c.pid)
    stop = threading.Event()

    def agent_sampler() -> None:  # the runner's loop: read the maps every interval
        while not stop.is_set():
            probe.sample()
            stop.wait(cfg.probes.ebpf.interval_s)

    probe.sample()  # compile, attach
    sampler = threading.Thread(target=agent_sampler, daemon=True)
    sampler.start()
    n = chunk_n(work_ns, chunk_s)
    ratios, inside, total, made = [], 0, 0, 0
    try:
        c.bench(n)
        for _ in range(repeats):
            on, off = [0.0, 0], [0.0, 0]  # [CPU seconds, chunks]
            deadline = time.monotonic() + periods * d.duty_period_s / repeats
            while time.monotonic() < deadline:
                before = probe.duty_state()
                _, cpu = c.bench(n)
                made += n
                if probe.duty_state() != before:
                    continue  # a window opened or closed during the chunk: neither side
                acc = on if before[1] else off
                acc[0] += cpu
                acc[1] += 1
            if not on[1] or not off[1]:
                continue
            frac = d.duty_window_s / d.duty_period_s
            untraced, traced = off[0] / off[1], on[0] / on[1]
            ratios.append((frac * traced + (1 - frac) * untraced) / untraced)
            inside += on[1]
            total += on[1] + off[1]
    finally:
        stop.set()
        sampler.join()
        snap = probe.sample()
        probe.close()
        c.close()
    seen = snap.processes[0].launches_observed if snap.processes else 0
    return ratios, inside / max(1, total), seen, made


def main(argv: list[str] | None = None) -> int:
    from mscale.probes.ebpf import EbpfProbeSection

    d = EbpfProbeSection()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1_000_000, help="calls per per-call measurement (>= 1,000,000)")
    ap.add_argument("--work-ns", type=int, default=5000, help="CPU work behind each launch in the loop")
    ap.add_argument("--periods", type=float, default=6, help="duty periods the default-mode loop runs for")
    ap.add_argument("--chunk-s", type=float, default=0.1, help="length of one alternating chunk")
    ap.add_argument(
        "--always-on-s", type=float, default=10, help="seconds for the control and the always-on comparison"
    )
    ap.add_argument("--attach-mode", default=d.attach_mode, choices=("auto", "uprobe_multi", "perf_event"))
    ap.add_argument("--repeats", type=int, default=3, help="blocks each comparison is split into")
    add_json_arg(ap)
    args = ap.parse_args(argv)
    rep = Report("ebpf_overhead", args.json)

    from mscale.probes.ebpf_loader import preflight

    preflight()
    with tempfile.TemporaryDirectory(prefix="mscale-ebpf-bench-") as tmp:
        lib, caller = build(Path(tmp))
        print(f"kernel {os.uname().release}, attach mode {args.attach_mode}")
        print(f"\n1. per-call cost on cuLaunchKernel, {args.calls:,} calls each")
        rows = per_call(lib, caller, args.calls, args.attach_mode)
        bare = rows[0][1][1]
        per_hit = (rows[1][1][1] - bare) / args.calls  # CPU seconds an entry uprobe adds per call
        print(f"   {'':24s} {'CPU ns/call':>12s} {'vs bare':>9s} {'wall ns/call':>13s}")
        for name, (wall, cpu) in rows:
            print(f"   {name:24s} {cpu / args.calls * 1e9:12.1f} {cpu / bare:8.1f}x {wall / args.calls * 1e9:13.1f}")

        rep.figure("per call: entry uprobe, CPU ns added", [per_hit * 1e9], unit="ns", show=False)
        for frame_pointer, first in ((True, "push %rbp, emulated"), (False, "sub $n,%rsp, single-stepped")):
            rt, caller_rt = build_runtime(Path(tmp), frame_pointer=frame_pointer)
            print(f"\n1b. cudaLaunchKernel through the runtime ({first}), {args.calls:,} calls each")
            rt_rows = per_runtime_call(lib, rt, caller_rt, args.calls, args.attach_mode)
            rt_bare = rt_rows[0][1][1]
            print(f"   {'':24s} {'CPU ns/call':>12s} {'vs bare':>9s} {'wall ns/call':>13s}")
            for name, (wall, cpu) in rt_rows:
                ns = cpu / args.calls * 1e9
                print(f"   {name:24s} {ns:12.1f} {cpu / rt_bare:8.1f}x {wall / args.calls * 1e9:13.1f}")

        print(f"\n2. launch-bound loop, {args.work_ns} ns of work per launch, one process, alternating chunks")
        kw = dict(work_ns=args.work_ns, chunk_s=args.chunk_s, repeats=args.repeats, attach_mode=args.attach_mode)
        control, control_wall = alternating(caller, lib, seconds=args.always_on_s, trace=False, **kw)
        rep.figure("control: chunks A/B, nothing attached (CPU)", control, unit="x", digits=4)
        rep.figure("control: chunks A/B (wall)", control_wall, unit="x", digits=4)
        ok = abs(statistics.median(control) - 1) <= 0.02 and max(control) - min(control) <= 0.04
        print(f"   control within 1.00 +- 0.02: {'yes' if ok else 'NO: the machine was too noisy'}")
        on, on_wall = alternating(caller, lib, seconds=args.always_on_s, trace=True, **kw)
        rep.figure("always on: attached/detached chunks (CPU)", on, unit="x", digits=4)
        rep.figure("always on: attached/detached chunks (wall)", on_wall, unit="x", digits=4)
        ratios, frac, seen, made = duty_cycled(caller, periods=args.periods, **kw)
        d = EbpfProbeSection()
        print(
            f"   default mode ({d.duty_window_s:g} s every {d.duty_period_s:g} s): {frac:.1%} of the chunks inside a "
            f"window; launches seen {seen:,} of {made:,}"
        )
        if ratios:
            # The default-mode figure is the in-window ratio's excess scaled by the duty
            # fraction, so its noise is the control's scaled the same way.
            frac_duty = d.duty_window_s / d.duty_period_s
            rep.verdict(
                "default mode: added CPU time per launch",
                [r - 1 for r in ratios],
                0.01,
                at_most=True,
                control=[1 + frac_duty * (c - 1) for c in control],
            )
        else:
            print("   default mode: no block held chunks both inside and outside a window: inconclusive")
        rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
