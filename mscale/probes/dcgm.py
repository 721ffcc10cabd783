"""dcgm-exporter input: read NVIDIA dcgm-exporter's /metrics instead of NVML.

Where a node already runs dcgm-exporter (probes.gpu.backend = "dcgm"), the GPU probe reads
its DCGM_FI_DEV_* fields into the same GpuSample and health model. Xids come from
DCGM_EXP_XID_ERRORS_COUNT{xid} increases when the exporter has its xid-errors collector,
else from changes of DCGM_FI_DEV_XID_ERRORS (the last Xid seen; one seen at the first read
counts once). A GPU that disappears from the page is reported lost. dcgm-exporter's default
fields carry NVLink error totals but no per-link state, so NVLink-down is NVML-only.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from mscale.probes.gpu_sample import MHZ, GpuSample, Reading
from mscale.probes.nvml_api import XidEvent, throttle_names

MiB = 1 << 20


class DcgmError(RuntimeError):
    """dcgm-exporter could not be read or its page could not be parsed."""


def parse_page(text: str) -> dict[int, dict[str, object]]:
    """GPU index -> {field name: value, plus 'uuid', 'name' and 'xid_counts': {xid: n}}."""
    gpus: dict[int, dict[str, object]] = defaultdict(lambda: {"xid_counts": {}})
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise DcgmError(f"not a Prometheus exposition page: {e}") from None
    for fam in families:
        for s in fam.samples:
            gpu = s.labels.get("gpu")
            if gpu is None or not gpu.isdigit():
                continue
            g = gpus[int(gpu)]
            g.setdefault("uuid", s.labels.get("UUID", ""))
            g.setdefault("name", s.labels.get("modelName", ""))
            if s.name == "DCGM_EXP_XID_ERRORS_COUNT" and s.labels.get("xid", "").isdigit():
                g["xid_counts"][int(s.labels["xid"])] = int(s.value)  # type: ignore[index]
            else:
                # The parser appends _total to counters; dcgm-exporter's names are its own.
                name = s.name[:-6] if fam.type == "counter" and s.name.endswith("_total") else s.name
                g[name] = s.value
    return dict(gpus)


def _int(g: dict, key: str) -> int | None:
    v = g.get(key)
    return int(v) if v is not None else None


def _flag(g: dict, key: str) -> bool | None:
    v = g.get(key)
    return bool(v) if v is not None else None


def sample_of(index: int, g: dict) -> GpuSample:
    def f(key: str) -> float | None:
        v = g.get(key)
        return float(v) if v is not None else None

    used, free, reserved = f("DCGM_FI_DEV_FB_USED"), f("DCGM_FI_DEV_FB_FREE"), f("DCGM_FI_DEV_FB_RESERVED")
    total = (used + free + (reserved or 0)) * MiB if used is not None and free is not None else None
    mask = g.get("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", g.get("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"))
    util, mem_util = f("DCGM_FI_DEV_GPU_UTIL"), f("DCGM_FI_DEV_MEM_COPY_UTIL")
    sm, memclk = f("DCGM_FI_DEV_SM_CLOCK"), f("DCGM_FI_DEV_MEM_CLOCK")
    tx, rx = f("DCGM_FI_PROF_PCIE_TX_BYTES"), f("DCGM_FI_PROF_PCIE_RX_BYTES")  # bytes/s
    return GpuSample(
        index=index,
        uuid=str(g.get("uuid") or f"GPU-unknown-{index}"),
        name=str(g.get("name") or ""),
        temperature_c=f("DCGM_FI_DEV_GPU_TEMP"),
        power_w=f("DCGM_FI_DEV_POWER_USAGE"),
        power_limit_w=f("DCGM_FI_DEV_POWER_MGMT_LIMIT") or f("DCGM_FI_DEV_ENFORCED_POWER_LIMIT"),
        memory_used_bytes=int(used * MiB) if used is not None else None,
        memory_total_bytes=int(total) if total is not None else None,
        utilization_gpu_ratio=util / 100 if util is not None else None,
        utilization_memory_ratio=mem_util / 100 if mem_util is not None else None,
        sm_clock_hz=sm * MHZ if sm is not None else None,
        memory_clock_hz=memclk * MHZ if memclk is not None else None,
        throttle_reasons=throttle_names(int(mask)) if mask is not None else None,
        ecc_sbe_volatile=_int(g, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"),
        ecc_dbe_volatile=_int(g, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"),
        ecc_sbe_aggregate=_int(g, "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"),
        ecc_dbe_aggregate=_int(g, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"),
        retired_pages_sbe=_int(g, "DCGM_FI_DEV_RETIRED_SBE"),
        retired_pages_dbe=_int(g, "DCGM_FI_DEV_RETIRED_DBE"),
        retired_pages_pending=_flag(g, "DCGM_FI_DEV_RETIRED_PENDING"),
        remapped_rows_correctable=_int(g, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"),
        remapped_rows_uncorrectable=_int(g, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
        remapped_rows_pending=_flag(g, "DCGM_FI_DEV_ROW_REMAP_PENDING"),
        remapped_rows_failed=_flag(g, "DCGM_FI_DEV_ROW_REMAP_FAILURE"),
        pcie_replay_count=_int(g, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"),
        pcie_tx_bytes_per_second=tx,
        pcie_rx_bytes_per_second=rx,
    )


class DcgmReader:
    backend = "dcgm"

    def __init__(self, url: str, *, timeout_s: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        self.url, self.timeout_s, self.clock = url, timeout_s, clock
        self._known: dict[int, GpuSample] = {}  # every GPU seen, for lost detection
        self._xid_counts: dict[int, dict[int, int]] = {}
        self._last_xid: dict[int, int] = {}

    def fetch(self) -> str:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:
                return resp.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as e:
            raise DcgmError(f"cannot read dcgm-exporter at {self.url}: {getattr(e, 'reason', e)}") from None

    def read(self) -> Reading:
        page = parse_page(self.fetch())
        now = self.clock()
        gpus: list[GpuSample] = []
        xids: list[XidEvent] = []
        for index, g in sorted(page.items()):
            sample = sample_of(index, g)
            self._known[index] = sample
            gpus.append(sample)
            xids.extend(XidEvent(index, code, now) for code in self._new_xids(index, g))
        for index, last in sorted(self._known.items()):
            if index not in page:
                gpus.append(
                    GpuSample(
                        index=index,
                        uuid=last.uuid,
                        name=last.name,
                        lost=True,
                        lost_reason="no longer in dcgm-exporter's output",
                    )
                )
        gpus.sort(key=lambda s: s.index)
        return Reading(gpus, xids)

    def _new_xids(self, index: int, g: dict) -> list[int]:
        counts: dict[int, int] = g["xid_counts"]
        if counts:
            before = self._xid_counts.get(index, {})
            self._xid_counts[index] = dict(counts)
            return [code for code, n in sorted(counts.items()) for _ in range(max(0, n - before.get(code, 0)))]
        last = g.get("DCGM_FI_DEV_XID_ERRORS")
        if last is None:
            return []
        code = int(last)
        changed = code != 0 and code != self._last_xid.get(index)
        self._last_xid[index] = code
        return [code] if changed else []

    def xid_source(self) -> None:
        return None  # Xids are polled from the page

    def close(self) -> None:
        pass
