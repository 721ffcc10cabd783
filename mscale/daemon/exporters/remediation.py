"""Remediation hand-off metrics (mscale.kube.remediation): the GPUs shown at fault, what each
filer holds filed, every file and undo by result, the command hook's last exit status."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.state import AgentState
from mscale.kube.remediation.service import SNAPSHOT


def collect(state: AgentState) -> Iterable[Metric]:
    st = state.snapshots.get(SNAPSHOT)
    if st is None:
        return
    faults = GaugeMetricFamily(
        "mscale_remediation_gpu_fault",
        "1 per GPU shown at fault (kind sdc: proven by an L1 swap; xid: a fatal Xid) until it is reset and healthy",
        labels=["gpu", "gpu_uuid", "kind", "reason", "action"],
    )
    for f in st.faults:
        faults.add_metric([str(f.gpu), f.gpu_uuid, f.kind, f.reason, f.action], 1.0)
    yield faults
    filed = GaugeMetricFamily(
        "mscale_remediation_filed", "1 per fault a filer holds filed now", labels=["filer", "gpu_uuid", "kind"]
    )
    for filer, held in sorted(st.filed.items()):
        for f in held:
            filed.add_metric([filer, f.gpu_uuid, f.kind], 1.0)
    yield filed
    filings = CounterMetricFamily(
        "mscale_remediation_filings",
        "files and undos by filer, event (file, clear, start) and result (filed, exists, cleared, gone, failed, deferred)",
        labels=["filer", "event", "result"],
    )
    for (filer, event, result), n in sorted(st.filings.items()):
        filings.add_metric([filer, event, result], n)
    yield filings
    down = GaugeMetricFamily(
        "mscale_remediation_filer_up", "1 when the filer is started (0: its API not reachable yet)", labels=["filer"]
    )
    for name in sorted(st.filed):
        down.add_metric([name], 0.0 if name in st.filers_down else 1.0)
    yield down
    if st.command_exit:
        exit_code = GaugeMetricFamily(
            "mscale_remediation_command_exit_code",
            "the command hook's last exit status by event (negative: killed by that signal, at its deadline)",
            labels=["event"],
        )
        for event, rc in sorted(st.command_exit.items()):
            exit_code.add_metric([event], float(rc))
        yield exit_code
