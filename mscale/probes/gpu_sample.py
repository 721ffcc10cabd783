"""What the GPU probe publishes: one GpuSample per GPU in a frozen GpuSnapshot, and the
Reader interface its backends (NVML, simulated, dcgm-exporter) implement. Data only, so the
backends and the exporters share it without importing the probe."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from mscale.probes import nvml_api
from mscale.probes.gpu_health import HEALTHY
from mscale.probes.nvml_api import XidEvent

MHZ = 1_000_000


@dataclass(frozen=True)
class NvLinkSample:
    link: int
    up: bool
    replay_errors: int | None = None
    recovery_errors: int | None = None
    crc_flit_errors: int | None = None
    crc_data_errors: int | None = None


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one time, in base units. None: the GPU does not report that field."""

    index: int
    uuid: str
    name: str = ""
    health: str = HEALTHY  # healthy | degraded | failed
    reasons: tuple[str, ...] = ()
    lost: bool = False
    lost_reason: str = ""
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None
    sm_clock_hz: float | None = None
    memory_clock_hz: float | None = None
    throttle_reasons: tuple[str, ...] | None = None  # names from nvml_api.THROTTLE_REASONS
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    pcie_replay_count: int | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    nvlinks: tuple[NvLinkSample, ...] = ()
    recovery_action: int | None = None
    xid_errors: tuple[tuple[int, int], ...] = ()  # (xid, count since the agent started)
    xid_actions: tuple[tuple[int, str], ...] = ()  # (xid, NVIDIA's immediate action from the Xid table)
    last_xid: int | None = None
    resets: int = 0  # GPU resets the health model saw since the agent started (remediation undoes on one)
    sbe_per_hour: float | None = None
    pcie_replays_per_min: float | None = None


@dataclass(frozen=True)
class GpuSnapshot:
    time: float
    backend: str  # nvml | sim | dcgm
    gpus: tuple[GpuSample, ...]

    def by_index(self, index: int) -> GpuSample | None:
        return next((g for g in self.gpus if g.index == index), None)


@dataclass
class Reading:
    gpus: list[GpuSample]
    xids: list[XidEvent] = dataclasses.field(default_factory=list)  # Xids found by polling (dcgm)


class Reader(Protocol):
    backend: str

    def read(self) -> Reading: ...

    def xid_source(self) -> nvml_api.XidEventSource | None: ...

    def close(self) -> None: ...
