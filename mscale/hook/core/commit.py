"""The commit point's one host read: every verdict of the step read back together at the
optimizer step's pre-hook, after the step agreement's one all-reduce when there are several ranks.

Inside forward and backward the checks leave their results on the device (the checksums'
commit verdicts, the inputs' finite flags, the gradient norms, the losses). At the optimizer
step pre-hook the guard opens a `CommitPoint` and each contributor puts its tensors in it,
the plugins through `on_commit(point)` (mscale.hook.core.plugin), in plugin order:

    put(key, t)            read back as they are: this rank's own values (residuals, norms)
    tensor(key)            what an earlier contributor put, still on its device: the
                           agreement builds its vector from the others' verdicts this way
    agree(t, reduce)       the agreement's vector; `reduce` sums it over the ranks in place

`read()` then gathers every tensor on one device, runs the one all_reduce over the agreed part
(when there is one) and reads everything back in one host read: on a GPU, the step's one
synchronisation for its checks. `get(key)` gives a key's floats, `agreed()` the summed vector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard


def on(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """`t` as float64 on `dev`. A host tensor goes to a GPU without waiting for it (a pageable
    copy is staged at once; a blocking one would synchronise the stream), never the other way."""
    return t.to(dev, torch.float64, non_blocking=t.device.type == "cpu" and dev.type != "cpu")


class CommitPoint:
    """One step's verdicts on their way to the host (see the module docstring)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._tensors: dict[str, torch.Tensor] = {}
        self._agreed: torch.Tensor | None = None
        self._reduce: Callable[[torch.Tensor], None] | None = None
        self._reduce_device: torch.device | None = None
        self._values: dict[str, list[float]] = {}
        self._agreed_values: list[float] = []
        self.done = False

    def put(self, key: str, t: torch.Tensor) -> None:
        if self.done:
            raise RuntimeError(f"{key}: the commit point was already read")
        if key in self._tensors:
            raise KeyError(f"{key}: already put at this commit point")
        self._tensors[key] = t.detach()

    def tensor(self, key: str) -> torch.Tensor | None:
        return self._tensors.get(key)

    def agree(self, t: torch.Tensor, reduce: Callable[[torch.Tensor], None], device: torch.device) -> None:
        """The vector summed over the ranks before the read: `reduce(t)` all-reduces it in place,
        on `device` (the process group's)."""
        if self._agreed is not None:
            raise RuntimeError("the commit point already holds an agreed vector")
        self._agreed, self._reduce, self._reduce_device = t.detach(), reduce, device

    def read(self) -> bool:
        """The all-reduce (if any) and the one host read; False when there was nothing to read."""
        if self.done:
            return False
        self.done = True
        parts = list(self._tensors.items())
        if not parts and self._agreed is None:
            return False
        # one device for everything: the first tensor's (the GPU the verdicts are on), so the
        # pieces on other devices move there asynchronously and only the final read waits
        first = self._agreed if self._agreed is not None else parts[0][1]
        dev = first.device
        flat = [on(t, dev).reshape(-1) for _, t in parts]
        n = 0
        if self._agreed is not None:
            flat.insert(0, on(self._agreed, dev).reshape(-1))
            n = flat[0].numel()
        whole = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64, device=dev)
        if self._agreed is not None and self._reduce is not None:
            # gloo with GPU verdicts: the one device-to-host copy happens here, not per piece
            whole = whole.to(self._reduce_device or dev)
            head = whole[:n].clone()
            self._reduce(head)
            whole = torch.cat((head, whole[n:]))
        values = whole.tolist()  # the read
        self._agreed_values, off = values[:n], n
        for key, t in parts:
            self._values[key] = values[off : off + t.numel()]
            off += t.numel()
        return True

    def get(self, key: str) -> list[float] | None:
        """A key's values after the read (None: nothing put under it)."""
        return self._values.get(key)

    def agreed(self) -> list[float]:
        return self._agreed_values


def commit(guard: Guard, *, plugins: bool) -> CommitPoint:
    """The guard's commit point of its current step: the inputs' flags, the checksums' rows and
    the losses, with the plugins' (`on_commit`, when `plugins`: at the optimizer step, not at a
    step the grad scaler skipped) read back in one read; then judged. A checksum failure judged
    here (commit verdicts: nothing read inside the step, no re-run in it) drops the update and
    asks for the step to be re-run (`guard.request_rerun`; on every rank through the agreement)."""
    point = CommitPoint(guard.current_step)
    try:
        data_fault = guard.inputs.pack(point)
        guard.checksum.pack(point, data_fault)
        losses = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in guard.step_state.losses]
        if losses and len({v.device for v in losses}) == 1:
            point.put("losses", torch.stack([v.detach().reshape(()).to(torch.float64) for v in losses]))
        if plugins:
            guard.hooks.dispatch("on_commit", point)
        point.read()
        got = point.get("losses")
        if got is not None:
            guard.step_state.losses[:] = got  # floats from now on: nothing more to read for the loss
    except Exception as e:  # a detector bug must not stop training
        guard.log.exception("guard_error", where="commit", error=str(e))
    late = guard.checksum.judge(point, data_fault=guard.inputs.judge(point))
    if late:
        why = f"checksum failed at the commit point: MPU {', '.join(late)}"
        if guard.optimizer is not None:
            guard.request_rerun(why)
    return point
