"""Replica repair: under DDP every rank's weights must be identical; find a rank whose MPU
weights diverged (a corrupted element, a bad host copy) and copy them back from a healthy rank.

`ReplicaCheck` is a guard plugin (added by `mscale.attach` with the agreement when the process
group has several ranks). Every `every` steps (`healing.replica_check_steps`), at the step end,
each rank fingerprints each MPU's parameters: the wrapping int64 sum of their bytes read as
64-bit words (the weight fingerprint of mscale.hook.checks.weights), so any single changed bit changes it.
One all_reduce(MAX) of [fingerprints, -fingerprints] gives every rank the largest and the
smallest value of each MPU; equal on all MPUs, the replicas agree and that is all (the common
case: one collective of 2 x MPUs int64). Otherwise an all_gather of the fingerprints names the
ranks whose value differs from the majority's (two ranks: no majority, the lower rank is taken
as the healthy one), and each diverged MPU is repaired in the job, with no restart: its
parameters and their optimizer state are broadcast from the lowest healthy rank. The repaired
rank makes a REPLICA_DIVERGED and a REPLICA_REPAIRED finding naming itself, the MPU and the
source rank (and, as `tensor`, the names of the rank's tensors that differ from the source's:
an all_gather of the diverged MPU's per-tensor fingerprints); every rank keeps the repair in
`repairs`.

The bound under DDP: a weight written on one rank between (or during) steps stays different
from the other replicas' (they all apply the same reduced gradient), so it is found at the next
check, at most `every` steps later (8 by default: one fingerprint pass over the MPUs' weights
every 8 steps, where the local fingerprints of mscale.hook.checks.weights check 1/8 of them a step),
and repaired then; the steps in between trained on it, on that rank only.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist

from mscale.findings import Finding, Reason, Severity
from mscale.hook.checks.weights import Fingerprint, word_sum
from mscale.snapshot.distributed import _device, rank_and_size

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard
    from mscale.hook.core.mpu import Mpu

SOURCE = "replicas"


class Repair(TypedDict):
    """One repair of an MPU's replicas (ReplicaCheck.repairs): the ranks that diverged, the
    rank copied from, whether the replicas agreed after."""

    step: int
    mpu_id: str
    ranks: list[int]
    from_rank: int
    ok: bool


def fingerprint(params: list[torch.Tensor]) -> int:
    """The sum of the parameters' weight fingerprints (int64, wrapping)."""
    total = torch.zeros(1, dtype=torch.int64)
    for p in params:
        total += word_sum(p).cpu()
    return int(total)


def diverged(table: list[list[int]]) -> dict[int, tuple[list[int], int]]:
    """table[rank][mpu] fingerprints -> {mpu index: (diverged ranks, healthy source rank)}."""
    out = {}
    for j in range(len(table[0])):
        column = [row[j] for row in table]
        counts = collections.Counter(column)
        best = max(counts.values())
        # the majority's value; on a tie, the lowest rank's among the tied values
        good = next(v for v in column if counts[v] == best)
        bad = [r for r, v in enumerate(column) if v != good]
        if bad:
            out[j] = (bad, column.index(good))
    return out


class ReplicaCheck:
    """The guard plugin (see the module docstring). `every`: steps between checks (0: never);
    `seconds` sums the time spent in the checks (the benchmark reads it)."""

    def __init__(self, every: int = 100, group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(every, int) or every < 0:
            raise ValueError(f"every: expected steps >= 0 (0: never), got {every!r}")
        self.every, self.group = every, group
        self.rank, self.world_size = rank_and_size(group)
        self.guard: Guard | None = None  # the guard attached to (on_attach)
        self.repairs: list[Repair] = []
        self.checks = 0
        self.seconds = 0.0
        self._prints: dict[str, Fingerprint] = {}  # per MPU, its trained parameters' fingerprints

    def on_attach(self, guard: Guard) -> None:
        self.guard = guard
        self.rank, self.world_size = rank_and_size(self.group)

    def on_step_end(self, step: int, loss: object = None) -> None:
        if self.world_size < 2 or not self.every or (step + 1) % self.every:
            return
        self.check(step)

    def check(self, step: int) -> list[Repair]:
        """Compare and repair now (a collective: every rank calls it at the same step)."""
        t0 = time.perf_counter()
        mpus = list(self._guard().mpus)
        dev = _device(self.group)
        per = [self._tensors(m) for m in mpus]  # each MPU's per-tensor fingerprints (CPU int64)
        mine = torch.stack([t.sum() if t.numel() else torch.zeros((), dtype=torch.int64) for t in per]).to(dev)
        both = torch.cat([mine, -mine])  # MAX of -x is -MIN of x (int64 negation wraps alike on every rank)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        n = len(mpus)
        self.checks += 1
        done: list[Repair] = []
        if not torch.equal(both[:n], -both[n:]):
            rows = [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(self.world_size)]
            dist.all_gather(rows, mine, group=self.group)
            for j, (bad, src) in sorted(diverged([r.tolist() for r in rows]).items()):
                done.append(self._repair(mpus[j], bad, src, step, self._which(mpus[j], per[j], src)))
        self.seconds += time.perf_counter() - t0
        return done

    def _guard(self) -> Guard:
        if self.guard is None:
            raise RuntimeError("ReplicaCheck: not attached to a guard (on_attach)")
        return self.guard

    def _tensors(self, m: Mpu) -> torch.Tensor:
        """The per-tensor fingerprints of the MPU's trained parameters (one pass, one read-back)."""
        params = list(m.parameters())
        held = self._prints.get(m.mpu_id)
        if (
            held is None
            or len(held.tensors) != len(params)
            or any(a is not b for a, b in zip(held.tensors, params, strict=True))
        ):
            held = self._prints[m.mpu_id] = Fingerprint(params)
        return held.compute()

    def _which(self, m: Mpu, per: torch.Tensor, src: int) -> list[str]:
        """The names of the MPU's tensors that differ from rank `src`'s (a collective: an
        all_gather of the MPU's per-tensor fingerprints, run only on a divergence)."""
        dev = _device(self.group)
        rows = [torch.empty(per.numel(), dtype=torch.int64, device=dev) for _ in range(self.world_size)]
        dist.all_gather(rows, per.to(dev), group=self.group)
        names = {id(p): n for n, p in self._guard().model.named_parameters()}
        params = list(m.parameters())
        differ = (rows[self.rank].cpu() != rows[src].cpu()).nonzero().flatten().tolist()
        return [names.get(id(params[i]), str(i)) for i in differ]

    def _repair(self, m: Mpu, bad: list[int], src: int, step: int, tensors: list[str] | None = None) -> Repair:
        guard = self._guard()
        opt = guard.optimizer
        with torch.no_grad():
            for p in m.parameters():
                dist.broadcast(p.data, src, group=self.group)
                state = opt.state.get(p, {}) if opt is not None else {}
                for k in sorted(state):
                    if isinstance(state[k], torch.Tensor):
                        dist.broadcast(state[k], src, group=self.group)
        after = torch.tensor([fingerprint(list(m.parameters()))], dtype=torch.int64, device=_device(self.group))
        check = torch.cat([after, -after])
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=self.group)
        ok = bool(torch.equal(check[:1], -check[1:]))
        record = Repair(step=step, mpu_id=m.mpu_id, ranks=bad, from_rank=src, ok=ok)
        self.repairs.append(record)
        if self.rank in bad:
            labels = {"mpu_id": m.mpu_id, "rank": str(self.rank), "from_rank": str(src), "step": str(step)}
            if tensors:  # on this rank: its tensors that differ from the source's
                labels["tensor"] = ",".join(tensors)
            guard.emit(
                Finding(
                    SOURCE,
                    Reason.REPLICA_DIVERGED,
                    Severity.CRITICAL,
                    f"{m.name}: this rank's weights ({labels.get('tensor', '?')}) differ from the other "
                    f"replicas' at step {step}",
                    labels,
                )
            )
            guard.emit(
                Finding(
                    SOURCE,
                    Reason.REPLICA_REPAIRED if ok else Reason.REPLICA_DIVERGED,
                    Severity.WARNING if ok else Severity.CRITICAL,
                    f"{m.name}: parameters and optimizer state copied from rank {src}"
                    + ("" if ok else "; the replicas still differ"),
                    labels,
                )
            )
        return record
