"""MSRP in the job: micro-probes per device and each MPU's achieved FLOP/s.

`probe_device(device)` times small kernels on one device: a tensor copy (effective memory
bandwidth, bytes read plus written per second) and a square matmul (dense throughput; bf16 on
a GPU, float32 on the host, whose bf16 path is not what a CPU trains in). On CPU this is the
host's equivalent, so the whole path runs in CI.

`MsrpPlugin` runs them at attach and every `interval_s` after (config contract.msrp_interval_s,
15 minutes by default) for each device its MPUs use, and counts each MPU's forward FLOPs once
(torch.utils.flop_counter.FlopCounterMode around the MPU's first training forward; cached).
Per step the MPU's achieved FLOP/s is 3 x its forward FLOPs (forward plus a backward of about
twice the forward) over its forward + backward time from the guard's timings (the forward
FLOPs alone when it had no backward). Every `report_s` it sends the profiles to the agent
({"type": "msrp"}); `msrp_profiles()` gives them to the standby choice
(mscale.contracts.msrp.choose_standby) and, through mscale.contracts.msrp.msrp_binding, to every snapshot's
resource_binding.json (an "msrp" entry per MPU).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

import torch
from torch.utils.flop_counter import FlopCounterMode

from mscale import link as protocol

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard

CPU_COPY_BYTES, GPU_COPY_BYTES = 8 << 20, 64 << 20
CPU_MATMUL_N, GPU_MATMUL_N = 256, 2048
STEP_FLOPS_FACTOR = 3.0  # forward + backward (about twice the forward)


class DeviceProfile(TypedDict):
    """A device's micro-probe results (`probe_device`), as the MSRP message carries them."""

    bandwidth_bytes_per_s: float
    matmul_flops: float
    dtype: str
    measured_at: float


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after one warm-up, synchronised on a GPU."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def probe_device(device: torch.device | str, *, repeats: int = 5) -> DeviceProfile:
    """The device's profile (bandwidth, matmul FLOP/s, the matmul's dtype, when) measured on `device`."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    size = GPU_COPY_BYTES if gpu else CPU_COPY_BYTES
    with torch.no_grad():
        src = torch.ones(size // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        copy_s = _timed(lambda: dst.copy_(src), device, repeats)
        n, dtype = (GPU_MATMUL_N, torch.bfloat16) if gpu else (CPU_MATMUL_N, torch.float32)
        a = torch.ones(n, n, dtype=dtype, device=device)
        b = torch.ones(n, n, dtype=dtype, device=device)
        mm_s = _timed(lambda: torch.mm(a, b), device, repeats)
    return {  # (a DeviceProfile)
        "bandwidth_bytes_per_s": 2.0 * size / copy_s,
        "matmul_flops": 2.0 * n**3 / mm_s,
        "dtype": str(dtype).removeprefix("torch."),
        "measured_at": time.time(),
    }


def mpu_memory_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> float:
    """Bytes the MPU holds: its parameters, their gradients and their optimizer state."""
    params = list(module.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state = getattr(optimizer, "state", {}) if optimizer is not None else {}
    for p in params:
        for v in (state.get(p) or {}).values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return float(total)


class _FlopCount:
    """Counts one MPU's forward FLOPs on its first training-mode forward, then unhooks."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.flops: float | None = None
        self._mode: FlopCounterMode | None = None
        self._handles = [
            module.register_forward_pre_hook(self._pre),
            # first among the post hooks, so the guard's checksums are not counted as the MPU's
            # work; always_call: a forward that raises still leaves the counting mode
            module.register_forward_hook(self._post, prepend=True, always_call=True),
        ]

    def _pre(self, module: torch.nn.Module, args: tuple[object, ...]) -> None:
        if self.flops is None and self._mode is None and module.training and torch.is_grad_enabled():
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()

    def _post(self, module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        if output is None:  # the forward raised (always_call passes no result): count the next one
            return
        self.flops = float(mode.get_total_flops())
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class MsrpPlugin:
    """Measures and reports the MSRP of the job's devices and MPUs (see the module docstring)."""

    def __init__(
        self,
        *,
        interval_s: float = 900.0,
        report_s: float = 10.0,
        probe: Callable[[torch.device], DeviceProfile] = probe_device,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s, self.report_s = interval_s, report_s
        self.probe, self.clock = probe, clock
        self.guard: Guard | None = None
        self.devices: dict[int, DeviceProfile] = {}  # GPU index -> device profile
        self.mpus: dict[str, dict[str, float]] = {}  # mpu_id -> MPU profile
        self._counts: dict[str, _FlopCount] = {}
        self._achieved: dict[str, deque[float]] = {}
        self._probed_at = -float("inf")
        self._reported_at = -float("inf")

    def on_attach(self, guard: Guard) -> None:
        self.guard = guard
        self._counts = {m.mpu_id: _FlopCount(m.module) for m in guard.mpus}
        self._probe(guard)

    def on_detach(self, guard: Guard) -> None:
        for c in self._counts.values():
            c.remove()

    def _probe(self, guard: Guard) -> None:
        by_device: dict[str, DeviceProfile] = {}
        for m in guard.mpus:
            key = str(m.device)
            if key not in by_device:
                by_device[key] = self.probe(m.device)
            self.devices[m.gpu] = by_device[key]
        if any(m.device.type == "cuda" for m in guard.mpus):
            # every GPU of the node, so that a standby is chosen by measurement too
            for i in range(torch.cuda.device_count()):
                key = f"cuda:{i}"
                self.devices[i] = by_device.get(key) or self.probe(torch.device(key))
        self._probed_at = self.clock()

    def on_step_end(self, step: int, loss: float | None) -> None:
        guard = self.guard
        if guard is None:  # steps end only on the guard it is attached to
            return
        for m in guard.mpus:
            count = self._counts.get(m.mpu_id)
            if count is None or count.flops is None:
                continue
            seconds = m.forward_s + m.backward_s
            if seconds <= 0:
                continue
            step_flops = count.flops * (STEP_FLOPS_FACTOR if m.backward_s > 0 else 1.0)
            recent = self._achieved.setdefault(m.mpu_id, deque(maxlen=9))
            recent.append(step_flops / seconds)
            self.mpus[m.mpu_id] = {
                "flops_per_step": step_flops,
                "achieved_flops": statistics.median(recent),  # robust to one slow step
                "memory_bytes": mpu_memory_bytes(m.module, guard.optimizer),
            }
        now = self.clock()
        if now - self._probed_at >= self.interval_s:
            self._probe(guard)
        if self.mpus and now - self._reported_at >= self.report_s:
            self._reported_at = now
            guard.send_to_agent(
                protocol.Msrp(
                    guard.job_id,
                    guard.rank,
                    {str(g): dict(p) for g, p in self.devices.items()},
                    {k: dict(v) for k, v in self.mpus.items()},
                ).to_wire()
            )

    def msrp_profiles(self) -> tuple[dict[int, DeviceProfile], dict[str, dict[str, float]]]:
        return dict(self.devices), dict(self.mpus)
