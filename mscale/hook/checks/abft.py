"""One linear layer's ABFT check, and the judging of a step's check rows: the arithmetic of
mscale.hook.checks.checksum (whose docstring gives the identity and the tolerances), apart from the
detector that decides which layers and when.

A check row is (method, layer, dtype, value): value is (residual, tolerance) as floats, or a
tensor of those two on the device (read later, with the step's other rows). A row fails when
its residual is not finite or exceeds its tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypedDict

import torch
from torch import nn

from mscale.findings import Reason
from mscale.hook.checks import rounding
from mscale.hook.checks.linears import LinearKind
from mscale.hook.checks.weight_sums import WeightSums

# a check's (residual, tolerance): floats decided on the host, or a tensor of the two on the device
RowValue = torch.Tensor | tuple[float, float]
Row = tuple[str, str, torch.dtype, RowValue]


class RoundingSettings(TypedDict):
    """The bf16 check's settings (mscale.hook.checks.rounding.residual_and_tolerance's keywords)."""

    sigmas: float
    rtol32: float


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a check of outputs in `dtype` sums in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def passes(resid: float, tol: float) -> bool:
    return math.isfinite(resid) and abs(resid) <= tol


class LayerCheck:
    """The settings a layer's check needs from its detector: the weight sums' cache, the bf16
    check's signs and settings, the tolerance by dtype and device (ChecksumConfig.tolerance)."""

    def __init__(
        self,
        wsums: WeightSums,
        signs: rounding.Signs,
        rounding_cfg: RoundingSettings,
        tolerance: Callable[[torch.dtype, torch.device], float],
    ) -> None:
        self.wsums, self.signs, self.rounding, self.tolerance = wsums, signs, rounding_cfg, tolerance

    def row(
        self, module: nn.Module, kind: LinearKind, x: torch.Tensor, out: torch.Tensor, *, step: int, on_device: bool
    ) -> RowValue:
        """The (residual, tolerance) of y = x W^T + b for this forward: floats when `on_device`
        is False (a CPU decides at once), else a tensor of two left on the device."""
        acc = acc_dtype(out.dtype)
        # under autocast the GEMM saw x and W rounded to the output dtype: predict from those
        w = kind.weight_of(module)
        cast = out.dtype if out.dtype != w.dtype and out.dtype in (torch.bfloat16, torch.float16) else None
        if x.dtype != out.dtype and out.dtype in (torch.bfloat16, torch.float16):
            x = x.detach().to(out.dtype)
        if out.dtype == torch.bfloat16 and self.rounding["sigmas"] > 0:  # mscale.hook.checks.rounding
            r = self.signs.of(out.shape[-1], out.device)
            sums = self.wsums.of(module, step, kind, acc, cast, False, r)
            with torch.no_grad():
                x2, y2 = x.detach().reshape(-1, x.shape[-1]), out.detach().reshape(-1, out.shape[-1])
                # on CPU a value costs no device sync: one read, here
                return rounding.residual_and_tolerance(x2, y2, sums, self.signs, **self.rounding, host=not on_device)
        wc, wa, bs, ba = self.wsums.of(module, step, kind, acc, cast, not on_device)
        rtol = self.tolerance(out.dtype, x.device)
        with torch.no_grad():
            x2 = x.detach().reshape(-1, x.shape[-1])
            n = x2.shape[0]
            if x2.dtype == acc:  # a GEMV reads x once, faster than a column reduction
                sx = torch.mv(x2.t(), self.wsums.ones(n, x2.device, acc))
            else:  # low precision: sum in float32, not in the input's dtype
                sx = x2.sum(0, dtype=acc)
            total = out.detach().sum(dtype=acc)
            if on_device:
                # no host read per layer: residual and tolerance on the device, read with the
                # verdicts (after the forward, or at the commit point)
                resid = total - (sx @ wc + n * bs)
                tol = (x2.abs().sum(0, dtype=acc) @ wa + n * ba) * rtol + 1e-30
                return torch.stack((resid, tol))
            # On CPU a value costs no device sync, so decide here and skip the pass over |x|
            # when it cannot change the outcome: |sx| . c(|W|) <= S (|sum_n x_nk| <= sum_n |x_nk|,
            # c(|W|) >= 0), so a residual within rtol times that lower bound is within rtol * S.
            # The factor 0.99 absorbs the rounding of the two fp32 dot products. Only a residual
            # above it (a fault, or inputs whose columns cancel) pays for the exact S.
            bsf, baf = self.wsums.bias_floats[id(module)]
            t, p = total.item(), (sx @ wc).item() + n * bsf
            lo = (sx.abs() @ wa).item() + n * baf
            if abs(t - p) <= rtol * 0.99 * lo:
                return (t - p, rtol * lo + 1e-30)
            scale = (x2.abs().sum(0, dtype=acc) @ wa).item() + n * baf
            return (t - p, rtol * scale + 1e-30)


def layer_path(mpu_path: str, layer: str) -> str:
    """The model's name of a module blamed: `layer` (its name inside the MPU, "<self>" the MPU
    itself, "" its output) under the MPU's path ("<model>": the whole model)."""
    inner = "" if layer in ("", "<self>") else layer
    return ".".join(p for p in (mpu_path, inner) if p) or "<model>"


Failure = tuple[Reason, str, str, str]  # (reason, method, detail, the layer blamed: "" for the MPU's output)


def judge(rows: list[Row]) -> tuple[list[Failure], int]:
    """The failures among `rows`, at most one per method (ABFT's names the layer, so a replay's
    is left out beside it), and the host reads made (one for all the tensors among them)."""
    tensors = [r[3] for r in rows if isinstance(r[3], torch.Tensor)]
    values: list[float] = []
    if tensors:
        values = torch.cat([t.reshape(-1).to(torch.float64).cpu() for t in tensors]).tolist()
    off, failures = 0, []
    nonfinite = abft = replayed = False
    for method, layer, dtype, v in rows:
        if isinstance(v, torch.Tensor):
            resid, tol = values[off], values[off + 1]
            off += 2
        else:
            resid, tol = v
        if passes(resid, tol):
            continue
        if method == "nonfinite" and not nonfinite:
            nonfinite = True
            failures.append((Reason.NONFINITE_OUTPUT, "nonfinite", "MPU output has NaN or Inf", ""))
        elif method == "abft" and not abft:
            abft = True
            if not math.isfinite(resid):
                failures.append((Reason.NONFINITE_OUTPUT, "abft", f"layer {layer}: non-finite output", layer))
            else:
                detail = f"layer {layer} ({dtype}): residual {abs(resid):.3g} > tolerance {tol:.3g}"
                failures.append((Reason.CHECKSUM_FAILURE, "abft", detail, layer))
        elif method == "replay" and not (replayed or abft):
            replayed = True
            detail = (
                layer
                if not math.isfinite(resid) and tol == 0.0
                else (f"replay {layer}: max difference {resid:.3g} > tolerance {tol:.3g}")
            )
            failures.append((Reason.CHECKSUM_FAILURE, "replay", detail, ""))
    return failures, 1 if tensors else 0
