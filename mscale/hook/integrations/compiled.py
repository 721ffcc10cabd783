"""The checks inside a compiled graph (`torch.compile`): pure tensor ops, no host read, no
Python decision that changes from step to step.

What dynamo traces of the guard is what runs inside the model: the forward hooks of the MPUs
and of their linear layers (the model's own hooks run outside the graph: `OptimizedModule`
calls them eagerly, then enters dynamo at the model's forward). Any Python value those hooks
read becomes a guard of the compiled graph, and a guard that changes recompiles the model, so
the eager rotation of checked layers (mscale.hook.checks.coverage: a different set each step) cannot
be traced as is. Here instead:

- Every linear layer is checked every step, on a sample of its rows (tokens): the rows
  `phase, phase + s, phase + 2s, ...` (mod N) of its input and output, with `s` the MPU's
  stride, `max_gap_steps` (8) by default. The phase is a device tensor the guard sets eagerly
  at each step's begin (`step % s`), so every row of every layer is checked at least once every
  `s` steps and the graph never changes. The ABFT identity holds on any subset of rows:
  sum over the rows of y = (sum over the rows of x) . c(W) + rows x sum(b).
- An MPU in incident mode has stride 1 (every row): a Python int the graph is guarded on, so
  the model is recompiled once when an incident opens (and the first graph is reused when it
  closes): at most two graphs per MPU.
- Verdicts stay on the device: each layer's (residual, tolerance) is kept in a small tensor per
  MPU, `values` (layers + 1 rows: the last is the MPU output's non-finite check), written in
  place by the graph; a failed forward's pair sticks until the step's commit point, where the
  checksum detector takes them (`take`) into the step's one read (mscale.hook.core.commit).

Not traced (documented in docs/hook.md): replays (an MPU's forward run again, with the RNG
state restored, is host work), timers (the budget does not see the cost of in-graph checks;
the stride is what bounds it), the plugins' per-output hook (the fuse's in-step re-run, which
commit verdicts do not use, and L3's capture of the MPU output).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from mscale.hook.checks.linears import LinearKind

if TYPE_CHECKING:
    from mscale.hook.core.mpu import Mpu


def compiling() -> bool:
    """True while dynamo traces the calling code (a constant inside the traced graph)."""
    return bool(torch.compiler.is_compiling())


def unwrap(model: nn.Module) -> nn.Module:
    """The module a `torch.compile(model)` wrapper (an OptimizedModule) holds; else `model`."""
    while type(model).__name__ == "OptimizedModule":
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


class _Slot:
    """One MPU's in-graph check state (a plain object: dynamo traces its attributes)."""

    def __init__(self, mpu: Mpu, layers: list[tuple[str, nn.Module, LinearKind]], stride: int) -> None:
        self.mpu = mpu
        self.names = [n for n, _, _ in layers]
        self.dtypes = [kind.weight_of(m).dtype for _, m, kind in layers]
        self.stride = stride
        self.traced = False  # set by the graph at each run (a replayed side effect)
        self.values = torch.zeros(0)
        self.phase = torch.zeros(0)
        self.place(mpu.device)

    def place(self, device: torch.device) -> None:
        # float64: the commit point reads rows as float64 (no conversion, one stack for all)
        self.values = torch.zeros(len(self.names) + 1, 2, dtype=torch.float64, device=device)
        self.phase = torch.zeros((), dtype=torch.int64, device=device)


def _keep(old: torch.Tensor, resid: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """The pair to keep: the old one when it failed (a failure sticks to the commit), else the new."""
    new = torch.stack((resid.to(old.dtype), tol.to(old.dtype)))
    failed = ~(torch.isfinite(old[0]) & (old[0].abs() <= old[1]))
    return torch.where(failed, old, new)


class GraphChecks:
    """The in-graph ABFT and non-finite checks of the checksum detector's MPUs."""

    def __init__(self, *, stride: int, rtol: Callable[[torch.dtype, torch.device], float]) -> None:
        if stride < 1:
            raise ValueError(f"stride: expected >= 1, got {stride}")
        self.stride = stride
        self._rtol = rtol  # (dtype, device) -> rtol: ChecksumConfig.tolerance
        self._slots: dict[str, _Slot] = {}
        self._index: dict[int, int] = {}  # a linear layer's position in its MPU's slot, by module id

    def attach(self, mpu: Mpu, layers: list[tuple[str, nn.Module, LinearKind]]) -> None:
        """The MPU's slot; its layers' checks are called by the checksum detector's one forward
        hook per linear layer (`linear`), which comes here while dynamo traces."""
        self._slots[mpu.mpu_id] = _Slot(mpu, layers, self.stride)
        self._index.update({id(m): i for i, (_, m, _) in enumerate(layers)})

    def detach(self) -> None:
        self._slots.clear()
        self._index.clear()

    def traced(self, mpu: Mpu) -> bool:
        """The MPU's forward ran in a compiled graph (since the last commit)."""
        slot = self._slots.get(mpu.mpu_id)
        return slot is not None and slot.traced

    def stride_of(self, mpu_id: str) -> int:
        return self._slots[mpu_id].stride

    # --- eager, once a step -----------------------------------------------------------

    def begin_step(self, step: int, incident: dict[str, bool]) -> None:
        """The step's sample: stride 1 for an MPU in incident mode, else `stride`; the phase."""
        for mid, slot in self._slots.items():
            slot.stride = 1 if incident.get(mid) else self.stride
            device = slot.mpu.device
            if slot.values.device != device:  # moved (an L1 swap, an L2 fallback): state follows
                slot.place(device)
            slot.phase.fill_(step % slot.stride)

    def take(self) -> list[tuple[Mpu, list[tuple[str, str, torch.dtype, torch.Tensor]]]]:
        """The checks of the MPUs traced since the last call, still on the device: per MPU, its
        rows as the checksum detector keeps them for the commit point's one read (method, layer,
        dtype, a tensor (residual, tolerance)). The state is cleared for the next forwards."""
        out = []
        for s in self._slots.values():
            if not s.traced:
                continue
            kept = s.values.clone()  # the rows read at the commit; the slot starts afresh
            s.values.zero_()
            s.traced = False
            rows: list[tuple[str, str, torch.dtype, torch.Tensor]] = [
                ("abft", name, s.dtypes[i], kept[i]) for i, name in enumerate(s.names)
            ]
            rows.append(("nonfinite", "<output>", torch.float32, kept[len(s.names)]))
            out.append((s.mpu, rows))
        return out

    # --- traced (pure tensor ops) -----------------------------------------------------

    def linear(self, mpu_id: str, kind: LinearKind, module: nn.Module, args: tuple[object, ...], out: object) -> None:
        """A linear layer's check, traced (the checksum detector's hook calls it under dynamo)."""
        slot, i = self._slots[mpu_id], self._index[id(module)]
        y = kind.output_of(out)
        if not args or not isinstance(args[0], torch.Tensor) or y is None:
            return
        slot.traced = True
        with torch.no_grad():
            x = args[0].detach()
            y = y.detach()
            acc = torch.float64 if y.dtype == torch.float64 else torch.float32
            w, b = kind.weight_of(module).detach(), kind.bias_of(module)
            low = y.dtype in (torch.bfloat16, torch.float16)
            if low and w.dtype != y.dtype:  # autocast: the GEMM saw x and W rounded to y's dtype
                w = w.to(y.dtype)
                b = b.detach().to(y.dtype) if b is not None else None
            if low and x.dtype != y.dtype:
                x = x.to(y.dtype)
            x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
            n, s = x2.shape[0], slot.stride
            if s > 1 and n > 1:  # the step's sample of rows: phase, phase + s, ... (mod n)
                rows = (torch.arange((n + s - 1) // s, device=x2.device) * s + slot.phase) % n
                x2, y2 = x2.index_select(0, rows), y2.index_select(0, rows)
                n = rows.shape[0]
            red = 1 if kind.transposed else 0
            wc, wa = w.sum(red, dtype=acc), w.abs().sum(red, dtype=acc)
            # (products as mul + sum, not matmul: autocast would round them to bf16)
            pred = (x2.sum(0, dtype=acc) * wc).sum()
            scale = (x2.abs().sum(0, dtype=acc) * wa).sum()
            if b is not None:
                pred = pred + n * b.detach().sum(dtype=acc)
                scale = scale + n * b.detach().abs().sum(dtype=acc)
            resid = y2.sum(dtype=acc) - pred
            tol = scale * self._rtol(y.dtype, y.device) + 1e-30
            slot.values[i].copy_(_keep(slot.values[i], resid, tol))

    def output(self, mpu: Mpu, outs: list[torch.Tensor]) -> None:
        """The MPU output's non-finite check, traced (every forward, every MPU)."""
        slot = self._slots.get(mpu.mpu_id)
        if slot is None or not outs:
            return
        slot.traced = True
        with torch.no_grad():
            bad = torch.zeros((), dtype=torch.bool, device=slot.values.device)
            for t in outs:
                bad = bad | ~torch.isfinite(t.detach().sum(dtype=torch.float32)).to(bad.device)
            nan = torch.full((), math.nan, device=bad.device)
            resid = torch.where(bad, nan, torch.zeros_like(nan))
            last = len(slot.names)
            slot.values[last].copy_(_keep(slot.values[last], resid, torch.full_like(nan, math.inf)))
