"""Simulated GPUs behind the same `Nvml` protocol the real adapter implements.

N H100- or H200-like GPUs with steady, deterministic readings (a training load), changed
by a fault timeline as the clock passes each event; `inject(event)` applies one now (the
chaos API uses it). Faults change only what they name:

  xid            an Xid event through the event-wait interface; a fatal one (per the Xid
                 table) also sets the recovery action to gpu_reset, as the driver does; Xid 154
                 with recovery_action sets that action and carries the driver's line naming it. An
                 Xid due before anyone listens (`at: 0s`: the reader's first call applies
                 it) waits for the first event source instead of being lost
  ecc_dbe        double-bit ECC counters + count, an uncorrectable row remap pending
  ecc_sbe_storm  single-bit ECC counters grow at per_hour
  temperature    ramps to celsius over ramp; clocks throttle from 87 C (sw) and 90 C (hw)
  nvlink_down    that link reports inactive (and one recovery error)
  pcie_replay_storm  the PCIe replay counter grows at per_min
  gpu_lost       every call on the GPU raises NVML's GPU_IS_LOST error
  recover        a GPU reset: faults cleared, volatile ECC counters zeroed, remaps applied

Page retirement answers NOT_SUPPORTED, as on real H100/H200 (they remap rows instead).
"""

from __future__ import annotations

import math
import threading
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pynvml

from mscale.probes import nvml_api
from mscale.probes.nvml_api import XidEvent
from mscale.sim.timeline import NVLINKS_PER_GPU, FaultEvent, Timeline, load_timeline

MiB = 1 << 20
# name, memory MiB (as NVML reports it), power limit W, max SM MHz, memory MHz
MODELS = {
    "h100": ("NVIDIA H100 80GB HBM3", 81559, 700, 1980, 2619),
    "h200": ("NVIDIA H200", 143771, 700, 1980, 3201),
}
SW_THERMAL_C, HW_THERMAL_C = 87.0, 90.0


# the driver's names for NVML's recovery actions, as its Xid 154 line writes them
_RECOVERY_TEXT = {0: "None", 1: "GPU Reset Required", 2: "Node Reboot Required", 3: "Drain P2P", 4: "Drain and Reset"}


def recovery_message(old: int, new: int) -> str:
    """Xid 154's text: 'GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)'."""
    return (
        f"GPU recovery action changed from {old:#x} ({_RECOVERY_TEXT.get(old, 'Unknown')}) "
        f"to {new:#x} ({_RECOVERY_TEXT.get(new, 'Unknown')})"
    )


def _lost() -> nvml_api.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


@dataclass
class _Gpu:
    index: int
    uuid: str
    lost: bool = False
    # temperature fault: (start time, start C, target C, ramp s)
    heat: tuple[float, float, float, float] | None = None
    sbe_vol: int = 0
    sbe_agg: int = 0
    sbe_storm: tuple[float, float] | None = None  # (start time, per hour)
    dbe_vol: int = 0
    dbe_agg: int = 0
    replay: int = 0
    replay_storm: tuple[float, float] | None = None  # (start time, per minute)
    links_down: set[int] = field(default_factory=set)
    link_recoveries: dict[int, int] = field(default_factory=dict)
    rows_corr: int = 0
    rows_unc: int = 0
    remap_pending: bool = False
    recovery_action: int = nvml_api.RECOVERY_NONE
    faults: list[str] = field(default_factory=list)  # active faults, for faulted_gpus()


class _SimXidEvents:
    def __init__(self, sim: SimNvml) -> None:
        self._sim = sim
        self.queue: deque[XidEvent] = deque()
        self.closed = False

    def wait(self, timeout_ms: int) -> XidEvent | None:
        sim = self._sim
        deadline = time.monotonic() + timeout_ms / 1000
        with sim._cond:
            while True:
                sim._advance()
                if self.queue:
                    return self.queue.popleft()
                remaining = deadline - time.monotonic()
                if self.closed or remaining <= 0:
                    return None
                due = sim._next_due_in()
                sim._cond.wait(min(remaining, due) if due is not None else remaining)

    def close(self) -> None:
        with self._sim._cond:
            self.closed = True
            if self in self._sim._sources:
                self._sim._sources.remove(self)
            self._sim._cond.notify_all()


class SimNvml:
    """`Nvml` for N simulated GPUs. Thread-safe: the probe, the Xid thread and the chaos
    API call it from different threads."""

    def __init__(
        self,
        gpus: int = 8,
        *,
        model: str = "h100",
        events: tuple[FaultEvent, ...] = (),
        clock: Callable[[], float] = time.time,
        seed: str = "mscale-sim",
    ) -> None:
        self.model = model
        self._name, mem_mib, self._power_limit_w, self._sm_mhz, self._mem_mhz = MODELS[model]
        self._mem_total = mem_mib * MiB
        self._clock = clock
        self._t0 = clock()
        self._pending: deque[FaultEvent] = deque(sorted(events, key=lambda e: e.at_s))
        self._cond = threading.Condition(threading.RLock())
        self._sources: list[_SimXidEvents] = []
        self._unheard: deque[XidEvent] = deque()  # Xids applied while no source listened
        self._listeners: list[Callable[[FaultEvent], None]] = []
        self.applied: list[tuple[float, FaultEvent]] = []  # (elapsed s, event), for the demo and tests
        self._gpus = [
            _Gpu(i, "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{seed}/{model}/{i}"))) for i in range(gpus)
        ]
        self.uuids: tuple[str, ...] = tuple(g.uuid for g in self._gpus)

    @classmethod
    def from_timeline(cls, timeline: Timeline, *, clock: Callable[[], float] = time.time) -> SimNvml:
        return cls(timeline.gpus, model=timeline.model, events=timeline.events, clock=clock)

    @classmethod
    def from_timeline_file(cls, path, *, clock: Callable[[], float] = time.time) -> SimNvml:
        return cls.from_timeline(load_timeline(path), clock=clock)

    # --- the fault machinery -------------------------------------------------------------

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def _advance(self) -> None:
        """Apply every timeline event whose time has come (call with the lock held)."""
        now = self.elapsed()
        while self._pending and self._pending[0].at_s <= now:
            ev = self._pending.popleft()
            self._apply(ev, ev.at_s)  # as of its own time, so ramps and storms start on schedule

    def _next_due_in(self) -> float | None:
        if not self._pending:
            return None
        return max(0.001, self._pending[0].at_s - self.elapsed())

    def inject(self, event: FaultEvent) -> None:
        """Apply `event` now, whatever its `at_s` (the chaos API and tests use this)."""
        if not 0 <= event.gpu < len(self._gpus):
            raise ValueError(f"gpu: expected an index 0..{len(self._gpus) - 1}, got {event.gpu}")
        with self._cond:
            self._advance()
            self._apply(event, self.elapsed())

    def on_fault(self, fn: Callable[[FaultEvent], None]) -> None:
        """Call fn(event) (in the applying thread) after each fault is applied."""
        with self._cond:
            self._listeners.append(fn)

    def faulted_gpus(self) -> dict[int, tuple[str, ...]]:
        """GPU index -> its active faults (those not yet cleared by recover)."""
        with self._cond:
            self._advance()
            return {g.index: tuple(g.faults) for g in self._gpus if g.faults}

    def _apply(self, ev: FaultEvent, now: float) -> None:
        g = self._gpus[ev.gpu]
        f = ev.fault
        if f == "xid":
            from mscale.probes.gpu_health import shipped_xid_table  # the driver's own view of severity

            message = ""
            if ev.code == nvml_api.XID_RECOVERY_ACTION_CHANGED and ev.recovery_action is not None:
                # the driver's own line for it, which the probe parses
                message = recovery_message(g.recovery_action, ev.recovery_action)
                g.recovery_action = ev.recovery_action
            elif shipped_xid_table().classify(ev.code or 0).cls == "fatal":
                g.recovery_action = nvml_api.RECOVERY_GPU_RESET
            xid = XidEvent(g.index, int(ev.code or 0), self._clock(), message=message)
            for src in self._sources:
                src.queue.append(xid)
            if not self._sources:
                self._unheard.append(xid)
        elif f == "ecc_dbe":
            g.dbe_vol += ev.count
            g.dbe_agg += ev.count
            g.rows_unc += ev.count
            g.remap_pending = True
        elif f == "ecc_sbe_storm":
            self._fold_storms(g, now)
            g.sbe_storm = (now, float(ev.per_hour or 0))
        elif f == "temperature":
            g.heat = (now, self._temperature(g, now), float(ev.celsius or 0), ev.ramp_s)
        elif f == "nvlink_down":
            assert ev.link is not None
            g.links_down.add(ev.link)
            g.link_recoveries[ev.link] = g.link_recoveries.get(ev.link, 0) + 1
        elif f == "pcie_replay_storm":
            self._fold_storms(g, now)
            g.replay_storm = (now, float(ev.per_min or 0))
        elif f == "gpu_lost":
            g.lost = True
        elif f == "recover":
            self._fold_storms(g, now)
            g.lost, g.heat, g.sbe_storm, g.replay_storm = False, None, None, None
            g.sbe_vol = g.dbe_vol = 0  # a reset clears the volatile counters
            g.links_down.clear()
            g.remap_pending = False
            g.recovery_action = nvml_api.RECOVERY_NONE
        if f == "recover":
            g.faults.clear()
        else:
            g.faults.append(f)
        self.applied.append((now, ev))
        self._cond.notify_all()
        for fn in list(self._listeners):
            fn(ev)

    @staticmethod
    def _storm_count(storm: tuple[float, float] | None, now: float, per_s: float) -> int:
        if storm is None:
            return 0
        return int(max(0.0, now - storm[0]) * storm[1] / per_s)

    def _fold_storms(self, g: _Gpu, now: float) -> None:
        """Turn a running storm's errors into the base counters (before a new rate or a reset)."""
        n = self._storm_count(g.sbe_storm, now, 3600.0)
        g.sbe_vol += n
        g.sbe_agg += n
        if g.sbe_storm is not None:
            g.sbe_storm = (now, g.sbe_storm[1])
        g.replay += self._storm_count(g.replay_storm, now, 60.0)
        if g.replay_storm is not None:
            g.replay_storm = (now, g.replay_storm[1])

    def _temperature(self, g: _Gpu, now: float) -> float:
        base = 52.0 + (g.index % 4) * 1.5 + 3.0 * math.sin(2 * math.pi * now / 120 + g.index)
        if g.heat is None:
            return base
        start, c0, c1, ramp = g.heat
        frac = 1.0 if ramp <= 0 else min(1.0, max(0.0, (now - start) / ramp))
        return c0 + (c1 - c0) * frac

    def _gpu(self, gpu: int) -> tuple[_Gpu, float]:
        with self._cond:
            self._advance()
            g = self._gpus[gpu]
            if g.lost:
                raise _lost()
            return g, self.elapsed()

    # --- the Nvml protocol -------------------------------------------------------------------

    def device_count(self) -> int:
        return len(self._gpus)

    def uuid(self, gpu: int) -> str:
        return self._gpu(gpu)[0].uuid

    def name(self, gpu: int) -> str:
        self._gpu(gpu)
        return self._name

    def temperature_c(self, gpu: int) -> int:
        g, now = self._gpu(gpu)
        return int(round(self._temperature(g, now)))

    def power_mw(self, gpu: int) -> int:
        g, now = self._gpu(gpu)
        watts = 540.0 + 60.0 * math.sin(now / 7 + g.index)
        if self._temperature(g, now) >= SW_THERMAL_C:
            watts *= 0.8
        return int(min(watts, self._power_limit_w) * 1000)

    def power_limit_mw(self, gpu: int) -> int:
        self._gpu(gpu)
        return self._power_limit_w * 1000

    def memory_info(self, gpu: int) -> tuple[int, int]:
        g, _ = self._gpu(gpu)
        used = int(self._mem_total * 0.85) + g.index * 256 * MiB
        return min(used, self._mem_total), self._mem_total

    def utilization(self, gpu: int) -> tuple[int, int]:
        g, now = self._gpu(gpu)
        return 96 - g.index % 3, 58 + int(6 * (1 + math.sin(now / 11 + g.index)))

    def clocks_mhz(self, gpu: int) -> tuple[int, int]:
        g, now = self._gpu(gpu)
        t = self._temperature(g, now)
        sm = self._sm_mhz if t < SW_THERMAL_C else (1755 if t < HW_THERMAL_C else 1410)
        return sm, self._mem_mhz

    def throttle_reasons(self, gpu: int) -> int:
        g, now = self._gpu(gpu)
        t = self._temperature(g, now)
        mask = 0
        if t >= SW_THERMAL_C:
            mask |= pynvml.nvmlClocksThrottleReasonSwThermalSlowdown
        if t >= HW_THERMAL_C:
            mask |= pynvml.nvmlClocksThrottleReasonHwThermalSlowdown
        return mask

    def ecc_errors(self, gpu: int, *, uncorrected: bool, aggregate: bool) -> int:
        g, now = self._gpu(gpu)
        if uncorrected:
            return g.dbe_agg if aggregate else g.dbe_vol
        storm = self._storm_count(g.sbe_storm, now, 3600.0)
        return (g.sbe_agg if aggregate else g.sbe_vol) + storm

    def retired_pages(self, gpu: int) -> tuple[int, int, bool]:
        self._gpu(gpu)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def remapped_rows(self, gpu: int) -> tuple[int, int, bool, bool]:
        g, _ = self._gpu(gpu)
        return g.rows_corr, g.rows_unc, g.remap_pending, False

    def pcie_replay_counter(self, gpu: int) -> int:
        g, now = self._gpu(gpu)
        return g.replay + self._storm_count(g.replay_storm, now, 60.0)

    def pcie_throughput_kbs(self, gpu: int) -> tuple[int, int]:
        g, now = self._gpu(gpu)
        wobble = 1 + 0.1 * math.sin(now / 3 + g.index)
        return int(3_200_000 * wobble), int(5_100_000 * wobble)

    def nvlink_links(self, gpu: int) -> tuple[int, ...]:
        self._gpu(gpu)
        return tuple(range(NVLINKS_PER_GPU))

    def nvlink_up(self, gpu: int, link: int) -> bool:
        g, _ = self._gpu(gpu)
        return link not in g.links_down

    def nvlink_errors(self, gpu: int, link: int) -> nvml_api.NvLinkErrors:
        g, _ = self._gpu(gpu)
        return 0, g.link_recoveries.get(link, 0), 0, 0

    def recovery_action(self, gpu: int) -> int:
        return self._gpu(gpu)[0].recovery_action

    def xid_events(self) -> _SimXidEvents:
        src = _SimXidEvents(self)
        with self._cond:
            self._sources.append(src)
            src.queue.extend(self._unheard)  # the first listener hears what came before it
            self._unheard.clear()
        return src

    def close(self) -> None:
        with self._cond:
            for src in list(self._sources):
                src.closed = True
            self._sources.clear()
            self._cond.notify_all()
