"""The contract plugin: carries the job's active contract (mscale.contracts.declare) to the agent.

`join(guard)` (one line in `mscale.attach`) adds it, and the MSRP plugin (mscale.hook.core.msrp),
when a contract is in force in this process. On attach, and again after every reconnection of the link (a restarted agent has
forgotten), it sends the plan ({"type": "contract"}, mscale.link.Contract). It changes
nothing in the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mscale import link as protocol
from mscale.contracts.declare import Applied, active

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard


class ContractPlugin:
    def __init__(self, applied: Applied) -> None:
        self.applied = applied
        self.guard: Guard | None = None
        self._sent_for = -1  # the link's connection count the plan was last sent on

    def on_attach(self, guard: Guard) -> None:
        self.guard = guard
        self._send()

    def on_step_end(self, step: int, loss: float | None) -> None:
        link = self.guard.link if self.guard is not None else None
        if link is not None and link.connects != self._sent_for:
            self._send()

    def _send(self) -> None:
        guard = self.guard
        if guard is None or guard.link is None:
            return
        # the link queues it after its registration: it goes out on the next connection too
        guard.send_to_agent(protocol.Contract(guard.job_id, guard.rank, self.applied.plan.to_dict()).to_wire())
        self._sent_for = guard.link.connects + (0 if guard.link.connected else 1)


def join(guard: Guard) -> None:
    """Add the contract plugin (and, unless the contract turned it off, the MSRP plugin) to
    `guard` when a contract is in force in this process."""
    applied = active()
    if applied is not None and getattr(guard, "enabled", False):
        guard.add_plugin(ContractPlugin(applied))
        if applied.msrp is not None:
            from mscale.hook.core.msrp import MsrpPlugin

            guard.add_plugin(MsrpPlugin(interval_s=applied.msrp["interval_s"], report_s=applied.msrp["report_s"]))
