"""The weight's side of an ABFT check (mscale.hook.checks.checksum): its column sums c(W), c(|W|)
and its bias sums, as the GEMM saw the weight, cached per layer on a schedule, and the ones
vectors the GEMVs take. Kept apart from the detector: they depend on the weight and the step,
not on the forward being checked."""

from __future__ import annotations

import torch
from torch import nn

from mscale.hook.checks import rounding
from mscale.hook.checks.linears import LinearKind

ABS_REFRESH = 16  # steps between refreshes of the |W| column sums (tolerance scale only)

# (c(W) or W^T r, c(|W|), sum(b) or r . b, sum|b|)
Sums = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# what the signed sums were taken of: (step or -1 when frozen, version, storage, accumulation
# dtype, cast, floats, signed by r)
_Key = tuple[int, int, int, torch.dtype, torch.dtype | None, bool, bool]
# a layer's cache entry: (key, sums, step of the |W| sums, step of the signed sums, first step seen)
_Cached = tuple[_Key, Sums, int, int, int]


class WeightSums:
    def __init__(self) -> None:
        self.cache: dict[int, _Cached] = {}  # by id(module)
        # a 0-d zero per (dtype, device): no allocation a check
        self.zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._ones_cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
        # the CPU's in-step check adds the bias terms as Python floats, read once per refresh
        self.bias_floats: dict[int, tuple[float, float]] = {}

    def clear(self) -> None:
        self.cache.clear()

    def of(
        self,
        module: nn.Module,
        step: int,
        kind: LinearKind,
        acc: torch.dtype,
        cast: torch.dtype | None,
        floats: bool,
        signs: torch.Tensor | None = None,
    ) -> Sums:
        """(c(W), c(|W|), sum(b), sum|b|) of the weight as the GEMM saw it, cached; with `signs`
        (r, bf16 layers: mscale.hook.checks.rounding) the weighted W^T r and r . b for the first and third.

        A trained weight changes every optimizer step (and fused optimizers update it without
        bumping `_version`), so its signed sums are recomputed once per step; a frozen weight
        (requires_grad False: no optimizer touches it) only when its version or storage
        changes, with a refresh every ABS_REFRESH steps in case it was written through
        `.data`. The |W| sums only size the tolerance: refreshed 1, 2, 4, 8 steps after the
        layer is first seen, then every ABS_REFRESH steps, so a weight growing from a near-zero
        init (Blip2's qkv: 1e-10 to 1e-3 in Adam's first step) is never sized more than 2x
        small."""
        w = kind.weight_of(module)
        key = (step if w.requires_grad else -1, w._version, w.data_ptr(), acc, cast, floats, signs is not None)
        cached = self.cache.get(id(module))
        first = step if cached is None else cached[4]
        gap = min(ABS_REFRESH, max(1, (cached[2] if cached else step) - first))
        if cached is not None and cached[0] == key and step - cached[3] < ABS_REFRESH and step - cached[2] < gap:
            return cached[1]
        with torch.no_grad():
            wd = w.detach() if cast is None else w.detach().to(cast)
            bias = kind.bias_of(module)
            b = None if bias is None else (bias.detach() if cast is None else bias.detach().to(cast))
            zero = self.zeros.get((acc, w.device))
            if zero is None:
                zero = self.zeros[(acc, w.device)] = torch.zeros((), dtype=acc, device=w.device)
            # the sums over the output dimension: dim 0 of an (out, in) weight, 1 of an (in, out)
            red = 1 if kind.transposed else 0
            # the |W| sums on their schedule (or after a change of storage/dtype)
            if cached is None or step - cached[2] >= gap or cached[0][2:] != key[2:]:
                absums = (wd.abs().sum(red, dtype=acc), b.abs().sum(dtype=acc) if b is not None else zero)
                abs_step = step
            else:
                absums, abs_step = (cached[1][1], cached[1][3]), cached[2]
            wc, bs = self._signed(wd, b, kind, acc, signs, zero)
            sums = (wc, absums[0], bs, absums[1])
        self.cache[id(module)] = (key, sums, abs_step, step, first)
        if floats:  # the CPU's in-step check adds the bias terms in Python
            self.bias_floats[id(module)] = (sums[2].item(), sums[3].item())
        return sums

    def _signed(
        self,
        wd: torch.Tensor,
        b: torch.Tensor | None,
        kind: LinearKind,
        acc: torch.dtype,
        signs: torch.Tensor | None,
        zero: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """c(W) and sum(b), or with `signs` W^T r and r . b."""
        if signs is not None:
            wc = rounding.weighted_colsums(wd, signs, kind.transposed)
            return wc, (b.to(torch.float32) @ signs if b is not None else zero)
        # GEMVs (torch.mv) read W once, faster than a column reduction; and mv, unlike a 1-row
        # matmul, is no FLOP of FlopCounterMode's, so MSRP does not count the checks as the MPU's work
        if wd.dtype == acc and not kind.transposed:
            wc = torch.mv(wd.t(), self.ones(wd.shape[0], wd.device, acc))
        elif wd.dtype == acc:
            wc = torch.mv(wd, self.ones(wd.shape[1], wd.device, acc))
        else:
            wc = wd.sum(1 if kind.transposed else 0, dtype=acc)
        return wc, (b.sum(dtype=acc) if b is not None else zero)

    def ones(self, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        ones = self._ones_cache.get((n, device, dtype))
        if ones is None:
            if len(self._ones_cache) > 64:  # variable sequence lengths: keep the cache bounded
                self._ones_cache.clear()
            ones = self._ones_cache[(n, device, dtype)] = torch.ones(n, dtype=dtype, device=device)
        return ones
