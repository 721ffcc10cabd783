"""L2 modality degradation: the standby fails too, or none is healthy.

The MPU keeps training degraded: a vision tower of a known family runs at reduced resolution
with every output shape kept (`mscale.hook.fuse.degrade`: fixed-size towers that interpolate their
position embeddings, such as CLIP and SigLIP, and dynamic-resolution ones over flattened
patches, such as Qwen2-VL's, at the fuse's `l2_resolution`); for any other MPU no reduction
applies and the event says so. Its CMSA clip threshold is raised by the fuse's
`l2_clip_factor` to absorb the noisier gradients, and its forward runs on a fallback where
one applies (`run_degraded`):

- on an accelerator (cuda) the MPU always moves to the CPU (parameters, gradients, buffers,
  the optimizer state of its parameters: `mscale.hook.fuse.placement.place`, as the L1 swap); the
  device-boundary adapter takes its inputs to the CPU and gives its outputs back on the device
  they came from, so the rest of the model is unchanged ("cpu").
  Written without a GPU to run it on: untested here. A fused optimizer (fused=True) cannot
  step parameters on two device types; the default foreach one can.
- already on the CPU, only with `healing.l2_precision_fallback` (off by default): its forward
  runs under torch.autocast("cpu", bfloat16), floating outputs cast back to the input dtype
  ("bf16"). The ABFT checks pick their tolerance from each Linear's output dtype, so bf16
  GEMMs are checked at bf16 tolerance (1e-2 against 2e-6 in fp32): corruption below that goes
  unseen while degraded, and L3 may never engage. Hence opt-in.
- sharded (FSDP2): never the CPU (the shards stay on the process group's device; the event says
  so), bf16 where asked; the collectives stay as they were (docs/healing.md#under-fsdp2).

The forward is wrapped by an instance attribute (what nn.Module.__call__ calls), inside the
guard's hooks: they see the MPU's inputs and outputs as the model does. Undone on recovery.
A reduced forward that raises runs unreduced for that call; the fuse then undoes the
reduction, books the failure (a failed l2_degrade event) and escalates the MPU to L3: no error
of the degradation reaches the training loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch
from torch import nn

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import Result
from mscale.hook.fuse.actions.base import Executor, FuseContext
from mscale.hook.fuse.placement import Inner, device_of, map_tensors, place, tensors, wrap_forward
from mscale.snapshot.sharded import is_sharded

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard
    from mscale.hook.core.mpu import Mpu
    from mscale.hook.fuse.degrade import Reduction

log = structlog.get_logger("mscale.fuse")


@dataclass
class Fallback:
    kind: str  # "cpu" or "bf16": an event label
    undo: Callable[[], None]


def run_degraded(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, precision: bool = False, fsdp: bool = False
) -> Fallback | None:
    """Put `module` on its fallback: the CPU when it runs on cuda (not sharded: `fsdp`); else bf16
    autocast when `precision` is set; else none (None: the MPU runs as it did)."""
    import torch

    home = device_of(module)
    if home.type == "cuda" and not fsdp:
        return cpu_fallback(module, optimizer)
    if precision:
        return bf16_fallback(module, dtype=torch.bfloat16)
    return None


def bf16_fallback(module: nn.Module, dtype: torch.dtype | None = None) -> Fallback:
    import torch

    dtype = dtype or torch.bfloat16
    default = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    kind = device_of(module).type  # cuda's autocast for a sharded MPU kept there

    def forward(inner: Inner, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        back = next((t.dtype for t in tensors((args, kwargs)) if t.is_floating_point()), default)
        with torch.autocast(kind, dtype=dtype):
            out = inner(*args, **kwargs)
        return map_tensors(out, lambda t: t.to(back) if t.is_floating_point() and t.dtype != back else t)

    return Fallback("bf16", wrap_forward(module, forward))


def cpu_fallback(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Fallback:
    """Move the module and its optimizer state to the CPU behind the device-boundary adapter
    (mscale.hook.fuse.placement, the helper the L1 swap uses too); undo moves it back."""
    home = device_of(module)
    place(module, optimizer, "cpu")
    return Fallback("cpu", lambda: place(module, optimizer, home))


class Degraded:
    """Per job: the MPUs running degraded, each with its shape-preserving reduction (None when
    none applies to the model: mscale.hook.fuse.degrade) and its fallback."""

    def __init__(self, fuse: FuseContext) -> None:
        self.resolution: float = fuse.l2_resolution
        self.clip_factor: float = fuse.l2_clip_factor
        self.precision: bool = fuse.l2_precision_fallback
        self.mpus: dict[str, tuple[Reduction | None, Fallback | None]] = {}  # mpu_id -> (reduction, fallback)
        self.why_none: dict[str, str] = {}  # mpu_id -> why no reduction applies
        self.pinned: set[str] = set()  # sharded MPUs on a GPU: no CPU fallback
        self.failed: list[tuple[int, str, str]] = []  # (step, mpu_id, error) of reduced forwards that raised

    @property
    def fallbacks(self) -> dict[str, str]:
        """The fallback each degraded MPU runs on: mpu_id -> "cpu" or "bf16"."""
        return {k: fb.kind for k, (_, fb) in self.mpus.items() if fb is not None}

    def degrade(self, guard: Guard, m: Mpu) -> None:
        if m.mpu_id in self.mpus:
            return
        from mscale.hook.fuse.degrade import reduction_for, why_none

        sharded = is_sharded(guard.model)
        fallback = run_degraded(m.module, guard.optimizer, precision=self.precision, fsdp=sharded)
        self.pinned |= {m.mpu_id} if sharded and m.device.type == "cuda" else set()
        if fallback is not None:
            guard.checksum.forget(m)  # its cached weight sums (the weights may have moved)
        # installed after the fallback: the reduction runs on the fallback's side of the boundary
        reduction = reduction_for(m.module, self.resolution)
        self.mpus[m.mpu_id] = (reduction, fallback)
        if reduction is None:
            self.why_none[m.mpu_id] = why_none(m.module, self.resolution) or "no reduction applies"
        log.warning(
            "mpu_degraded",
            mpu_id=m.mpu_id,
            reduction=reduction.kind if reduction else "none",
            fallback=fallback.kind if fallback else "none",
            device=str(m.device),
        )
        if guard.cmsa is not None:
            guard.cmsa.raise_threshold(m, self.clip_factor)

    def in_force(self, fuse: FuseContext, m: Mpu) -> bool:
        return m.mpu_id in self.mpus

    def mpu_output(self, fuse: FuseContext, m: Mpu, output: object) -> None:
        """A reduced forward of `m` raised (its own forward ran instead): undo the reduction,
        book the failure, escalate to L3."""
        reduction = self.mpus.get(m.mpu_id, (None, None))[0]
        if reduction is None or not reduction.failures:
            return
        error = reduction.failures[-1]
        reduction.undo()
        self.mpus[m.mpu_id] = (None, self.mpus[m.mpu_id][1])
        step = fuse.guard.current_step
        self.failed.append((step, m.mpu_id, error))
        log.error("mpu_reduction_failed", mpu_id=m.mpu_id, error=error, step=step)
        fuse.reduction_failed(m, EXECUTOR.spec, f"reduced forward raised ({error}); undone, this forward ran unreduced")

    def undo(self, fuse: FuseContext, m: Mpu) -> None:
        if m.mpu_id not in self.mpus:
            return
        reduction, fallback = self.mpus.pop(m.mpu_id)
        if reduction is not None:
            reduction.undo()
        if fallback is not None:
            fallback.undo()
            fuse.guard.checksum.forget(m)
        if fuse.guard.cmsa is not None:
            fuse.guard.cmsa.reset_threshold(m)

    def detach(self, fuse: FuseContext) -> None:
        for reduction, fallback in self.mpus.values():
            if reduction is not None:
                reduction.undo()
            if fallback is not None:
                fallback.undo()
        self.mpus.clear()


def apply(fuse: FuseContext, state: Degraded, d: Decision) -> str:
    state.degrade(fuse.guard, fuse.guard.mpu(d.target.mpu_id))
    return Result.APPLIED


def event(state: Degraded, d: Decision) -> tuple[str, dict[str, str]]:
    if d.target.mpu_id not in state.mpus:
        return "", {}
    reduction, fallback = state.mpus[d.target.mpu_id]
    kind = fallback.kind if fallback else None
    where = {"cpu": "moved to the CPU", "bf16": "forward in bf16"}.get(kind or "", "no fallback on this device")
    if d.target.mpu_id in state.pinned:
        where += " (no CPU fallback: a sharded MPU's shards stay on the process group's device)"
    what = (
        reduction.detail if reduction else f"no reduction ({state.why_none.get(d.target.mpu_id, '')}): fallback alone"
    )
    labels = {"reduction": reduction.kind if reduction else "none"}
    if kind:
        labels["fallback"] = kind
    return f"{what}; {where}", labels


EXECUTOR = Executor(actions.get("l2_degrade"), apply, state=Degraded, event=event)
