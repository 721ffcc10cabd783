"""The job's side of a standby the node agrees on (the agent's side: mscale.daemon.standby).

`AgentStandby(guard)` is what the fuse's L1 swap calls for a target GPU when the job has a link
to the agent (`mscale.attach` with snapshots= sets it as `fuse.ask_standby`): it sends a
`standby_request` (the MPU, the GPU it leaves, the GPUs the job avoids) and waits up to
`timeout_s` for the agent's answer, which the link thread routes here, not to the step-boundary
command queue. Returns the GPU index granted; -1 when the agent has none (the swap fails and
the fuse escalates to L2); None when there is no link, no answer in time or no view of the
node's GPUs on the agent, and the swap falls
back to the job's own choice (fail-open: training never waits on the agent longer than that).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog

from mscale import link as protocol

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard
    from mscale.hook.core.mpu import Mpu
    from mscale.link.wire import Wire

log = structlog.get_logger("mscale.hook")
MAX_PENDING = 64  # answers held for requests (late ones are dropped past it)


class AgentStandby:
    def __init__(self, guard: Guard, timeout_s: float = 2.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")
        self.guard, self.timeout_s = guard, timeout_s
        self.answers: list[Wire] = []  # every answer received, in order (bounded)
        self._ids = itertools.count(1)
        self._pending: dict[int, Wire] = {}
        self._cond = threading.Condition()
        link = guard.link
        if link is not None:
            inner = link.on_command

            def route(command: Wire) -> object:
                if command.get("type") != protocol.STANDBY:
                    return inner(command)
                with self._cond:
                    if len(self._pending) >= MAX_PENDING:
                        self._pending.clear()
                    self._pending[command.get("id", -1)] = command
                    self._cond.notify_all()
                return None

            link.on_command = route

    def __call__(self, m: Mpu, avoid: Iterable[int]) -> int | None:
        link = self.guard.link
        if link is None or not link.connected:
            return None
        ident = next(self._ids)
        link.send(protocol.StandbyRequest(ident, m.mpu_id, m.gpu, tuple(int(g) for g in avoid)).to_wire())
        with self._cond:
            self._cond.wait_for(lambda: ident in self._pending, timeout=self.timeout_s)
            answer = self._pending.pop(ident, None)
        if answer is None:
            log.warning("standby_unanswered", mpu_id=m.mpu_id, timeout_s=self.timeout_s)
            return None
        self.answers = [*self.answers[-(MAX_PENDING - 1) :], answer]
        if answer.get("decided") is False:  # the agent has no view of the node's GPUs
            return None
        gpu = answer.get("gpu")
        if isinstance(gpu, int) and not isinstance(gpu, bool) and gpu >= 0:
            log.info("standby_granted", mpu_id=m.mpu_id, gpu=gpu, why=answer.get("why", ""))
            return gpu
        log.warning("standby_none", mpu_id=m.mpu_id, why=str(answer.get("why", ""))[:300])
        return -1
