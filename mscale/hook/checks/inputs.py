"""The batch checked before the first MPU sees it: a NaN or Inf in the inputs (NaN pixels, a
broken feature file) is the data's fault, not an MPU's. Without this check the NaN flows
through every MPU, each output check fails and every MPU is marked suspect, then swapped for
a fault no GPU has.

At each training forward of the model the floating-point tensors of its arguments (one level
into dicts, lists and tuples, as Hugging Face batches come) are reduced on their device to one
flag, with no host synchronisation; the flag is read at the first MPU's output check, which
synchronises anyway (mscale.hook.checks.checksum), so the check adds no wait of its own; with the
checksum's commit verdicts (the default off a CPU) the flags of every forward of the step are read
at the commit point instead, in its one read (mscale.hook.core.commit: `pack`, then `judge`). A bad batch
makes one `input_nonfinite` finding naming the micro-batch and the input; the MPUs' output
checks are not run for that forward (their counters do not move), and the policy rolls the
job back with the batch stepped over, as for a non-finite loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from mscale.findings import Finding, Reason, Severity
from mscale.hook.core.commit import CommitPoint

SOURCE = "guard"


def _tensors(args: tuple[object, ...], kwargs: dict[str, object]) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []

    def add(name: str, v: object, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() or v.is_complex():
                out.append((name, v))
        elif depth < 1 and isinstance(v, dict):
            for k, x in v.items():
                add(f"{name}.{k}", x, depth + 1)
        elif depth < 1 and isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                add(f"{name}[{i}]", x, depth + 1)

    for i, a in enumerate(args):
        add(f"args[{i}]", a, 0)
    for k, v in kwargs.items():
        add(k, v, 0)
    return out


def finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of `t` is finite, as a 0-d bool on its device: its largest and its
    smallest are (torch's max and min propagate a NaN). Exact (no sum to overflow), and on a
    CPU 4x cheaper than a float64 sum, 12x than `isfinite(t).all()` (37, 148, 451 us for 8
    96x96 images)."""
    if t.numel() and t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return torch.isfinite(t.amax()) & torch.isfinite(t.amin())
    return torch.isfinite(t).all()


class InputCheck:
    """One flag per training forward; `bad()` reads it (once) and emits which input failed."""

    def __init__(self, emit: Callable[[Finding], None], losses: list[torch.Tensor | float]) -> None:
        self.emit, self.losses = emit, losses  # the guard's: the step's losses, one per forward so far
        self._pending: list[tuple[int, list[str], torch.Tensor]] = []  # forwards whose flag is unread
        self.bad_forward: int | None = None  # the micro-batch of the last forward found bad
        self.findings = 0
        self._own: list[int] | None = None  # this rank's non-finite micro-batches, once the losses are agreed

    def begin(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        micro_batch, named = len(self.losses), _tensors(args, kwargs)
        self.bad_forward = None
        if micro_batch == 0:  # a step's first forward
            self._own = None
        if not named:
            return
        with torch.no_grad():
            flags = torch.stack([finite(t).to(named[0][1].device) for _, t in named])
        if len(self._pending) >= 64:  # forwards no check and no commit read: keep it bounded
            self._flagged(self._pending[:1], self._pending[0][2].tolist())
            del self._pending[:1]
        self._pending.append((micro_batch, [n for n, _ in named], flags))

    def bad(self) -> bool:
        """Whether this forward's inputs were not finite; the step's unread flags are read (and
        the findings emitted) at the first call of the forward."""
        if not self._pending:
            return self.bad_forward is not None
        pending, self._pending = self._pending, []
        self._flagged(pending, torch.cat([f for _, _, f in pending]).tolist())
        if self.bad_forward != pending[-1][0]:  # an earlier forward's (found now): not this one's
            self.bad_forward = None
        return self.bad_forward is not None

    def pack(self, point: CommitPoint) -> torch.Tensor | None:
        """At the commit point: the unread flags go into its one read (`inputs`); the returned
        device flag is 1 when any of them is bad (or a forward already read was), None when
        there is nothing to read."""
        if not self._pending:
            return None if self.bad_forward is None else torch.ones((), dtype=torch.float64)
        flags = torch.cat([f for _, _, f in self._pending])
        point.put("inputs", flags)
        bad = (~flags.bool()).any().to(torch.float64)
        return bad if self.bad_forward is None else torch.ones_like(bad)

    def judge(self, point: CommitPoint) -> bool:
        """After the read: the findings of the flags `pack` put; whether the step's batch (any
        of its forwards) was not finite."""
        pending, self._pending = self._pending, []
        values = point.get("inputs")
        if pending and values is not None:
            self._flagged(pending, [v > 0.5 for v in values])
        return self.bad_forward is not None

    def _flagged(self, pending: list[tuple[int, list[str], torch.Tensor]], ok: Sequence[object]) -> None:
        off = 0
        for micro_batch, names, _ in pending:
            mine = ok[off : off + len(names)]
            off += len(names)
            if all(mine):
                continue
            self.bad_forward = micro_batch
            self.findings += 1
            self.emit(self._finding(micro_batch, [n for n, good in zip(names, mine, strict=True) if not good]))

    @staticmethod
    def _finding(micro_batch: int, bad: list[str]) -> Finding:
        return Finding(
            SOURCE,
            Reason.INPUT_NONFINITE,
            Severity.CRITICAL,
            f"the batch of micro-batch {micro_batch} has NaN or Inf in {', '.join(bad)}: the data is at "
            "fault, not an MPU",
            {"micro_batch": str(micro_batch), "input": bad[0]},
        )

    def keep_own(self) -> None:
        """The step's losses are about to be replaced by the one the ranks agreed on
        (mscale.hook.core.agree): which of this rank's own were not finite is kept for the step."""
        self._own = self.nonfinite_micro_batches()

    def nonfinite_micro_batches(self) -> list[int]:
        """This step's forwards (from 0) whose loss was NaN or Inf on this rank: what a rollback
        steps over (under gradient accumulation the others re-run)."""
        if self._own is not None:
            return list(self._own)
        return [i for i, v in enumerate(self.losses) if not math.isfinite(float(v))]
