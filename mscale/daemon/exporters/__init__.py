"""The agent's Prometheus collectors over its state, a part of the agent's room (what the
room's docstring allows, mscale.daemon). Registry: one line per collector module; each exports
`collect(state)` yielding prometheus_client metric families built from the agent's latest
snapshots (a scrape never touches hardware).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from mscale.daemon.state import AgentState
from mscale.kube.attribution import add_pod_labels

MODULES: tuple[str, ...] = (
    "mscale.daemon.exporters.agent",
    "mscale.daemon.exporters.gpu",
    "mscale.daemon.exporters.host",
    "mscale.daemon.exporters.cuda",
    "mscale.daemon.exporters.jobs",
    "mscale.daemon.exporters.stragglers",
    "mscale.daemon.exporters.goodput",
    "mscale.daemon.exporters.snapshots",
    "mscale.daemon.exporters.healing",
    "mscale.daemon.contract.exporter",
    "mscale.daemon.contract.msrp_exporter",
    "mscale.daemon.exporters.density",
    "mscale.daemon.exporters.kube",
    "mscale.daemon.exporters.remediation",
)


class AgentCollector(Collector):
    """Reads the agent's state at scrape time; never touches hardware."""

    def __init__(self, state: AgentState, modules: Iterable[str] = MODULES) -> None:
        self.state = state
        self.collectors = [importlib.import_module(m).collect for m in modules]

    def collect(self) -> Iterable[Metric]:
        families = (family for fn in self.collectors for family in fn(self.state))
        # Kubernetes: pod, namespace and container labels on GPU and job series (mscale.kube);
        # off the cluster every family passes unchanged
        yield from add_pod_labels(families, self.state)


def make_registry(state: AgentState, modules: Iterable[str] = MODULES) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(state, modules))
    return registry
