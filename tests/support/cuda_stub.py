"""The stub CUDA driver and runtime (tests/fixtures/libcuda_stub.c, libcudart_stub.c) and the
program that calls them (cuda_caller.c), built with gcc for the eBPF probe's tests; the caller
answers each stdin command once its calls have returned, so a test never sleeps for it."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from support import require_tool

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DEADLINE_S = 20.0


def build_cuda_stubs(d: Path) -> types.SimpleNamespace:
    """libcuda.so.1, libcudart.so.12 (calling into that libcuda) and two callers in `d`:
    `caller` links the driver only, `caller_rt` the runtime and the driver."""
    gcc = require_tool("gcc", why="compiles the stub libcuda.so.1 and libcudart.so.12")
    lib, rt = d / "libcuda.so.1", d / "libcudart.so.12"
    shared = [gcc, "-O2", "-fno-ipa-icf", "-shared", "-fPIC"]
    subprocess.run([*shared, "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(FIXTURES / "libcuda_stub.c")], check=True)
    subprocess.run(
        [*shared, "-Wl,-soname,libcudart.so.12", "-o", str(rt), str(FIXTURES / "libcudart_stub.c")]
        + [f"-L{d}", "-l:libcuda.so.1", f"-Wl,-rpath,{d}"],
        check=True,
    )
    caller, caller_rt = d / "cuda_caller", d / "cuda_caller_rt"
    src = str(FIXTURES / "cuda_caller.c")
    subprocess.run(
        [gcc, "-O2", "-o", str(caller), src, f"-L{d}", "-l:libcuda.so.1", f"-Wl,-rpath,{d}", "-pthread"], check=True
    )
    subprocess.run(
        [gcc, "-O2", "-DWITH_CUDART", "-o", str(caller_rt), src, f"-L{d}", "-l:libcudart.so.12", "-l:libcuda.so.1"]
        + [f"-Wl,-rpath,{d}", "-pthread"],
        check=True,
    )
    return types.SimpleNamespace(lib=str(lib), runtime=str(rt), caller=str(caller), caller_rt=str(caller_rt), dir=d)


class Caller:
    """One cuda_caller process; `cmd` waits for its answer, never a sleep."""

    def __init__(self, path: str, *args: str) -> None:
        self.proc = subprocess.Popen([path, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.pending: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready")
        self.pid = self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float = DEADLINE_S) -> str:
        for i, line in enumerate(self.pending):
            if line.startswith(prefix):
                return self.pending.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"caller never said {prefix!r}; it said {self.pending}") from None
            if line.startswith(prefix):
                return line
            assert not line.startswith("err"), line
            self.pending.append(line)

    def cmd(self, line: str) -> str:
        self.send(line)
        return self.expect(f"ok {line}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def sync_slots(answer: str) -> Counter[int]:
    """The caller's own count of its synchronise calls per log2 slot, read from its answer
    ("ok sync 3 slots=25:3"): what the probe's histogram must hold, late wake-ups included."""
    _, _, tail = answer.partition(" slots=")
    return Counter({int(s): int(n) for s, n in (kv.split(":") for kv in tail.split(",") if kv)})


def register(state: Any, job_id: str, pid: int) -> None:
    # the hook-link room's JobState carries more; the probe reads .pid and .job_id
    state.jobs[job_id] = types.SimpleNamespace(job_id=job_id, pid=pid, rank=0, mpus={})


def poll(probe: Any, cond: Any, what: str, timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    snap = None
    while time.monotonic() < deadline:
        snap = probe.sample()
        if cond(snap):
            return snap
        time.sleep(0.02)  # between samples of a condition with a deadline
    raise AssertionError(f"timed out waiting for {what}; last snapshot {snap}")


def proc_of(snap: Any, pid: int) -> Any:
    return next((p for p in snap.processes if p.pid == pid), None)


def events(state: Any, reason: Any) -> list:
    return [f for _, f in state.events.since(0) if f.reason is reason]


def wait_duty_state(probe: Any, attached: bool) -> tuple[int, bool]:
    """Until the probe's launch/copy probes are attached (a window) or detached (a gap)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        seq, on = probe.duty_state()
        if on == attached:
            return seq, on
        time.sleep(0.002)
    duty = getattr(probe, "_duty", None)
    alive = duty is not None and duty.is_alive()
    raise AssertionError(
        f"duty cycle never {'attached' if attached else 'detached'} in {DEADLINE_S} s"
        f" (state {probe.duty_state()}, duty thread alive: {alive})"
    )


@contextlib.contextmanager
def ebpf_probes() -> Iterator[Callable[..., tuple]]:
    """build(**ebpf_keys) -> (probe, state): eBPF probes on a fresh agent state, duty cycle of
    one second unless the keys say otherwise; every probe built is closed on exit."""
    from mscale.daemon.config import from_dict
    from mscale.daemon.state import AgentState
    from mscale.probes import spec
    from mscale.probes.base import ProbeContext

    made: list[Any] = []

    def build(**ebpf: Any) -> tuple:
        cfg = from_dict({"probes": {"ebpf": {"duty_window_s": 1.0, "duty_period_s": 1.0, **ebpf}}})
        state = AgentState(node="test")
        probe = spec("ebpf").factory(
            ProbeContext(config=cfg, emit=state.events.emit, clock=time.time, jobs=state.registered_jobs)
        )
        made.append(probe)
        return probe, state

    try:
        yield build
    finally:
        for p in made:
            p.close()
