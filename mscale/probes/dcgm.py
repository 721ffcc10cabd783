"""dcgm-exporter input: read NVIDIA dcgm-exporter's /metrics instead of NVML.

Where a node already runs dcgm-exporter (probes.gpu.backend = "dcgm"), the GPU probe reads
its DCGM_FI_* fields into the same GpuSample and health model. Which names it reads, and the
factor to each field's base unit, is data: dcgm_fields.csv lists the legacy names (4.8.x and
earlier: MHz, MiB, percent), the DCGM 4.7 names of exporter 4.9.0 (hertz, bytes, 0-1 ratios)
and the *_BYTES_PER_SECOND profiling names of 4.10.0, with the published source of each.
Where a page carries two names for one field, the newest release's name wins. The driver
version comes from the DCGM_FI_SYSTEM_DRIVER_VERSION label (4.9.0+) or DCGM_FI_DRIVER_VERSION.
Xids come from DCGM_EXP_XID_ERRORS_COUNT{xid} increases when the exporter has its xid-errors
collector, else from changes of the last-Xid field (one seen at the first read counts once).
A GPU that disappears from the page is reported lost. dcgm-exporter's default fields carry
NVLink error totals but no per-link state, so NVLink-down is NVML-only.
"""

from __future__ import annotations

import functools
import re
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mscale.probes import catalogue
from mscale.probes.gpu_sample import GpuSample, Reading
from mscale.probes.nvml_api import XidEvent, throttle_names

# The driver-version label on every metric: renamed in exporter 4.9.0 (newest first).
DRIVER_VERSION_LABELS = ("DCGM_FI_SYSTEM_DRIVER_VERSION", "DCGM_FI_DRIVER_VERSION")


class DcgmError(RuntimeError):
    """dcgm-exporter could not be read or its page could not be parsed."""


class DcgmFieldsError(ValueError):
    """The dcgm field table is malformed (the message names the line)."""


_FLOAT_FIELDS = (
    "temperature_c power_w power_limit_w utilization_gpu_ratio utilization_memory_ratio "
    "sm_clock_hz memory_clock_hz pcie_tx_bytes_per_second pcie_rx_bytes_per_second"
).split()
_INT_FIELDS = (
    "ecc_sbe_volatile ecc_dbe_volatile ecc_sbe_aggregate ecc_dbe_aggregate retired_pages_sbe "
    "retired_pages_dbe remapped_rows_correctable remapped_rows_uncorrectable pcie_replay_count"
).split()
_FLAG_FIELDS = "retired_pages_pending remapped_rows_pending remapped_rows_failed".split()
_INPUTS = "memory_used_bytes memory_total_bytes memory_free_bytes memory_reserved_bytes throttle_mask last_xid".split()
FIELDS = frozenset(_FLOAT_FIELDS + _INT_FIELDS + _FLAG_FIELDS + _INPUTS)
RELEASES = ("legacy", "4.9.0", "4.10.0")  # oldest first: a later one's name wins
_HEADER = ["field", "name", "since", "scale", "source"]
_METRIC = re.compile(r"DCGM_FI_[A-Z0-9_]{1,100}")
_SCALE = re.compile(r"([1-9][0-9]{0,11})(?:/([1-9][0-9]{0,11}))?")


@dataclass(frozen=True)
class FieldName:
    """One name a field has on some exporter release's page, and its factor to the base unit."""

    field: str
    name: str
    since: str
    num: int
    den: int = 1


def _row(cells: list[str], where: str) -> FieldName:
    field, name, since, scale, source = cells
    if field not in FIELDS:
        raise DcgmFieldsError(f"{where}: field: expected one of {', '.join(sorted(FIELDS))}, got {field[:40]!r}")
    if not _METRIC.fullmatch(name):
        raise DcgmFieldsError(f"{where}: name: expected a DCGM_FI_* metric name, got {name[:60]!r}")
    if since not in RELEASES:
        raise DcgmFieldsError(f"{where}: since: expected one of {', '.join(RELEASES)}, got {since[:20]!r}")
    m = _SCALE.fullmatch(scale)
    if not m:
        raise DcgmFieldsError(f"{where}: scale: expected a positive integer or n/d, got {scale[:20]!r}")
    if not source:
        raise DcgmFieldsError(f"{where}: source: expected the published list the name comes from, got nothing")
    return FieldName(field, name, since, int(m[1]), int(m[2] or 1))


def parse_fields(text: str, source: str = "dcgm_fields.csv") -> dict[str, tuple[FieldName, ...]]:
    """field -> its names, the preferred (newest release's) first; file order breaks ties."""
    rows: list[FieldName] = []
    header_seen = False
    for where, line, cells in catalogue.rows(text, source, DcgmFieldsError):
        if not header_seen:
            if cells != _HEADER:
                raise DcgmFieldsError(f"{where}: expected the header {','.join(_HEADER)!r}, got {line[:80]!r}")
            header_seen = True
            continue
        if len(cells) != len(_HEADER):
            raise DcgmFieldsError(f"{where}: expected {len(_HEADER)} columns ({','.join(_HEADER)}), got {len(cells)}")
        row = _row(cells, where)
        if any(r.name == row.name for r in rows):
            raise DcgmFieldsError(f"{where}: name {row.name} is listed twice")
        rows.append(row)
    if not rows:
        raise DcgmFieldsError(f"{source}: no rows (expected the header {','.join(_HEADER)!r} and one row a name)")
    table: dict[str, list[FieldName]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: -RELEASES.index(r.since)):  # sorted() is stable
        table[r.field].append(r)
    return {f: tuple(names) for f, names in table.items()}


@functools.cache
def shipped_fields() -> dict[str, tuple[FieldName, ...]]:
    text = resources.files("mscale.probes").joinpath("dcgm_fields.csv").read_text()
    return parse_fields(text, "dcgm_fields.csv")


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
            if "driver_version" not in g:
                version = next((s.labels[k] for k in DRIVER_VERSION_LABELS if s.labels.get(k)), None)
                if version is not None:
                    g["driver_version"] = version
            if s.name == "DCGM_EXP_XID_ERRORS_COUNT" and s.labels.get("xid", "").isdigit():
                g["xid_counts"][int(s.labels["xid"])] = int(s.value)  # type: ignore[index]
            else:
                # The parser appends _total to counters; dcgm-exporter's names are its own.
                name = s.name[:-6] if fam.type == "counter" and s.name.endswith("_total") else s.name
                g[name] = s.value
    return dict(gpus)


Fields = dict[str, tuple[FieldName, ...]]


def field_values(g: dict, fields: Fields) -> dict[str, float]:
    """field -> value in its base unit, from the first of its names (newest first) on the page."""
    out: dict[str, float] = {}
    for field, names in fields.items():
        for n in names:
            v = g.get(n.name)
            if v is not None:
                out[field] = float(v) * n.num / n.den
                break
    return out


def sample_of(index: int, g: dict, fields: Fields | None = None) -> GpuSample:
    v = field_values(g, shipped_fields() if fields is None else fields)
    used, free, reserved = v.get("memory_used_bytes"), v.get("memory_free_bytes"), v.get("memory_reserved_bytes")
    total = v.get("memory_total_bytes")
    if total is None and used is not None and free is not None:
        total = used + free + (reserved or 0)
    mask = v.get("throttle_mask")
    typed: dict[str, Any] = {k: v.get(k) for k in _FLOAT_FIELDS}
    typed.update({k: int(v[k]) if k in v else None for k in _INT_FIELDS})
    typed.update({k: bool(v[k]) if k in v else None for k in _FLAG_FIELDS})
    return GpuSample(
        index=index,
        uuid=str(g.get("uuid") or f"GPU-unknown-{index}"),
        name=str(g.get("name") or ""),
        memory_used_bytes=int(used) if used is not None else None,
        memory_total_bytes=int(total) if total is not None else None,
        throttle_reasons=throttle_names(int(mask)) if mask is not None else None,
        **typed,
    )


class DcgmReader:
    backend = "dcgm"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        fields: Fields | None = None,
    ) -> None:
        self.url, self.timeout_s, self.clock = url, timeout_s, clock
        self.fields = shipped_fields() if fields is None else fields  # a malformed table stops start-up
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
            sample = sample_of(index, g, self.fields)
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
        last = field_values(g, {"last_xid": self.fields.get("last_xid", ())}).get("last_xid")
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
