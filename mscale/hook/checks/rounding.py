"""ABFT for bfloat16 outputs (mscale.hook.checks.checksum): the tolerance from the output's own rounding.

For y = x W^T + b with y of shape (N, M) rounded once to bf16 from a float32 accumulator, each
output's rounding error is within half an ulp, ulp <= 2^-7 |y|: standard deviation at most
2^-7/sqrt(12) |y| (`BF16_ROUNDING`). The check sums the outputs with fixed random +-1 weights,
s_n r_o (s one per row, r one per output feature, each balanced), predicted without the GEMM as

    s^T Y r = sum_n s_n y_n . r = (x^T s) . (W^T r) + (sum_n s_n)(r . b)

The weights make the rounding errors add like a random walk whatever their bias (a kernel that
truncates rather than rounds to nearest) and whatever their structure: outputs alike along a
column (attention that averages over many tokens) round alike, and with weights per feature
alone their errors added coherently, 13x the random walk in a tiny LLaVA at 257 tokens. The
weighted sum's rounding then has standard deviation at most BF16_ROUNDING x ||Y||_F, and the
tolerance is `sigmas` of that plus rtol32 x a lower bound of S (the float32 arithmetic). rtol[bfloat16] x S, the worst-case bound the
other dtypes use, is about sqrt(N K M) times larger: it hides noise of the output's own size.

The check's sums and products run with autocast off: under autocast a matmul of two float32
vectors runs in bf16 (CPU: matmul; CUDA: mv and matmul too), whose rounding of the prediction
is the size of the faults to find (the false alarms that made an earlier rounding-based
tolerance fail on this CPU came from there, not from the GEMM).
"""

from __future__ import annotations

import contextlib
import math

import torch

from mscale.hook.checks.checksum_config import BF16_ROUNDING

SIGN_SEED = 0x5EED  # one fixed draw: the same weights every step, so a frozen layer's W^T r is cached


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """A context in which the check's own products run in the dtype of their operands."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class Signs:
    """Fixed random balanced +-1 vectors (n // 2 of +1, the rest -1: a sum of -(n % 2)), one per
    (length, device, dtype); bounded. Balanced, a component constant along the vector (outputs
    alike across tokens, or across features, whose roundings are alike too) cancels exactly."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def of(self, n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        r = self._cache.get((n, device, dtype))
        if r is None:
            if len(self._cache) > 128:  # variable sequence lengths: keep the cache bounded
                self._cache.clear()
            v = torch.ones(n)
            v[n // 2 :] = -1.0
            r = v[torch.randperm(n, generator=torch.Generator().manual_seed(SIGN_SEED + n))].to(device, dtype)
            self._cache[(n, device, dtype)] = r
        return r


def weighted_colsums(wd: torch.Tensor, r: torch.Tensor, transposed: bool) -> torch.Tensor:
    """W^T r in float32 (per input feature) for an (out, in) weight, or an (in, out) one when
    `transposed`: a GEMV, on a float32 copy of a low-precision weight (exact)."""
    wf = wd if wd.dtype == torch.float32 else wd.to(torch.float32)
    return torch.mv(wf, r) if transposed else torch.mv(wf.t(), r)


def residual_and_tolerance(
    x2: torch.Tensor,
    y2: torch.Tensor,
    sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    signs: Signs,
    *,
    sigmas: float,
    rtol32: float,
    host: bool = False,
) -> torch.Tensor | tuple[float, float]:
    """(residual, tolerance) of a bf16 layer's check, s^T Y r against (x^T s) . (W^T r) +
    (sum s)(r . b): x2 (N, K) the input as the GEMM saw it, y2 (N, M) its output, sums (W^T r,
    c(|W|), r . b, sum|b|) with r = signs.of(M). A float32 tensor of 2 on the device (no host
    read), or with `host` (a CPU, where a read costs no sync) two floats from one read, the
    scalar arithmetic done in Python (fewer small tensor ops).

    x^T s and Y r are bf16 GEMVs (each reads its tensor once, accumulating in float32: on this
    CPU 6-8x faster than a float32-accumulating bf16 reduction, on a GPU no float32 copy), and
    ||Y||_F^2 a bf16 dot; the GEMVs' outputs are rounded to bf16 too, an error of standard
    deviation at most BF16_ROUNDING x their magnitude, which the tolerance adds in quadrature."""
    wr, wa, br, ba = sums
    n, dev = x2.shape[0], x2.device
    sx = torch.mv(x2.t(), signs.of(n, dev, x2.dtype)).float()
    u = torch.mv(y2, signs.of(y2.shape[1], dev, y2.dtype)).float()
    flat = y2.reshape(-1)
    swr = sx * wr
    odd = n % 2  # the sum of s is -1: the prediction's bias term is -(r . b)
    parts = (signs.of(n, dev) @ u, swr.sum(), sx.abs() @ wa, torch.dot(flat, flat).float(), u @ u, swr @ swr)
    if host:
        su, p, lo, yy, uu, ww = torch.stack(parts).tolist()
        if odd:
            b, a = torch.stack((br, ba)).tolist()
            p, lo = p - b, lo + a
        t = sigmas * BF16_ROUNDING * math.sqrt(yy + uu + ww) + rtol32 * lo + 1e-30
        return su - p, t if math.isfinite(t) else 0.0
    su, p, lo, yy, uu, ww = parts
    if odd:
        p, lo = p - br, lo + ba
    tol = sigmas * BF16_ROUNDING * (yy + uu + ww).sqrt() + rtol32 * lo + 1e-30
    # an output whose norm overflows (an exponent flip: x 2^128) is no rounding: a tolerance
    # that is not finite fails the check
    return torch.stack((su - p, torch.nan_to_num(tol, nan=0.0, posinf=0.0)))
