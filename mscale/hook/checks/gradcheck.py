"""Weight gradients checked before the gradient reduction: a gradient corrupted on one rank is
caught in its step, before any rank's update, and blamed on its rank, MPU and tensor.

`GradCheck` is a guard plugin (added by `mscale.attach`, ahead of the step agreement). Each
MPU's trained parameters are split into `groups` groups of about equal bytes, one group checked
per step in turn, so every parameter's gradient is checked once in `groups` steps and a step
reads 1/groups of the gradients once. A post-accumulate-grad hook on each parameter of the
group due takes the norm of its gradient when it is accumulated: before DDP's reducer copies it
into a bucket for the all_reduce (the reducer's hook on the accumulator runs after the
tensor's), so the norm is this rank's own gradient. With one rank there is no reduction to get
ahead of: no hooks, the due group's norms are taken at the commit point in one foreach pass. The norm stays a tensor on the gradient's
device: nothing is read back inside backward. At the commit point (the optimizer step's
pre-hook) the step's norms go into its one read (`on_commit`, mscale.hook.core.commit), with their
verdict on the device, which the step agreement carries to the other ranks in its all-reduce;
then (`on_step_decide`, ahead of the agreement's) each is compared with the median of its own
last `history` checked norms: more than `factor`
times that median once `warmup` of them are known is a GRADIENT_CORRUPTION finding (critical)
naming the rank, the MPU and the tensor. (A non-finite norm is left to the guard's own
non-finite path, which skips the batch; an outlier that comes back when its step is re-run is
the batch's own gradient, not a fault, and is let through: `reproduced`.)

Then the step's update is dropped (under DDP on every rank: the agreement counts a dropped
step) and this rank's gradients are cleared before the gradient statistics read them. With the
fuse (`snapshots=`) the policy's gradient_corruption rule rolls the job back to the newest
in-memory snapshot and the steps since re-run on the same batches (the batch is kept: it was not
at fault), so the run continues as the fault-free one would have.

What it sees: a corruption that moves a gradient's norm by more than `factor` (an exponent bit,
a large stuck element); one inside the norm's own step-to-step spread is
not seen (the output checks and the loss statistics remain). Under gradient accumulation the
norm taken is of the gradient as accumulated at the last micro-batch.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import TYPE_CHECKING, TypedDict

import torch
from torch.utils.hooks import RemovableHandle

from mscale.findings import Finding, Reason, Severity
from mscale.hook.checks.weights import charge, split_by_bytes
from mscale.hook.core.commit import CommitPoint, on

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard
    from mscale.hook.core.mpu import Mpu

SOURCE = "gradients"


def _local(g: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded gradient (an FSDP2 DTensor, reduce-scattered by the time
    its hook runs: the norm is of this rank's shard of the reduced gradient); a plain one as is."""
    return g.to_local() if hasattr(g, "to_local") else g


class Corruption(TypedDict):
    """One corrupted gradient found (GradCheck.found)."""

    step: int
    rank: int
    mpu_id: str
    tensor: str
    norm: float
    median: float


class GradCheck:
    """The guard plugin (see the module docstring). `groups`: parameters checked in turn (0:
    off); `factor`: a norm this many times its median is corrupted; `warmup`: checks of a
    parameter before its ratio is judged; `history`: checked norms kept per parameter."""

    def __init__(self, groups: int = 8, *, factor: float = 1000.0, warmup: int = 2, history: int = 8) -> None:
        if not isinstance(groups, int) or groups < 0:
            raise ValueError(f"groups: expected an int >= 0 (0: off), got {groups!r}")
        if not factor > 1 or warmup < 1 or history < warmup:
            raise ValueError(f"factor > 1, 1 <= warmup <= history: got {factor}, {warmup}, {history}")
        self.groups, self.factor, self.warmup, self.history = groups, factor, warmup, history
        self.guard: Guard | None = None  # the guard attached to (on_attach)
        self.params: list[tuple[str, Mpu, torch.nn.Parameter]] = []  # (name, mpu, parameter)
        self.split: list[list[int]] = []
        self.turn = 0
        self.due: set[int] = set()  # indices into params checked this step
        self.norms: dict[int, torch.Tensor] = {}  # this step's norms, on the gradients' devices
        self.seen: dict[int, collections.deque[float]] = {}
        self.found: list[Corruption] = []  # one per finding
        self.flagged: collections.deque[int] = collections.deque(maxlen=64)  # steps found corrupted
        self.reproduced: list[int] = []  # flagged steps whose re-run gave the same outlier: let through
        self.checks = 0
        self._handles: list[RemovableHandle] = []
        self._order: list[int] = []  # the indices of the norms put in the commit point, in order
        self._point: CommitPoint | None = None

    def on_attach(self, guard: Guard) -> None:
        self.guard = guard
        if not self.groups:
            return
        names = {id(p): n for n, p in guard.model.named_parameters()}
        for m in guard.mpus:
            for p in m.parameters():
                self.params.append((names.get(id(p), ""), m, p))
        self.split = split_by_bytes([p for _, _, p in self.params], self.groups) if self.params else []

    def on_detach(self, guard: Guard) -> None:
        self._unhook()

    def _unhook(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def on_step_begin(self, step: int, batch: object) -> None:
        self.norms = {}
        if not self.split:
            return
        # hooks on the group due only: hooks on every parameter made 8x the Python calls per
        # backward for the same norms (about 5 ms of wall time a step under cProfile at load 10)
        self._unhook()
        self.due = set(self.split[self.turn % len(self.split)])
        self.turn += 1
        if self._one_rank():
            return  # one rank: no reduction to get ahead of; the norms are taken at the commit point
        for i in sorted(self.due):
            hook = self.params[i][2].register_post_accumulate_grad_hook(lambda p, i=i: self._accumulated(i, p))
            self._handles.append(hook)

    def _one_rank(self) -> bool:
        return self.guard is None or self.guard.world_size <= 1

    def _accumulated(self, i: int, p: torch.nn.Parameter) -> None:
        # a hook from the autograd engine: its whole time is the check's (mscale.hook.checks.budget)
        budget = self.guard.budget if self.guard is not None else None
        mark = budget.enter(SOURCE) if budget is not None else None
        try:
            if p.grad is not None:
                self.norms[i] = torch.linalg.vector_norm(_local(p.grad.detach()), dtype=torch.float32)
        finally:
            if budget is not None and mark is not None:
                budget.leave(mark)

    def _norms_now(self) -> None:
        """One rank: the due group's norms from the gradients as accumulated, in one foreach
        pass per device at the commit point (no Python hook per parameter inside backward);
        the gradient statistics that follow take them instead of reading those gradients again."""
        due = [(i, p.grad) for i in sorted(self.due) if (p := self.params[i][2]).grad is not None]
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, g in due:
            by_device.setdefault(g.device, []).append((i, g))
        stats = self.guard._grad_stats if self.guard is not None else None  # the statistics that follow reuse them
        with torch.no_grad():
            for items in by_device.values():
                norms = torch._foreach_norm([_local(g.detach()) for _, g in items], 2, dtype=torch.float32)
                self.norms.update(zip([i for i, _ in items], norms, strict=True))
                if stats is not None:
                    for (i, _), n in zip(items, norms, strict=True):
                        stats.offer(self.params[i][2], n)

    def on_commit(self, point: CommitPoint) -> None:
        """The step's norms go into the commit point's one read (mscale.hook.core.commit), with the
        verdict the agreement carries to the other ranks, on the device: `gradients/bad`, 1 when
        a norm is over `factor` times its median (known on the host from earlier steps)."""
        if self.split and not self._handles and self._one_rank():
            t0 = time.perf_counter()
            self._norms_now()  # one rank: taken here, not by hooks inside backward
            charge(self.guard, SOURCE, t0)
        self._order, self._point = sorted(self.norms), point
        self.norms, norms = {}, self.norms
        if not self._order:
            return
        t0 = time.perf_counter()
        dev = norms[self._order[0]].device
        values = torch.stack([norms[i].to(dev) for i in self._order])
        point.put("gradients", values)
        limits = [self._limit(i) for i in self._order]
        if point.step in self.flagged:  # a flagged step's re-run: its outlier is let through (below)
            limits = [math.inf] * len(limits)
        over = torch.isfinite(values) & (values > on(torch.tensor(limits), dev).to(values.dtype))
        point.put("gradients/bad", over.any().to(torch.float64))
        charge(self.guard, SOURCE, t0)

    def _limit(self, i: int) -> float:
        seen = self.seen.get(i)
        median = statistics.median(seen) if seen is not None and len(seen) >= self.warmup else math.nan
        return self.factor * median if median > 0 else math.inf

    def on_step_decide(self, step: int) -> None:
        order, point = self._order, self._point
        self._order, self._point = [], None
        values = point.get("gradients") if point is not None else None
        if not order or values is None:
            return
        self.checks += 1
        t0 = time.perf_counter()
        bad = []
        for i, v in zip(order, values, strict=True):
            seen = self.seen.setdefault(i, collections.deque(maxlen=self.history))
            median = statistics.median(seen) if len(seen) >= self.warmup else math.nan
            if math.isfinite(v) and median > 0 and v > self.factor * median:
                bad.append((i, v, median))
            elif math.isfinite(v):
                seen.append(v)
        charge(self.guard, SOURCE, t0)
        if bad and step in self.flagged:
            # the re-run of a flagged step gave it again: the batch's own gradient, not a fault
            self.reproduced.append(step)
            for i, v, _ in bad:
                self.seen[i].append(v)
        elif bad:
            self.flagged.append(step)
            self._corrupted(step, bad)

    def _corrupted(self, step: int, bad: list[tuple[int, float, float]]) -> None:
        g = self.guard
        if g is None:
            raise RuntimeError("GradCheck: a corrupted gradient judged before on_attach")
        where = ", ".join(f"{self.params[i][0]} ({self.params[i][1].name})" for i, _, _ in bad)
        g.request_skip(f"corrupted gradient: {where}")
        if g.optimizer is not None:  # the statistics of this step must not read them
            for group in g.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        for i, v, median in bad:
            name, m, _ = self.params[i]
            self.found.append(Corruption(step=step, rank=g.rank, mpu_id=m.mpu_id, tensor=name, norm=v, median=median))
            labels = {
                "mpu_id": m.mpu_id,
                "mpu": m.name,
                "gpu": str(m.gpu),
                "rank": str(g.rank),
                "tensor": name,
                "step": str(step),
            }
            g.emit(
                Finding(
                    SOURCE,
                    Reason.GRADIENT_CORRUPTION,
                    Severity.CRITICAL,
                    f"rank {g.rank}: the gradient of {name} ({m.name}) has norm {v:.3g} against a median of "
                    f"{median:.3g} over its last checks, before the reduction: update dropped",
                    labels,
                )
            )
