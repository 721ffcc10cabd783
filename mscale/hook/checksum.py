"""Tensor checksums on MPU outputs, in-process: ABFT on every linear layer, every step, and
sampled replay of the whole MPU forward.

ABFT (algorithm-based fault tolerance, Huang & Abraham 1984) for y = x W^T + b with x of
shape (N, in): the sum of all outputs is predictable from the input's column sums and the
weight's column sums, without the GEMM:

    sum(y) = sum_n x_n . c(W) + N * sum(b)          c(W)_k = sum_o W_ok
    |sum(y) - prediction| <= rtol[dtype] * S        S = sum_n |x_n| . c(|W|) + N * sum|b|

S bounds every product term of the GEMM, so the tolerance scales with the rounding the GEMM
itself can make. Cost per linear and step: one pass over x (a GEMV for its column sums), one
over y, one over W for c(W) (a trained weight changes every step; a frozen one is cached);
c(|W|) only sizes the tolerance and is refreshed every 16 steps. On CPU, S itself (another
pass over x) is computed only when the residual exceeds rtol times its lower bound
|sum_n x_n| . c(|W|): the same decision, paid for only by a fault or cancelling inputs.
The check sums run in float32 (float64 for float64 layers), so a bf16
layer's tolerance covers its own output rounding, not the check's. rtol per output dtype
(`DEFAULT_RTOL`): float32 2e-6, bfloat16 1e-2, float16 2e-3, float64 1e-12; float32 on CUDA
while TF32 matmuls are allowed at least `TF32_RTOL` (2e-3, see there). With those, no
false positive in 1,000 clean fp32 steps of the tiny model (tests/test_checksum.py) nor in
the bf16 runs, and the faults that matter are caught: an exponent-bit flip (a value scaled
by 2^k), a flip of the top mantissa bits of an ordinary element, scaled noise, NaN/Inf. A
flip in the low mantissa bits of a small element is below the rounding of the GEMM itself
and cannot be told apart from it (nor does it matter to training).

Replay: one step in K (`replay_every`) the MPU's forward is run again on the same input
under no_grad and compared: max |difference| <= replay_rtol (1e-5) * max |output|, in any
dtype (a recomputation on the same device is bitwise equal with deterministic kernels), so
replay sees in bf16 what ABFT cannot: a transient mantissa flip. The RNG state of the original
forward is restored for the replay (dropout draws the same masks) and the training RNG
stream is put back afterwards, so replay changes no random number the run sees; BatchNorm's
running statistics are swapped for copies during the replay, so they are updated once per step.

Checking fewer steps (`abft_every` K > 1, opt-in): ABFT runs one step in K, the non-finite
check every step. A step without ABFT that passes counts as no check at all, so a persistent
fault still makes an L1 trigger after `failures_l1` checked steps (K times as many steps); a
transient fault in a step without ABFT is seen only by replay. ABFT reads each linear's
input, output and weight once a step, which on a memory-bound CPU is ~1.4% of a step at
benchmarks/hook_overhead.py's realistic shape; K = 2 halves that.

A non-finite MPU output is always a failure. N consecutive failed checks of an MPU
(`failures_l1`, default 3) emit CHECKSUM_L1_TRIGGER. Nothing here raises into training:
results are findings passed to `emit`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mscale.findings import Finding, Reason, Severity

SOURCE = "checksum"
ABS_REFRESH = 16  # steps between refreshes of the |W| column sums (tolerance scale only)

DEFAULT_RTOL: dict[torch.dtype, float] = {
    torch.float32: 2e-6,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
    torch.float64: 1e-12,
}
# TF32 keeps float32's exponent and 10 of its 23 mantissa bits: cuBLAS rounds x and W to it
# (unit roundoff 2^-11 ~ 4.9e-4 each, so up to ~2^-10 ~ 9.8e-4 per product term of S) and
# accumulates in float32. 2e-3 is twice that worst case per term, float16's rtol (the same
# 10-bit mantissa), and still ~5000x below the scaling of a single exponent-bit flip.
TF32_RTOL = 2e-3


@dataclass(frozen=True)
class ChecksumConfig:
    abft: bool = True  # ABFT on every nn.Linear inside each MPU, every forward
    # ABFT one step in this many (opt-in > 1: see "Checking fewer steps" in the docstring)
    abft_every: int = 1
    replay_every: int = 100  # replay one step in this many (0: never)
    failures_l1: int = 3  # consecutive failed checks that make an L1 trigger
    # replay recomputes on the same device: deterministic kernels agree bitwise, so the
    # tolerance (relative to the output's largest magnitude) only absorbs reduction-order
    # noise of non-deterministic kernels, in any dtype
    replay_rtol: float = 1e-5
    rtol: Mapping[torch.dtype, float] = field(default_factory=lambda: dict(DEFAULT_RTOL))
    tf32_rtol: float = TF32_RTOL  # float32 GEMMs on CUDA while TF32 is allowed (see TF32_RTOL)

    def __post_init__(self) -> None:
        if self.replay_every < 0:
            raise ValueError(f"replay_every: expected >= 0, got {self.replay_every}")
        if not 1 <= self.abft_every <= 1000:
            raise ValueError(f"abft_every: expected 1..1000, got {self.abft_every}")
        if self.failures_l1 < 1:
            raise ValueError(f"failures_l1: expected >= 1, got {self.failures_l1}")

    def tolerance(
        self, dtype: torch.dtype, device: torch.device | str | None = None, *, tf32: bool | None = None
    ) -> float:
        """rtol for a GEMM with output `dtype` on `device`: by dtype; a float32 GEMM on CUDA while
        TF32 is allowed (`tf32`, default torch.backends.cuda.matmul.allow_tf32, which
        torch.set_float32_matmul_precision("high"/"medium") also turns on) at no less than
        `tf32_rtol`: cuBLAS then rounds its inputs to TF32's 10-bit mantissa."""
        rtol = self.rtol.get(dtype, DEFAULT_RTOL.get(dtype, 1e-2))
        if dtype != torch.float32 or device is None or torch.device(device).type != "cuda":
            return rtol
        if tf32 is None:
            tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        return max(rtol, self.tf32_rtol) if tf32 else rtol


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (tensor, tuple, dict, ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in output_tensors(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in output_tensors(v)]
    return []


def loss_of(output: Any) -> torch.Tensor | None:
    """The scalar loss in a model's output (a 0-d tensor, or a mapping or ModelOutput with
    "loss"); None when there is none."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rng_get(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _rng_set(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _stand_in_stats(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Give every normalisation layer with running statistics (BatchNorm's running_mean,
    running_var, num_batches_tracked), which a training-mode forward updates in place, copies
    to update instead; returns (layer, name, original) to put back. The originals are not
    written at all: autograd saved them for the step's backward, and a write, even of the same
    values, would bump their version and fail that backward."""
    out: list[tuple[nn.Module, str, torch.Tensor]] = []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                b = m._buffers.get(name)
                if b is not None:
                    m._buffers[name] = b.detach().clone()
                    out.append((m, name, b))
    return out


class _MpuChecks:
    __slots__ = ("pending", "rng", "forwards", "step", "layer_names", "abft")

    def __init__(self, layer_names: dict[int, str]) -> None:
        self.pending: list[tuple[str, torch.dtype, torch.Tensor | tuple[float, float, float]]] = []
        self.rng: tuple | None = None
        self.forwards = 0
        self.step = -1
        self.layer_names = layer_names
        self.abft = True  # whether ABFT checks this step


class ChecksumDetector:
    """Owned by the Guard; `attach(mpu)` registers the ABFT hooks of the MPU's linears,
    the Guard calls `before_forward`/`after_forward` around each MPU forward."""

    def __init__(self, config: ChecksumConfig, *, emit: Callable[[Finding], None], step: Callable[[], int]) -> None:
        self.config = config
        self._emit = emit
        self._step = step
        self._mpus: dict[int, _MpuChecks] = {}
        self._handles: list[Any] = []
        self._wcache: dict[int, tuple] = {}
        self._ones: dict[tuple, torch.Tensor] = {}
        self._bias_floats: dict[int, tuple[float, float]] = {}
        self.replaying = False
        # seconds spent in ABFT (linear hooks + evaluation) and in replays; the Guard resets
        # them each step (benchmarks/hook_overhead.py reads them)
        self.abft_s = 0.0
        self.replay_s = 0.0

    def attach(self, mpu: Any) -> None:
        names = {id(m): n or "<self>" for n, m in mpu.module.named_modules() if isinstance(m, nn.Linear)}
        self._mpus[id(mpu)] = _MpuChecks(names)
        if not self.config.abft:
            return
        for _, m in mpu.module.named_modules():
            if isinstance(m, nn.Linear):
                self._handles.append(
                    m.register_forward_hook(
                        lambda mod, args, out, mpu=mpu: self._linear(mpu, mod, args, out), prepend=True
                    )
                )

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._wcache.clear()

    def forget(self, mpu: Any) -> None:
        """Drop cached weight sums (the MPU moved device)."""
        self._wcache.clear()

    def is_abft_step(self, step: int) -> bool:
        return self.config.abft and step % self.config.abft_every == 0

    def is_replay_step(self, step: int) -> bool:
        k = self.config.replay_every
        return k > 0 and step % k == k - 1

    # --- per forward -----------------------------------------------------------------

    def before_forward(self, mpu: Any) -> None:
        st = self._mpus[id(mpu)]
        step = self._step()
        if st.step != step:
            st.step, st.forwards = step, 0
        st.forwards += 1
        st.pending = []
        st.abft = self.is_abft_step(step)
        st.rng = _rng_get(mpu.device) if self.is_replay_step(step) and st.forwards == 1 else None

    def _linear(self, mpu: Any, module: nn.Linear, args: tuple, out: Any) -> None:
        if self.replaying or not args or not isinstance(out, torch.Tensor):
            return
        st = self._mpus.get(id(mpu))
        if st is None or not st.abft:
            return
        t0 = time.perf_counter()
        self._abft_sums(st, module, args[0], out)
        self.abft_s += time.perf_counter() - t0

    def _weight_sums(self, module: nn.Linear, acc: torch.dtype, cast: torch.dtype | None) -> tuple:
        """(c(W), c(|W|), sum(b), sum|b|) of the weight as the GEMM saw it, cached.

        A trained weight changes every optimizer step (and fused optimizers update it without
        bumping `_version`), so its signed sums are recomputed once per step; a frozen weight
        (requires_grad False: no optimizer touches it) only when its version or storage
        changes, with a refresh every ABS_REFRESH steps in case it was written through
        `.data`. The |W| sums only size the tolerance and drift slowly: every ABS_REFRESH steps."""
        w = module.weight
        step = self._step()
        key = (step if w.requires_grad else -1, w._version, w.data_ptr(), acc, cast)
        cached = self._wcache.get(id(module))
        if cached is not None and cached[0] == key and step - cached[3] < ABS_REFRESH:
            return cached[1]
        with torch.no_grad():
            wd = w.detach() if cast is None else w.detach().to(cast)
            bias = module.bias
            b = None if bias is None else (bias.detach() if cast is None else bias.detach().to(cast))
            zero = torch.zeros((), dtype=acc, device=w.device)
            # the |W| sums every ABS_REFRESH steps (or after a change of storage/dtype)
            if cached is None or step - cached[2] >= ABS_REFRESH or cached[0][2:] != key[2:]:
                absums = (wd.abs().sum(0, dtype=acc), b.abs().sum(dtype=acc) if b is not None else zero)
                abs_step = step
            else:
                absums = (cached[1][1], cached[1][3])
                abs_step = cached[2]
            if wd.dtype == acc:  # a GEMV reads W once, faster than a column reduction
                wc = self._ones_of(wd.shape[0], wd.device, acc) @ wd
            else:
                wc = wd.sum(0, dtype=acc)
            sums = (wc, absums[0], b.sum(dtype=acc) if b is not None else zero, absums[1])
        self._wcache[id(module)] = (key, sums, abs_step, step)
        if w.device.type == "cpu":  # the CPU check adds the bias terms in Python
            self._bias_floats[id(module)] = (sums[2].item(), sums[3].item())
        return sums

    def _ones_of(self, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        ones = self._ones.get((n, device, dtype))
        if ones is None:
            if len(self._ones) > 64:  # variable sequence lengths: keep the cache bounded
                self._ones.clear()
            ones = self._ones[(n, device, dtype)] = torch.ones(n, dtype=dtype, device=device)
        return ones

    def _abft_sums(self, st: _MpuChecks, module: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> None:
        acc = _acc(out.dtype)
        # under autocast the GEMM saw x and W rounded to the output dtype: predict from those
        w = module.weight
        cast = out.dtype if out.dtype != w.dtype and out.dtype in (torch.bfloat16, torch.float16) else None
        wc, wa, bs, ba = self._weight_sums(module, acc, cast)
        if x.dtype != out.dtype and out.dtype in (torch.bfloat16, torch.float16):
            x = x.detach().to(out.dtype)
        layer = st.layer_names.get(id(module), "?")
        with torch.no_grad():
            x2 = x.detach().reshape(-1, x.shape[-1])
            n = x2.shape[0]
            if x2.dtype == acc:  # a GEMV reads x once, faster than a column reduction
                sx = self._ones_of(n, x2.device, acc) @ x2
            else:  # low precision: sum in float32, not in the input's dtype
                sx = x2.sum(0, dtype=acc)
            total = out.detach().sum(dtype=acc)
            if x2.device.type != "cpu":
                # no host sync per layer on an accelerator: the scale S on the device, every
                # check read back together in after_forward
                pred = sx @ wc + n * bs
                scale = x2.abs().sum(0, dtype=acc) @ wa + n * ba
                st.pending.append((layer, out.dtype, torch.stack((total, pred, scale))))
                return
            # On CPU a value costs no device sync, so decide here and skip the pass over |x|
            # when it cannot change the outcome: |sx| . c(|W|) <= S (|sum_n x_nk| <= sum_n |x_nk|,
            # c(|W|) >= 0), so a residual within rtol times that lower bound is within rtol * S.
            # The factor 0.99 absorbs the rounding of the two fp32 dot products. Only a residual
            # above it (a fault, or inputs whose columns cancel) pays for the exact S.
            bsf, baf = self._bias_floats[id(module)]
            t, p = total.item(), (sx @ wc).item() + n * bsf
            lo = (sx.abs() @ wa).item() + n * baf
            if abs(t - p) <= self.config.tolerance(out.dtype) * 0.99 * lo:
                st.pending.append((layer, out.dtype, (t, p, lo)))
                return
            scale = (x2.abs().sum(0, dtype=acc) @ wa).item() + n * baf
            st.pending.append((layer, out.dtype, (t, p, scale)))

    def after_forward(self, mpu: Any, inputs: Any, output: Any) -> bool:
        """Evaluate this forward's checks; update the MPU's counters; emit findings.
        Returns whether the checks passed."""
        t0 = time.perf_counter()
        st = self._mpus[id(mpu)]
        outs = output_tensors(output)
        failures: list[tuple[Reason, str, str]] = []  # (reason, method, detail)
        with torch.no_grad():
            sums = [t.detach().sum(dtype=_acc(t.dtype)).to(torch.float64) for t in outs]
            # (CPU checks arrive as floats, decided in the hook; device checks as tensors)
            rows = [p[2].to(torch.float64) for p in st.pending if isinstance(p[2], torch.Tensor)]
            flat = torch.cat([torch.stack(sums)] + rows) if (sums or rows) else torch.zeros(0)
            values = flat.tolist()  # the one sync of this check
        if not all(math.isfinite(v) for v in values[: len(sums)]):
            failures.append((Reason.NONFINITE_OUTPUT, "nonfinite", "MPU output has NaN or Inf"))
        off = len(sums)
        for layer, dtype, checked in st.pending:
            if isinstance(checked, torch.Tensor):
                total, pred, scale = values[off : off + 3]
                off += 3
            else:
                total, pred, scale = checked
            where = checked.device if isinstance(checked, torch.Tensor) else None  # floats: the CPU's
            tol = self.config.tolerance(dtype, where) * scale + 1e-30
            if not math.isfinite(total):
                failures.append((Reason.NONFINITE_OUTPUT, "abft", f"layer {layer}: non-finite output"))
                break
            if not abs(total - pred) <= tol:
                failures.append(
                    (
                        Reason.CHECKSUM_FAILURE,
                        "abft",
                        f"layer {layer} ({dtype}): sum {total:.6g} vs predicted {pred:.6g}, "
                        f"residual {abs(total - pred):.3g} > tolerance {tol:.3g}",
                    )
                )
                break
        st.pending = []
        t1 = time.perf_counter()
        self.abft_s += t1 - t0
        counted = st.abft or not self.config.abft  # (without ABFT at all, as it always was)
        if st.rng is not None:
            counted = True
            detail = self._replay(mpu, st, st.rng, inputs, outs)
            if detail:
                failures.append((Reason.CHECKSUM_FAILURE, "replay", detail))
            self.replay_s += time.perf_counter() - t1
        if not counted and not failures:
            return True  # a step that skipped ABFT (abft_every) neither counts nor ends a failure run
        return self._record(mpu, failures)

    def _replay(self, mpu: Any, st: _MpuChecks, rng: tuple, inputs: Any, outs: list[torch.Tensor]) -> str:
        device = mpu.device
        saved = _rng_get(device)
        _rng_set(device, rng)
        st.rng = None
        self.replaying = True
        stats = _stand_in_stats(mpu.module)  # the step's forward updated them once; not the replay
        try:
            with torch.no_grad():
                again = output_tensors(mpu.module(*inputs.args, **inputs.kwargs))
        finally:
            self.replaying = False
            _rng_set(device, saved)
            for layer, name, original in stats:
                layer._buffers[name] = original
        if len(again) != len(outs):
            return f"replay returned {len(again)} tensors, the step {len(outs)}"
        for i, (a, b) in enumerate(zip(outs, again, strict=True)):
            if a.shape != b.shape:
                return f"replay output {i}: shape {tuple(b.shape)} != {tuple(a.shape)}"
            a64, b64 = a.detach().to(torch.float64), b.to(torch.float64)
            diff = (a64 - b64).abs().max().item() if a.numel() else 0.0
            ref = a64.abs().max().item() if a.numel() else 0.0
            tol = self.config.replay_rtol * max(ref, 1e-30)
            if not (math.isfinite(diff) and diff <= tol):
                return f"replay output {i}: max difference {diff:.3g} > tolerance {tol:.3g}"
        return ""

    def _record(self, mpu: Any, failures: list[tuple[Reason, str, str]]) -> bool:
        mpu.checksum_checks_total += 1
        if not failures:
            mpu.consecutive_failures = 0
            mpu.last_checksum_ok = True
            return True
        mpu.consecutive_failures += 1
        mpu.checksum_failures_total += 1
        mpu.last_checksum_ok = False
        labels = {"mpu_id": mpu.mpu_id, "mpu": mpu.name, "gpu": str(mpu.gpu)}
        if mpu.gpu_uuid:
            labels["gpu_uuid"] = mpu.gpu_uuid
        for reason, method, detail in failures:
            sev = Severity.CRITICAL if reason is Reason.NONFINITE_OUTPUT else Severity.WARNING
            self._emit(Finding(SOURCE, reason, sev, f"{mpu.name}: {detail}", {**labels, "method": method}))
        n = self.config.failures_l1
        if mpu.consecutive_failures % n == 0:
            self._emit(
                Finding(
                    SOURCE,
                    Reason.CHECKSUM_L1_TRIGGER,
                    Severity.CRITICAL,
                    f"{mpu.name}: {mpu.consecutive_failures} consecutive checksum failures",
                    {**labels, "consecutive": str(mpu.consecutive_failures)},
                )
            )
        return False
