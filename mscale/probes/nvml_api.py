"""The NVML calls the agent uses, as one small protocol, and the real adapter over pynvml.

The GPU probe reads only through `Nvml`; the simulated GPUs (mscale.sim.nvml.SimNvml) and
`RealNvml` implement it, so tests exercise the same probe code a GPU node runs. Methods take
a GPU index and return plain values in NVML's own units (the probe converts to base units).
Errors are pynvml's `NVMLError` subclasses, real or simulated: a GPU that has fallen off
the bus raises `NVMLError_GpuIsLost`, a field the GPU lacks raises `NVMLError_NotSupported`.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import pynvml

from mscale.probes.base import ProbeUnavailable

NVMLError = pynvml.NVMLError
GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED

# Clock throttle ("clocks event") reasons by name: the probe reports names, not the bitmask.
THROTTLE_REASONS: dict[str, int] = {
    "gpu_idle": pynvml.nvmlClocksThrottleReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksThrottleReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksThrottleReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksThrottleReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksThrottleReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksThrottleReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksThrottleReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksThrottleReasonDisplayClockSetting,
}

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values: what the driver says the GPU needs.
RECOVERY_ACTIONS: dict[int, str] = {
    pynvml.NVML_GPU_RECOVERY_ACTION_NONE: "none",
    pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET: "gpu_reset",
    pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT: "node_reboot",
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P: "drain_p2p",
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET: "drain_and_reset",
}
RECOVERY_NONE = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
RECOVERY_GPU_RESET = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for name, bit in THROTTLE_REASONS.items() if mask & bit)


class GpuUnopened(pynvml.NVMLError):
    """Every call on a GPU whose handle NVML refused at start (with that refusal's code):
    the agent cannot watch it, so it counts as lost, with NVML's reason."""


def is_gpu_lost(e: BaseException) -> bool:
    """The whole GPU is out of reach: fallen off the bus, or never opened."""
    return isinstance(e, GpuUnopened) or (isinstance(e, NVMLError) and getattr(e, "value", None) == GPU_IS_LOST)


def is_not_supported(e: BaseException) -> bool:
    return isinstance(e, NVMLError) and getattr(e, "value", None) == NOT_SUPPORTED


# (replay, recovery, CRC flit, CRC data); None: a counter this GPU does not report
NvLinkErrors = tuple[int | None, int | None, int | None, int | None]


class NvmlUnavailable(ProbeUnavailable):
    """No NVIDIA driver or no libnvidia-ml here: the GPU probe reports down with this reason."""


XID_RECOVERY_ACTION_CHANGED = 154  # the driver names the recovery action it now requires


class XidEvent(NamedTuple):
    gpu: int  # index
    xid: int
    time: float  # Unix time the agent received it
    message: str = ""  # the driver's text, where the source carries it (NVML's events do not)
    recovery_action: int | None = None  # Xid 154: NVML's recovery-action field, read at once


@runtime_checkable
class XidEventSource(Protocol):
    def wait(self, timeout_ms: int) -> XidEvent | None:
        """Block up to timeout_ms for the next Xid; None when none came."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Nvml(Protocol):
    """The NVML calls we use (nvmlDevice*), by GPU index, in NVML's units."""

    def device_count(self) -> int: ...
    def uuid(self, gpu: int) -> str: ...
    def name(self, gpu: int) -> str: ...
    def temperature_c(self, gpu: int) -> int: ...
    def power_mw(self, gpu: int) -> int: ...
    def power_limit_mw(self, gpu: int) -> int: ...
    def memory_info(self, gpu: int) -> tuple[int, int]:
        """(used bytes, total bytes)"""
        ...

    def utilization(self, gpu: int) -> tuple[int, int]:
        """(GPU %, memory %) over NVML's last sample period"""
        ...

    def clocks_mhz(self, gpu: int) -> tuple[int, int]:
        """(SM clock, memory clock) in MHz"""
        ...

    def throttle_reasons(self, gpu: int) -> int:
        """bitmask of THROTTLE_REASONS"""
        ...

    def ecc_errors(self, gpu: int, *, uncorrected: bool, aggregate: bool) -> int: ...
    def retired_pages(self, gpu: int) -> tuple[int, int, bool]:
        """(pages retired for single-bit errors, for double-bit errors, retirement pending)"""
        ...

    def remapped_rows(self, gpu: int) -> tuple[int, int, bool, bool]:
        """(correctable rows, uncorrectable rows, remap pending, remap failed)"""
        ...

    def pcie_replay_counter(self, gpu: int) -> int: ...
    def pcie_throughput_kbs(self, gpu: int) -> tuple[int, int]:
        """(TX, RX) in KB/s (NVML's KB: 1024 bytes)"""
        ...

    def nvlink_links(self, gpu: int) -> tuple[int, ...]:
        """the link numbers this GPU has (empty on PCIe cards)"""
        ...

    def nvlink_up(self, gpu: int, link: int) -> bool: ...
    def nvlink_errors(self, gpu: int, link: int) -> NvLinkErrors:
        """(replay, recovery, CRC flit, CRC data) error counters; None for a counter the
        GPU does not report (the others still count)"""
        ...

    def recovery_action(self, gpu: int) -> int:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (RECOVERY_ACTIONS)"""
        ...

    def xid_events(self) -> XidEventSource: ...
    def close(self) -> None: ...


# --- the real adapter ---------------------------------------------------------------------


class _RealXidEvents:
    """nvmlEventSetCreate + nvmlDeviceRegisterEvents(XidCriticalError) + nvmlEventSetWait."""

    def __init__(self, handles: list) -> None:
        """Raise NvmlUnavailable naming the NVML error when the event set cannot be set up
        (the GPU probe then reports down with that reason; the agent keeps serving)."""
        try:
            self._set = pynvml.nvmlEventSetCreate()
        except NVMLError as e:
            raise NvmlUnavailable(f"NVML Xid events could not be set up: nvmlEventSetCreate: {e}") from None
        self._lock = threading.Lock()
        for h in handles:
            if h is None:  # a GPU whose handle failed at open: nothing to listen to
                continue
            try:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._set)
            except NVMLError as e:  # a GPU without Xid events, or already gone: listen to the rest
                if not is_not_supported(e) and not is_gpu_lost(e):
                    self.close()
                    raise NvmlUnavailable(
                        f"NVML Xid events could not be set up: nvmlDeviceRegisterEvents: {e}"
                    ) from None

    def wait(self, timeout_ms: int) -> XidEvent | None:
        try:
            data = pynvml.nvmlEventSetWait_v2(self._set, timeout_ms)
        except NVMLError as e:
            if getattr(e, "value", None) == pynvml.NVML_ERROR_TIMEOUT:
                return None
            raise
        if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return None
        try:
            gpu = pynvml.nvmlDeviceGetIndex(data.device)
        except NVMLError:
            gpu = -1  # the device went away between the event and the lookup
        xid = int(data.eventData)
        action = None
        if xid == XID_RECOVERY_ACTION_CHANGED:  # NVML's event has no text: the field says it
            try:
                (v,) = pynvml.nvmlDeviceGetFieldValues(data.device, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
                action = int(v.value.uiVal) if v.nvmlReturn == pynvml.NVML_SUCCESS else None
            except NVMLError:  # not exported, or the GPU went away: the table's row stands
                action = None
        return XidEvent(gpu, xid, time.time(), recovery_action=action)

    def close(self) -> None:
        with self._lock:
            if self._set is not None:
                try:
                    pynvml.nvmlEventSetFree(self._set)
                except NVMLError:
                    pass
                self._set = None


class RealNvml:
    """`Nvml` over pynvml. Handles are taken once at open, so a GPU lost later still has
    an index and a UUID to report under."""

    def __init__(self) -> None:
        # A GPU whose handle fails (fallen off the bus before we started) keeps its index:
        # every call on it raises that error, and the other GPUs are probed as usual.
        self._handles: list = []
        self._handle_errors: dict[int, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                self._handles.append(pynvml.nvmlDeviceGetHandleByIndex(i))
            except NVMLError as e:
                self._handles.append(None)
                self._handle_errors[i] = int(getattr(e, "value", pynvml.NVML_ERROR_UNKNOWN))
        self._uuids: dict[int, str] = {}
        self._links: dict[int, tuple[int, ...]] = {}

    def _h(self, gpu: int):
        h = self._handles[gpu]
        if h is None:
            raise GpuUnopened(self._handle_errors[gpu])
        return h

    def device_count(self) -> int:
        return len(self._handles)

    def uuid(self, gpu: int) -> str:
        if gpu not in self._uuids:
            self._uuids[gpu] = _text(pynvml.nvmlDeviceGetUUID(self._h(gpu)))
        return self._uuids[gpu]

    def name(self, gpu: int) -> str:
        return _text(pynvml.nvmlDeviceGetName(self._h(gpu)))

    def temperature_c(self, gpu: int) -> int:
        return pynvml.nvmlDeviceGetTemperature(self._h(gpu), pynvml.NVML_TEMPERATURE_GPU)

    def power_mw(self, gpu: int) -> int:
        return pynvml.nvmlDeviceGetPowerUsage(self._h(gpu))

    def power_limit_mw(self, gpu: int) -> int:
        return pynvml.nvmlDeviceGetEnforcedPowerLimit(self._h(gpu))

    def memory_info(self, gpu: int) -> tuple[int, int]:
        m = pynvml.nvmlDeviceGetMemoryInfo(self._h(gpu))
        return int(m.used), int(m.total)

    def utilization(self, gpu: int) -> tuple[int, int]:
        u = pynvml.nvmlDeviceGetUtilizationRates(self._h(gpu))
        return int(u.gpu), int(u.memory)

    def clocks_mhz(self, gpu: int) -> tuple[int, int]:
        h = self._h(gpu)
        return (
            pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
        )

    def throttle_reasons(self, gpu: int) -> int:
        try:
            return pynvml.nvmlDeviceGetCurrentClocksEventReasons(self._h(gpu))
        except NVMLError as e:  # drivers before the rename only have the old name
            if getattr(e, "value", None) != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            return pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(self._h(gpu))

    def ecc_errors(self, gpu: int, *, uncorrected: bool, aggregate: bool) -> int:
        kind = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED if uncorrected else pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        counter = pynvml.NVML_AGGREGATE_ECC if aggregate else pynvml.NVML_VOLATILE_ECC
        return int(pynvml.nvmlDeviceGetTotalEccErrors(self._h(gpu), kind, counter))

    def retired_pages(self, gpu: int) -> tuple[int, int, bool]:
        h = self._h(gpu)
        sbe = len(pynvml.nvmlDeviceGetRetiredPages(h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS))
        dbe = len(pynvml.nvmlDeviceGetRetiredPages(h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        return sbe, dbe, bool(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h))

    def remapped_rows(self, gpu: int) -> tuple[int, int, bool, bool]:
        corr, unc, pending, failed = pynvml.nvmlDeviceGetRemappedRows(self._h(gpu))
        return int(corr), int(unc), bool(pending), bool(failed)

    def pcie_replay_counter(self, gpu: int) -> int:
        return int(pynvml.nvmlDeviceGetPcieReplayCounter(self._h(gpu)))

    def pcie_throughput_kbs(self, gpu: int) -> tuple[int, int]:
        h = self._h(gpu)
        return (
            pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES),
            pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES),
        )

    def nvlink_links(self, gpu: int) -> tuple[int, ...]:
        # Links are probed once: a link absent on this board answers NOT_SUPPORTED or
        # INVALID_ARGUMENT; one present but down answers 0.
        if gpu not in self._links:
            links = []
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    pynvml.nvmlDeviceGetNvLinkState(self._h(gpu), link)
                except NVMLError as e:
                    if is_gpu_lost(e):
                        raise
                    continue
                links.append(link)
            self._links[gpu] = tuple(links)
        return self._links[gpu]

    def nvlink_up(self, gpu: int, link: int) -> bool:
        return pynvml.nvmlDeviceGetNvLinkState(self._h(gpu), link) == pynvml.NVML_FEATURE_ENABLED

    def nvlink_errors(self, gpu: int, link: int) -> NvLinkErrors:
        # One counter the driver does not report (NOT_SUPPORTED, ...) is None on its own;
        # a GPU that fell off the bus fails the whole call.
        h = self._h(gpu)

        def counter(c: int) -> int | None:
            try:
                return int(pynvml.nvmlDeviceGetNvLinkErrorCounter(h, link, c))
            except NVMLError as e:
                if is_gpu_lost(e):
                    raise
                return None

        return (
            counter(pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
            counter(pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
            counter(pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
            counter(pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
        )

    def recovery_action(self, gpu: int) -> int:
        (v,) = pynvml.nvmlDeviceGetFieldValues(self._h(gpu), [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
        if v.nvmlReturn != pynvml.NVML_SUCCESS:
            raise NVMLError(v.nvmlReturn)
        return int(v.value.uiVal)

    def xid_events(self) -> XidEventSource:
        return _RealXidEvents(self._handles)

    def close(self) -> None:
        try:
            pynvml.nvmlShutdown()
        except NVMLError:
            pass


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def open_real_nvml() -> RealNvml:
    """Initialise NVML. Without a driver or libnvidia-ml, raise NvmlUnavailable (a clean
    'not there': the agent runs, the GPU probe reports down with this reason)."""
    try:
        pynvml.nvmlInit()
    except NVMLError as e:
        raise NvmlUnavailable(f"NVML not available: {e}") from None
    except OSError as e:  # the library loaded but a symbol or dependency is missing
        raise NvmlUnavailable(f"NVML not available: {e}") from None
    try:
        return RealNvml()
    except NVMLError as e:
        pynvml.nvmlShutdown()
        raise NvmlUnavailable(f"NVML initialised but listing GPUs failed: {e}") from None


if TYPE_CHECKING:
    # The typed proof that the real adapter satisfies the protocol (checked by mypy/pyright;
    # tests/test_gpu_probe.py checks the same at run time, signatures included).
    _real_is_nvml: Nvml = RealNvml()
    _real_events_is_source: XidEventSource = _RealXidEvents([])
