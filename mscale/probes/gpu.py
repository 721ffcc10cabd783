"""GPU probe: per-GPU readings from NVML (or a dcgm-exporter endpoint), health, Xid events.

Each sample reads every GPU through a reader (NvmlReader over the `Nvml` protocol, real or
simulated; or mscale.probes.dcgm.DcgmReader), judges health with
mscale.probes.gpu_health.HealthModel and publishes a frozen GpuSnapshot. Xid events arrive
on a thread of their own (NVML's event API): each is one finding at once, and is folded
into the counters and health at the next sample. A GPU that has fallen off the bus is
reported as lost (health failed), never crashed on. Findings: one per Xid, one per new
health reason, and one (recovered / health changed) when the state moves otherwise.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from mscale.findings import Finding, Reason, Severity
from mscale.options import opt
from mscale.probes import nvml_api
from mscale.probes.base import ProbeContext, ProbeSpec
from mscale.probes.gpu_health import FAILED, HEALTHY, STATES, XID_RECOVERY_ACTION_CHANGED, HealthModel, XidInfo
from mscale.probes.gpu_sample import MHZ, GpuSample, GpuSnapshot, NvLinkSample, Reader, Reading
from mscale.probes.nvml_api import Nvml, NVMLError, XidEvent, is_gpu_lost

log = structlog.get_logger("mscale.probes.gpu")
_XID_SEVERITY = {"fatal": Severity.CRITICAL, "degrading": Severity.WARNING, "info": Severity.INFO}
# what the finding tells the operator per NVIDIA's immediate action (docs/xid.md)
_XID_ADVICE = {
    "RESET_GPU": "; reset the GPU",
    "RESTART_BM": "; drain the node and reboot it",
    "RESTART_APP": "; the job recovers in-process",
}
_STATE_SEVERITY = {FAILED: Severity.CRITICAL, "degraded": Severity.WARNING, HEALTHY: Severity.INFO}


def _opt(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """A field the GPU lacks (NOT_SUPPORTED, NO_PERMISSION, ...) is no data, not a failure.
    GPU_IS_LOST propagates: the whole GPU is gone."""
    try:
        return fn(*args, **kw)
    except NVMLError as e:
        if is_gpu_lost(e):
            raise
        return None


class NvmlReader:
    """Reads each GPU through the `Nvml` protocol."""

    def __init__(self, nvml: Nvml, *, backend: str = "nvml", owns: bool = False) -> None:
        self.nvml, self.backend, self._owns = nvml, backend, owns
        self.count = nvml.device_count()
        # Identity is taken once, so a GPU lost later keeps its labels.
        self.uuids: list[str] = []
        self.names: list[str] = []
        for i in range(self.count):
            try:
                self.uuids.append(nvml.uuid(i))
                self.names.append(_opt(nvml.name, i) or "")
            except NVMLError:
                self.uuids.append(f"GPU-unknown-{i}")
                self.names.append("")

    def read_gpu(self, i: int) -> GpuSample:
        n = self.nvml
        base = GpuSample(index=i, uuid=self.uuids[i], name=self.names[i])
        try:
            mem = _opt(n.memory_info, i)
            util = _opt(n.utilization, i)
            clocks = _opt(n.clocks_mhz, i)
            mask = _opt(n.throttle_reasons, i)
            pages = _opt(n.retired_pages, i)
            rows = _opt(n.remapped_rows, i)
            pcie = _opt(n.pcie_throughput_kbs, i)
            power = _opt(n.power_mw, i)
            limit = _opt(n.power_limit_mw, i)
            links = []
            for link in _opt(n.nvlink_links, i) or ():
                up = _opt(n.nvlink_up, i, link)
                if up is None:
                    continue
                errs = _opt(n.nvlink_errors, i, link) or (None, None, None, None)
                links.append(NvLinkSample(link, bool(up), *errs))
            return dataclasses.replace(
                base,
                temperature_c=_float(_opt(n.temperature_c, i)),
                power_w=power / 1000 if power is not None else None,
                power_limit_w=limit / 1000 if limit is not None else None,
                memory_used_bytes=mem[0] if mem else None,
                memory_total_bytes=mem[1] if mem else None,
                utilization_gpu_ratio=util[0] / 100 if util else None,
                utilization_memory_ratio=util[1] / 100 if util else None,
                sm_clock_hz=clocks[0] * MHZ if clocks else None,
                memory_clock_hz=clocks[1] * MHZ if clocks else None,
                throttle_reasons=nvml_api.throttle_names(mask) if mask is not None else None,
                ecc_sbe_volatile=_opt(n.ecc_errors, i, uncorrected=False, aggregate=False),
                ecc_dbe_volatile=_opt(n.ecc_errors, i, uncorrected=True, aggregate=False),
                ecc_sbe_aggregate=_opt(n.ecc_errors, i, uncorrected=False, aggregate=True),
                ecc_dbe_aggregate=_opt(n.ecc_errors, i, uncorrected=True, aggregate=True),
                retired_pages_sbe=pages[0] if pages else None,
                retired_pages_dbe=pages[1] if pages else None,
                retired_pages_pending=pages[2] if pages else None,
                remapped_rows_correctable=rows[0] if rows else None,
                remapped_rows_uncorrectable=rows[1] if rows else None,
                remapped_rows_pending=rows[2] if rows else None,
                remapped_rows_failed=rows[3] if rows else None,
                pcie_replay_count=_opt(n.pcie_replay_counter, i),
                pcie_tx_bytes_per_second=pcie[0] * 1024.0 if pcie else None,
                pcie_rx_bytes_per_second=pcie[1] * 1024.0 if pcie else None,
                nvlinks=tuple(links),
                recovery_action=_opt(n.recovery_action, i),
            )
        except NVMLError as e:  # only GPU_IS_LOST gets here
            return dataclasses.replace(base, lost=True, lost_reason=str(e))

    def read(self) -> Reading:
        return Reading([self.read_gpu(i) for i in range(self.count)])

    def xid_source(self) -> nvml_api.XidEventSource | None:
        return self.nvml.xid_events()

    def close(self) -> None:
        if self._owns:
            self.nvml.close()


def _float(v: Any) -> float | None:
    return float(v) if v is not None else None


class GpuProbe:
    name = "gpu"

    def __init__(
        self,
        reader: Reader,
        model: HealthModel,
        *,
        emit: Callable[[Finding], Any],
        clock: Callable[[], float] = time.time,
        xid_wait_ms: int = 500,
    ) -> None:
        self.reader, self.model, self.emit, self.clock = reader, model, emit, clock
        self._lock = threading.Lock()
        self._xid_pending: list[tuple[XidEvent, XidInfo]] = []
        self._xid_counts: Counter[tuple[int, int]] = Counter()
        self._last_xid: dict[int, int] = {}
        self._resets: Counter[int] = Counter()  # GPU resets the health model saw, per GPU
        self._xid_action: dict[tuple[int, int], str] = {}  # (gpu, code) -> the latest action
        self._uuids: dict[int, str] = dict(enumerate(getattr(reader, "uuids", ())))
        self._stop = threading.Event()
        self._xid_thread: threading.Thread | None = None
        self._xid_wait_ms = xid_wait_ms
        source = reader.xid_source()
        if source is not None:
            self._xid_thread = threading.Thread(target=self._xid_loop, args=(source,), name="gpu-xid", daemon=True)
            self._xid_thread.start()

    # --- Xid events, on their own thread -------------------------------------------------

    def _xid_loop(self, source: nvml_api.XidEventSource) -> None:
        try:
            while not self._stop.is_set():
                try:
                    ev = source.wait(self._xid_wait_ms)
                except NVMLError as e:  # e.g. a GPU lost mid-wait: keep listening for the others
                    log.warning("xid_wait_failed", error=str(e))
                    self._stop.wait(1.0)
                    continue
                if ev is not None:
                    self._on_xid(ev)
        except Exception:  # never let the listener die silently
            log.exception("xid_listener_crashed")
        finally:
            source.close()

    def _on_xid(self, ev: XidEvent) -> None:
        info = self.model.judge_xid(ev.xid, ev.message, ev.recovery_action)
        with self._lock:
            self._xid_pending.append((ev, info))
            uuid = self._uuids.get(ev.gpu, "")
        consequence = {"fatal": "; GPU marked failed", "degrading": "; GPU marked degraded"}.get(info.cls, "")
        consequence += _XID_ADVICE.get(info.action, "")
        labels = {"gpu": str(ev.gpu), "gpu_uuid": uuid, "xid": str(ev.xid), "xid_class": info.cls}
        labels["action"] = info.action
        if ev.xid == XID_RECOVERY_ACTION_CHANGED:  # bounded: NVML's five names, or unknown
            labels["recovery_action"] = info.recovery_action or "unknown"
        self.emit(
            Finding(
                "gpu",
                Reason.GPU_XID,
                _XID_SEVERITY[info.cls],
                f"Xid {ev.xid} on GPU {ev.gpu}: {info.description} ({info.cls}, {info.action}{consequence})",
                labels,
                time=ev.time,
            )
        )
        if info.action == "RESTART_BM":  # the node must reboot: every job on it should leave
            self.emit(
                Finding(
                    "gpu",
                    Reason.NODE_DRAIN_REQUIRED,
                    Severity.CRITICAL,
                    f"GPU {ev.gpu} needs the node rebooted (Xid {ev.xid}, RESTART_BM): drain the node",
                    {"gpu": str(ev.gpu), "gpu_uuid": uuid, "xid": str(ev.xid), "action": info.action},
                    time=ev.time,
                )
            )

    # --- sampling ---------------------------------------------------------------------------

    def sample(self) -> GpuSnapshot:
        reading = self.reader.read()
        now = self.clock()
        with self._lock:
            for g in reading.gpus:
                self._uuids[g.index] = g.uuid
        for ev in reading.xids:  # polled backends: report like the listener does
            self._on_xid(ev)
        with self._lock:
            pending, self._xid_pending = self._xid_pending, []
        for ev, info in pending:
            self._xid_counts[(ev.gpu, ev.xid)] += 1
            self._last_xid[ev.gpu] = ev.xid
            self._xid_action[(ev.gpu, ev.xid)] = info.action  # Xid 154's: the latest one's
            self.model.observe_xid(ev.gpu, ev.xid, ev.time, info)
        out = []
        for r in reading.gpus:
            upd = self.model.update(r.index, r, now)
            self._resets[r.index] += upd.reset_seen
            xids = tuple(sorted((code, n) for (gpu, code), n in self._xid_counts.items() if gpu == r.index))
            sample = dataclasses.replace(
                r,
                health=upd.health.state,
                reasons=upd.health.texts,
                xid_errors=xids,
                xid_actions=tuple((code, self._xid_action[(r.index, code)]) for code, _ in xids),
                last_xid=self._last_xid.get(r.index),
                resets=self._resets[r.index],
                sbe_per_hour=upd.sbe_per_hour,
                pcie_replays_per_min=upd.pcie_replays_per_min,
            )
            self._report(sample, upd)
            out.append(sample)
        return GpuSnapshot(time=now, backend=self.reader.backend, gpus=tuple(out))

    def _report(self, s: GpuSample, upd: Any) -> None:
        labels = {"gpu": str(s.index), "gpu_uuid": s.uuid, "health": upd.health.state, "previous_health": upd.previous}
        told = False
        for reason in upd.new_reasons:
            if reason.key.startswith("xid:"):
                told = True  # the Xid's own finding already said so
                continue
            self.emit(
                Finding(
                    "gpu",
                    reason.reason,
                    _STATE_SEVERITY[reason.state],
                    f"GPU {s.index}: {reason.text} (health {upd.previous} -> {upd.health.state})",
                    {**labels, "cause": reason.key},
                )
            )
            told = True
        if upd.health.state != upd.previous and not told:
            if upd.health.state == HEALTHY:
                self.emit(
                    Finding(
                        "gpu",
                        Reason.GPU_RECOVERED,
                        Severity.INFO,
                        f"GPU {s.index} is healthy again (was {upd.previous})",
                        labels,
                    )
                )
            else:
                self.emit(
                    Finding(
                        "gpu",
                        Reason.GPU_HEALTH_CHANGED,
                        _STATE_SEVERITY[upd.health.state],
                        f"GPU {s.index}: health {upd.previous} -> {upd.health.state}: " + "; ".join(upd.health.texts),
                        labels,
                    )
                )

    def close(self) -> None:
        self._stop.set()
        if self._xid_thread is not None:
            self._xid_thread.join(timeout=2 * self._xid_wait_ms / 1000 + 1)
        self.reader.close()


@dataclass(frozen=True)
class GpuProbeSection:
    """[probes.gpu]"""

    interval_s: float = opt(1.0, "seconds between GPU samples", min=0.05, max=3600)
    timeout_s: float = opt(5.0, "deadline for one sample; past it the probe is down", min=0.05, max=600)
    backend: str = opt(
        "nvml", "where GPU data comes from: nvml, or dcgm (a dcgm-exporter endpoint)", choices=("nvml", "dcgm")
    )
    dcgm_url: str = opt("http://127.0.0.1:9400/metrics", "dcgm-exporter endpoint, for backend = dcgm")


def _factory(ctx: ProbeContext) -> GpuProbe:
    cfg = ctx.config
    model = HealthModel(cfg.health)  # a malformed Xid table stops start-up here
    reader: Reader
    if cfg.probes.gpu.backend == "dcgm" and ctx.nvml is None and not cfg.agent.simulate:
        from mscale.probes.dcgm import DcgmReader

        reader = DcgmReader(cfg.probes.gpu.dcgm_url, timeout_s=cfg.probes.gpu.timeout_s)
    elif ctx.nvml is not None:
        backend = "sim" if type(ctx.nvml).__module__.startswith("mscale.sim") else "nvml"
        reader = NvmlReader(ctx.nvml, backend=backend)
    else:  # the agent found no NVML at start-up; this raises NvmlUnavailable with the reason
        reader = NvmlReader(nvml_api.open_real_nvml(), owns=True)
    try:
        return GpuProbe(reader, model, emit=ctx.emit, clock=ctx.clock)
    except BaseException:  # e.g. the Xid event set could not be set up: NVML is let go
        reader.close()
        raise


# Needs the NVIDIA driver (NVML), a dcgm-exporter endpoint, or --simulate.
SPEC = ProbeSpec(name="gpu", factory=_factory, section=GpuProbeSection, enabled_help="run the GPU probe")

__all__ = [
    "GpuProbe",
    "GpuProbeSection",
    "GpuSample",
    "GpuSnapshot",
    "NvLinkSample",
    "NvmlReader",
    "Reading",
    "SPEC",
    "STATES",
]
