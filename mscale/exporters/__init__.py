"""AGENT: Prometheus collectors over the agent's state. Registry: one line per collector
module; each exports `collect(state)` yielding prometheus_client metric families built from
the agent's latest snapshots (a scrape never touches hardware).

May import: daemon.state, daemon.jobs, probes, healing. Never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from mscale.daemon.state import AgentState

MODULES: tuple[str, ...] = (
    "mscale.exporters.agent",
    "mscale.exporters.gpu",
    "mscale.exporters.host",
    "mscale.exporters.cuda",
    "mscale.exporters.jobs",
    "mscale.exporters.snapshots",
    "mscale.exporters.healing",
    "mscale.exporters.contract",
    "mscale.exporters.msrp",
    "mscale.exporters.density",
)


class AgentCollector(Collector):
    """Reads the agent's state at scrape time; never touches hardware."""

    def __init__(self, state: AgentState, modules: Iterable[str] = MODULES) -> None:
        self.state = state
        self.collectors = [importlib.import_module(m).collect for m in modules]

    def collect(self) -> Iterable[Metric]:
        for fn in self.collectors:
            yield from fn(self.state)


def make_registry(state: AgentState, modules: Iterable[str] = MODULES) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(state, modules))
    return registry
