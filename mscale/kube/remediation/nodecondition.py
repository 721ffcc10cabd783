"""Kubernetes without NVSentinel: the node condition `GPUUnhealthy` (mscale.kube.node) gains the
SDC reason. An open `sdc` fault turns the condition True with reason `GPUSilentDataCorruption`
(a failed GPU's own reason comes first), naming the GPU, the evidence and the recommended action;
with `kubernetes.cordon` the node is cordoned as for any fatal fault, and uncordoned once the
fault is undone and the GPU passed its checks. A fatal Xid is in the condition already.

Filing is publishing the open SDC faults (`state.snapshots[SNAPSHOT]`) for the Kubernetes
service's next condition check; the condition writer is idempotent (it writes on a change and
the heartbeat). Inert off the cluster (`kubernetes.enabled` false).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mscale.kube.node import SDC_SNAPSHOT as SNAPSHOT  # tuple[Fault, ...]: what the condition carries
from mscale.kube.remediation.base import CLEARED, EXISTS, FILED, GONE, FilerContext, FilerSpec
from mscale.kube.remediation.verdicts import SDC, Fault


@dataclass(frozen=True)
class NodeConditionSection:
    """[remediation.nodecondition]"""


class NodeConditionFiler:
    name, kinds = "nodecondition", (SDC,)
    in_memory = True  # its filings live in this process: filed again from remediation.state_file at start

    def __init__(self, state: Any) -> None:
        self.state = state

    def _faults(self) -> dict[tuple[str, str], Fault]:
        return {f.key: f for f in self.state.snapshots.get(SNAPSHOT, ())}

    async def start(self) -> None:
        self.state.snapshots.setdefault(SNAPSHOT, ())

    async def file(self, fault: Fault) -> str:
        faults = self._faults()
        if fault.key in faults:
            return EXISTS
        faults[fault.key] = fault
        self.state.snapshots[SNAPSHOT] = tuple(faults.values())
        return FILED

    async def clear(self, fault: Fault) -> str:
        faults = self._faults()
        if faults.pop(fault.key, None) is None:
            return GONE
        self.state.snapshots[SNAPSHOT] = tuple(faults.values())
        return CLEARED

    async def stop(self) -> None:
        pass


def _factory(section: NodeConditionSection, ctx: FilerContext) -> NodeConditionFiler | None:
    return NodeConditionFiler(ctx.state) if ctx.config.kubernetes.enabled else None


SPEC = FilerSpec(
    "nodecondition",
    True,
    NodeConditionSection,
    _factory,
    "with [kubernetes] enabled: an SDC verdict sets the GPUUnhealthy node condition (reason GPUSilentDataCorruption)",
    kinds=(SDC,),
)
