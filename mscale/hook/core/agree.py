"""Agreed decisions across ranks: one small all-reduce at each step's decision point.

Under DDP every rank holds a replica of the model and applies the same averaged gradient, so a
decision taken by one rank alone splits the replicas: a NaN in one rank's batch rolled back
on that rank only, a checksum failure that drops one rank's update while DDP has already
averaged the corrupted gradient into every rank's, LR cooled on the rank whose local loss
spiked. `Agreement` (a guard plugin, added by `mscale.attach` when the process group has
several ranks) makes every rank take the same decision in the same step:

    at the optimizer step pre-hook, before the gradient statistics and the loss detector, each
    rank contributes a few numbers to ONE all_reduce(SUM) of float64, built on the device from
    the step's verdicts (`on_commit`) and run inside the commit point's one host read
    (mscale.hook.core.commit), so nothing is read back before it and nothing after it but the sum:

        skip             the rank already dropped this step's update (a plugin asked)
        nonfinite        the rank's loss is NaN/Inf
        checksum_failed  an MPU output of the rank failed its checksum (not re-run clean)
        rollback         a rollback is pending on the rank (the fuse's, e.g. an agent command)
        swaps            MPUs the rank moved to a standby in this step (L1)
        loss_sum, loss_n the rank's finite loss and 1 (or 0, 0)
        commit_failed    a check of the rank failed at the commit point, or it asked for a re-run (FSDP2)
        gradient         a weight gradient of the rank is corrupted (mscale.hook.checks.gradcheck)
        keep             the rank's pending rollback re-runs its batch (not skipped)
        multipliers      each MPU's CMSA clip-threshold multiplier (an L2 degrade raises it
                         on its rank), one number per MPU

        failed MPUs      per MPU, 1 when that MPU's output failed its checksum on the rank
        faulty ranks     per rank, 1 at the rank's own index when it dropped the step, had a
                         non-finite loss, a failed checksum or a corrupted gradient (so every
                         rank can name it)

    then on every rank (`on_step_decide`): the step's loss becomes the mean over ranks (NaN when any rank's was
    not finite), so the loss detector, hence LR cooling and the NaN rollback, judge the same
    loss everywhere; the update is dropped on all ranks when any rank dropped it, had a
    non-finite loss, failed a check at the commit point or had a corrupted gradient (a
    STEP_DROPPED_AGREED finding, naming the ranks at fault, on the ranks that found nothing
    themselves); for the last two every rank asks for the step to be re-run on the same batch
    (`guard.request_rerun`: the fuse's rollback that keeps the batch). An MPU whose output failed its checksum on some rank (and was
    not re-run clean) has its gradient dropped on every rank for this step, the rest of the
    update kept (MPU_GRADIENT_DROPPED_AGREED on every rank, naming the MPU and the ranks): DDP
    has already averaged the faulty rank's gradient of that MPU into every rank's, and without
    that rank's own gradient the average cannot be rescaled over the others, so the MPU is left
    as it was; every other MPU trains on, the replicas stay equal, and the faulty rank's fuse
    (L1, L2, L3) carries on healing its MPU as with one rank. CMSA clips with the mean of the ranks' multipliers on every
    rank for this step (each rank's own is put back at the step end), since a threshold
    raised on one rank alone would give that replica another update than the others'. The rollback itself is the snapshot engine's collective
    `agree_rollback` at every step end (mscale.hook.fuse.actions.rollback), which restores the
    newest step every rank holds, or none.

Every rank's guard must call it once per optimizer step (the guard does: one optimizer
pre-hook per step), so all ranks run the same number of collectives. A step the grad scaler
skips has no optimizer step and no agreement; under DDP its inf/NaN gradients are the same on
every rank, so every rank's scaler skips it. Without an initialised process group, or with one
rank, the plugin does nothing (the guard does not add it).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mscale.findings import Finding, Reason, Severity
from mscale.hook.core.commit import on
from mscale.hook.fuse.actions.rollback import KEEP_BATCH
from mscale.snapshot.distributed import _device, rank_and_size

if TYPE_CHECKING:
    from mscale.hook.core.commit import CommitPoint
    from mscale.hook.core.guard import Guard
    from mscale.hook.core.mpu import Mpu

SOURCE = "agree"
FIELDS = (
    "skip",
    "nonfinite",
    "checksum_failed",
    "rollback",
    "swaps",
    "loss_sum",
    "loss_n",
    "commit_failed",
    "gradient",
    "keep",
)
HISTORY = 256  # agreements kept (tests, benchmarks)


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on for one step (counts are over ranks)."""

    step: int
    skip: int
    nonfinite: int
    checksum_failed: int
    rollback: int
    swaps: int
    loss: float | None  # the mean over ranks; NaN when a rank's loss was not finite; None: no loss
    commit_failed: int = 0  # ranks whose checks failed at the commit point (commit verdicts)
    gradient: int = 0  # ranks with a corrupted weight gradient (mscale.hook.checks.gradcheck)
    keep: int = 0  # ranks whose pending rollback re-runs its batch (not skipped)
    failed_mpus: tuple[str, ...] = ()  # MPUs whose output failed on some rank (the fault's culprits)

    @property
    def drop(self) -> bool:  # an in-step checksum failure drops only that MPU's gradient (on_step_decide)
        return bool(self.skip or self.nonfinite or self.commit_failed or self.gradient)

    @property
    def rerun(self) -> bool:
        """The step is re-run on the same batch on every rank (a fault found at the commit point)."""
        return bool(self.commit_failed or self.gradient)


class Agreement:
    """The guard plugin (see the module docstring). `group`: the process group (default: the
    world); `seconds` sums the time spent in the collective (the benchmark reads it)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.world_size = rank_and_size(group)
        self.guard: Guard | None = None
        self.history: collections.deque[Agreed] = collections.deque(maxlen=HISTORY)
        self.seconds = 0.0
        self.collectives = 0
        self._reruns_at_begin = 0
        self._own: dict[str, float] | None = None  # this rank's CMSA multipliers, while agreed ones apply
        self._point: CommitPoint | None = None  # this step's commit point (mscale.hook.core.commit)

    def on_attach(self, guard: Guard) -> None:
        self.guard = guard
        self.rank, self.world_size = rank_and_size(self.group)

    def on_step_begin(self, step: int, batch: object) -> None:
        fuse = self.guard.fuse if self.guard is not None else None
        self._reruns_at_begin = len(fuse.reruns) if fuse is not None else 0

    def on_commit(self, point: CommitPoint) -> None:
        """This rank's contribution to the step's one all-reduce, in FIELDS order, then the CMSA
        multipliers, the failed MPUs and the faulty rank: built on the device from the verdicts
        the guard and the gradient check put in the commit point, so nothing is read first."""
        g = self.guard
        if self.world_size < 2 or g is None:
            return
        self._point = point
        losses, commit, grad = (point.tensor(k) for k in ("losses", "checksum/failed", "gradients/bad"))
        dev = next((t.device for t in (commit, grad, losses) if t is not None), torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        fuse = g.fuse
        pending = getattr(getattr(fuse, "states", {}).get("rollback"), "pending", None)
        swaps = len(fuse.reruns) - self._reruns_at_begin if fuse is not None else 0
        skip, rollback = (
            on(torch.tensor(float(v)), dev) for v in (bool(g.step_state.skip_reason), pending is not None)
        )
        keep = on(torch.tensor(float(pending is not None and pending.reason in KEEP_BATCH)), dev)
        if losses is not None and losses.numel():
            mean = on(losses, dev).mean()
            finite = torch.isfinite(mean)
            nonfinite, loss_sum, loss_n = (~finite).to(torch.float64), torch.where(finite, mean, zero), finite.to(zero)
        else:
            nonfinite, loss_sum, loss_n = zero, zero, zero
        # in-step verdicts are on the host already; commit ones on the device
        in_step = [0.0 if g.checksum.commit_mode(m) or m.last_checksum_ok else 1.0 for m in g.mpus]
        failed = on(torch.tensor(in_step, dtype=torch.float64), dev)
        # a re-run asked in the step (mscale.hook.fuse.fuse, under FSDP2): every rank re-runs it alike
        commit_failed = on(torch.tensor(float(bool(g.step_state.rerun_reason))), dev).to(zero)
        if commit is not None and commit.numel() == len(g.mpus) and len(g.mpus):
            failed = torch.maximum(failed, on(commit, dev))
            commit_failed = torch.maximum(commit_failed, on(commit, dev).amax().to(zero))
        gradient = on(grad, dev).reshape(()) if grad is not None else zero
        checksum_failed = failed.amax() if len(g.mpus) else zero
        faulty = torch.stack((skip, nonfinite, checksum_failed, commit_failed, gradient)).amax()
        ranks = torch.zeros(self.world_size, dtype=torch.float64, device=dev)
        ranks[self.rank] = faulty
        head = torch.stack(
            (skip, nonfinite, checksum_failed, rollback, on(torch.tensor(float(swaps)), dev), loss_sum, loss_n)
            + (commit_failed, gradient, keep)
        )
        multipliers = on(torch.tensor(self._multipliers(g), dtype=torch.float64), dev)
        point.agree(torch.cat((head, multipliers, failed, ranks)), self._reduce, _device(self.group))

    def _multipliers(self, g: Guard) -> list[float]:
        return [float(g.cmsa.multiplier[m.mpu_id]) for m in g.mpus] if g.cmsa is not None else []

    def on_step_end(self, step: int, loss: object = None) -> None:
        own, self._own = self._own, None
        if own is not None and self.guard is not None and self.guard.cmsa is not None:
            self.guard.cmsa.multiplier.update(own)

    def _reduce(self, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.collectives += 1

    def on_step_decide(self, step: int) -> None:
        point, self._point = self._point, None
        g = self.guard
        if self.world_size < 2 or g is None or point is None or not point.agreed():
            return
        total = point.agreed()
        skip, nonfinite, failed, rollback, swaps = (round(v) for v in total[:5])
        loss_sum, loss_n = total[5], total[6]
        commit_failed, gradient, keep = (round(v) for v in total[7:10])
        cmsa = g.cmsa
        n_mult = len(total) - len(FIELDS) - len(g.mpus) - self.world_size
        if cmsa is not None and n_mult:
            self._own = dict(cmsa.multiplier)
            for m, v in zip(g.mpus, total[len(FIELDS) : len(FIELDS) + n_mult], strict=True):
                cmsa.multiplier[m.mpu_id] = v / self.world_size
        per_mpu = total[len(FIELDS) + n_mult : len(FIELDS) + n_mult + len(g.mpus)]
        ranks = total[len(total) - self.world_size :]
        faulty = [r for r, v in enumerate(ranks) if v > 0.5]
        if nonfinite:
            loss: float | None = math.nan
        elif loss_n:
            loss = loss_sum / loss_n
        else:
            loss = None
        culprits = tuple(m.mpu_id for m, v in zip(g.mpus, per_mpu, strict=True) if v > 0.5)
        a = Agreed(step, skip, nonfinite, failed, rollback, swaps, loss, commit_failed, gradient, keep, culprits)
        self.history.append(a)
        if loss is not None:
            g.inputs.keep_own()  # which micro-batch of this rank was not finite: what a rollback skips
            g.step_state.losses[:] = [loss]  # every rank's detector judges the same loss
        at_fault = ",".join(str(r) for r in faulty)
        if a.drop:
            why = ", ".join(
                f"{n} rank(s) {what}"
                for n, what in (
                    (skip, "dropped it"),
                    (nonfinite, "had a non-finite loss"),
                    (commit_failed, "failed a check at the commit point"),
                    (gradient, "had a corrupted gradient"),
                )
                if n
            )
            if a.rerun:  # re-run on the same batch on every rank (the fuse's rollback that keeps it)
                g.request_rerun(f"agreed across {self.world_size} ranks: {why}")
            if not g.step_state.skip_reason:
                g.request_skip(f"agreed across {self.world_size} ranks: {why}")
            if ranks[self.rank] < 0.5:
                g.emit(
                    Finding(
                        SOURCE,
                        Reason.STEP_DROPPED_AGREED,
                        Severity.WARNING,
                        f"step {step}: update dropped on every rank ({why}; rank(s) at fault: {at_fault})",
                        {"rank": str(self.rank), "step": str(step), "ranks_at_fault": at_fault},
                    )
                )
        elif failed and not g.step_state.skip_reason:
            self._drop_mpu_gradients(g, step, [m for m, v in zip(g.mpus, per_mpu, strict=True) if v > 0.5], at_fault)

    def _drop_mpu_gradients(self, g: Guard, step: int, mpus: list[Mpu], at_fault: str) -> None:
        """Every rank: the failed MPUs' averaged gradients are dropped (see the module docstring)."""
        for m in mpus:
            for p in m.parameters():
                p.grad = None
            g.emit(
                Finding(
                    SOURCE,
                    Reason.MPU_GRADIENT_DROPPED_AGREED,
                    Severity.WARNING,
                    f"step {step}: {m.name}'s gradient dropped on every rank (its output failed a checksum "
                    f"on rank(s) {at_fault}); the other MPUs' update is kept",
                    {"rank": str(self.rank), "step": str(step), "ranks_at_fault": at_fault, "mpu_id": m.mpu_id},
                )
            )
