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
   CPU work, like the CPU side of a real launch) under the probe in its default
   duty-cycled mode, against the same loop in an untraced twin process. The two processes
   run in alternating chunks on the same CPU, so machine noise falls on both; the agent
   side (duty-cycle thread, map reads every interval) runs as in the agent. The loop's
   thread CPU time (a uprobe trap is charged to it, preemption by other work is not) is
   the figure on a shared machine; its wall time is printed beside it, and equals it on a
   dedicated core. A control run with neither process traced shows the noise floor; the
   always-on mode is measured the same way for comparison.

Needs root (or CAP_BPF + CAP_PERFMON), BCC and gcc. Run: .venv/bin/python benchmarks/ebpf_overhead.py
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

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


def loop_overhead(
    caller_path: str,
    *,
    window_s: float,
    period_s: float,
    work_ns: int,
    seconds: float,
    chunk_s: float,
    attach_mode: str,
    trace: bool = True,
) -> tuple[list[float], list[float], int, int]:
    """([wall, cpu] seconds traced, [wall, cpu] twin, launches seen, launches made) over
    alternating chunks. trace=False registers nobody: the control, both processes bare."""
    from mscale.config import from_dict
    from mscale.daemon.state import AgentState
    from mscale.probes import spec
    from mscale.probes.base import ProbeContext

    cfg = from_dict(
        {"probes": {"ebpf": {"duty_window_s": window_s, "duty_period_s": period_s, "attach_mode": attach_mode}}}
    )
    state = AgentState(node="bench")
    probe = spec("ebpf").factory(ProbeContext(config=cfg, state=state, emit=state.events.emit, clock=time.time))
    traced, twin = Caller(caller_path), Caller(caller_path)
    cpu = max(os.sched_getaffinity(0))
    for c in (traced, twin):
        c.cmd(f"work {work_ns}")
        os.sched_setaffinity(c.pid, {cpu})  # the same CPU, so the same neighbours
    if trace:
        state.jobs["bench"] = types.SimpleNamespace(job_id="bench", pid=traced.pid)
    stop = threading.Event()
    snaps = []

    def agent_sampler() -> None:  # the runner's loop: read the maps every interval
        while not stop.is_set():
            snaps.append(probe.sample())
            stop.wait(cfg.probes.ebpf.interval_s)

    probe.sample()  # compile, attach
    sampler = threading.Thread(target=agent_sampler, daemon=True)
    sampler.start()
    n = max(1, int(chunk_s * 1e9 / work_ns))
    t_traced, t_twin = [0.0, 0.0], [0.0, 0.0]
    chunks = 0
    rng = random.Random(1)
    try:
        traced.bench(n), twin.bench(n)  # warm up
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            order = [(traced, True), (twin, False)]
            rng.shuffle(order)  # neither always first after a switch
            for c, is_traced in order:
                wall, cpu = c.bench(n)
                acc = t_traced if is_traced else t_twin
                acc[0] += wall
                acc[1] += cpu
            chunks += 1
    finally:
        stop.set()
        sampler.join()
        snap = probe.sample()
        probe.close()
        traced.close()
        twin.close()
    seen = snap.processes[0].launches_observed if snap.processes else 0
    return t_traced, t_twin, seen, chunks * n + n


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
    args = ap.parse_args(argv)

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

        for frame_pointer, first in ((True, "push %rbp, emulated"), (False, "sub $n,%rsp, single-stepped")):
            rt, caller_rt = build_runtime(Path(tmp), frame_pointer=frame_pointer)
            print(f"\n1b. cudaLaunchKernel through the runtime ({first}), {args.calls:,} calls each")
            rt_rows = per_runtime_call(lib, rt, caller_rt, args.calls, args.attach_mode)
            rt_bare = rt_rows[0][1][1]
            print(f"   {'':24s} {'CPU ns/call':>12s} {'vs bare':>9s} {'wall ns/call':>13s}")
            for name, (wall, cpu) in rt_rows:
                ns = cpu / args.calls * 1e9
                print(f"   {name:24s} {ns:12.1f} {cpu / rt_bare:8.1f}x {wall / args.calls * 1e9:13.1f}")

        print(f"\n2. launch-bound loop, {args.work_ns} ns of work per launch, traced vs untraced twin")
        for label, window, period, seconds, trace in (
            ("control, neither traced (noise floor)", d.duty_window_s, d.duty_period_s, args.always_on_s, False),
            (
                f"default duty cycle ({d.duty_window_s:g} s every {d.duty_period_s:g} s)",
                d.duty_window_s,
                d.duty_period_s,
                args.periods * d.duty_period_s,
                True,
            ),
            ("always on (for comparison)", 1.0, 1.0, args.always_on_s, True),
        ):
            t_tr, t_tw, seen, made = loop_overhead(
                caller,
                window_s=window,
                period_s=period,
                work_ns=args.work_ns,
                seconds=seconds,
                chunk_s=args.chunk_s,
                attach_mode=args.attach_mode,
                trace=trace,
            )
            cpu, wall = t_tr[1] / t_tw[1], t_tr[0] / t_tw[0]
            print(
                f"   {label}:\n"
                f"      CPU time of the loop, traced/untraced = {cpu:.4f} (added {100 * (cpu - 1):+.2f}%; "
                f"{t_tr[1]:.1f} s vs {t_tw[1]:.1f} s)\n"
                f"      wall time, traced/untraced           = {wall:.4f} (added {100 * (wall - 1):+.2f}%; "
                f"includes preemption by other work on this machine)\n"
                f"      launches seen {seen:,} of {made:,} = {seen / made:.1%}; expected from part 1: "
                f"{seen / made:.3f} x {per_hit * 1e9:.0f} ns / {args.work_ns} ns = "
                f"{100 * seen / made * per_hit * 1e9 / args.work_ns:+.2f}%"
            )
        print("\n   target: under 1% added in the default mode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
