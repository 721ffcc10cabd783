"""Output-corruption injector: silent data corruption as a faulty GPU would make it.

Forward hooks corrupt an MPU's computation for a number of steps: by default the output of
the first linear layer (GEMM) of each forward of the MPU, so the corruption flows through
to the MPU's output as it would from a bad multiply on the GPU (site="linear"); or the MPU's
final output itself (site="output"). Kinds:

- exponent_flip: one element, one exponent bit flipped (default the top one: x * 2^128 in
  fp32, or Inf/NaN for |x| >= 1)
- mantissa_flip: one element, one mantissa bit flipped (default the top one: a change of
  a quarter to a half of the value)

The element hit is drawn at random (element="random") or is the largest in magnitude
(element="max", the value that matters most downstream).
- noise: Gaussian noise of `noise_scale` times the tensor's standard deviation, everywhere
- nan: one element set to NaN

Target an MPU (`mpu`, id or name) or every MPU bound to a simulated GPU index (`gpu`). The
binding is read at every forward, so rebinding the MPU to another GPU (an L1 swap) clears
the corruption. Replays of the same step are corrupted too (the GPU is still faulty). The
injector draws from its own generator: the training RNG stream is untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

KINDS = ("exponent_flip", "mantissa_flip", "noise", "nan")
SITES = ("linear", "output")

# dtype -> (int view dtype, top exponent bit, top mantissa bit)
_BITS = {
    torch.float32: (torch.int32, 30, 22),
    torch.bfloat16: (torch.int16, 14, 6),
    torch.float16: (torch.int16, 14, 9),
    torch.float64: (torch.int64, 62, 51),
}


@dataclass
class Hit:
    step: int
    mpu_id: str
    gpu: int
    where: str  # layer name or "<output>"
    index: int  # flat index of the element (-1 for noise)
    before: float
    after: float


def corrupt(
    y: torch.Tensor,
    kind: str,
    gen: torch.Generator,
    *,
    bit: int | None = None,
    noise_scale: float = 1.0,
    element: str = "random",
) -> tuple[torch.Tensor, int, float, float]:
    """A corrupted copy of `y`, the flat index hit, the value before and after."""
    out = y.clone()
    with torch.no_grad():
        flat = out.view(-1)
        if kind == "noise":
            std = float(y.detach().float().std()) if y.numel() > 1 else 1.0
            noise = torch.randn(flat.shape, generator=gen, dtype=torch.float32).to(flat.dtype)
            flat.add_(noise * (noise_scale * (std or 1.0)))
            return out, -1, float("nan"), float("nan")
        if element == "max":
            idx = int(flat.detach().abs().float().nan_to_num(0.0).argmax())
        else:
            idx = int(torch.randint(flat.numel(), (1,), generator=gen))
        before = float(flat[idx])
        if kind == "nan":
            flat[idx] = float("nan")
        else:
            int_dtype, exp_bit, man_bit = _BITS[y.dtype]
            b = bit if bit is not None else (exp_bit if kind == "exponent_flip" else man_bit)
            word = flat[idx : idx + 1].view(int_dtype)
            word.bitwise_xor_(
                torch.tensor(1 << b, dtype=int_dtype) if b < 63 else torch.tensor(-(1 << 63), dtype=int_dtype)
            )
        return out, idx, before, float(flat[idx])


@dataclass
class Injector:
    """Registers its hooks on construction; `remove()` takes them off."""

    mpus: list[Any]
    step: Callable[[], int]
    kind: str
    steps: int = 1
    mpu: str | None = None
    gpu: int | None = None
    site: str = "linear"
    bit: int | None = None
    noise_scale: float = 1.0
    element: str = "random"
    seed: int = 0
    hits: list[Hit] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.site not in SITES:
            raise ValueError(f"site: expected one of {', '.join(SITES)}, got {self.site!r}")
        if self.element not in ("random", "max"):
            raise ValueError(f"element: expected random or max, got {self.element!r}")
        if (self.mpu is None) == (self.gpu is None):
            raise ValueError("give exactly one target: mpu (id or name) or gpu (index)")
        if self.steps < 1:
            raise ValueError(f"steps: expected >= 1, got {self.steps}")
        if self.mpu is not None and not any(self.mpu in (m.mpu_id, m.name) for m in self.mpus):
            raise ValueError(f"mpu: no MPU {self.mpu!r} (known: {', '.join(m.name for m in self.mpus)})")
        self._gen = torch.Generator().manual_seed(self.seed)
        self._steps_hit: set[int] = set()
        self._armed: dict[int, bool] = {}
        self._handles: list[Any] = []
        for m in self.mpus:
            self._handles.append(m.module.register_forward_pre_hook(lambda mod, args, m=m: self._arm(m), prepend=True))
            if self.site == "output":
                self._handles.append(
                    m.module.register_forward_hook(lambda mod, args, out, m=m: self._hit_output(m, out), prepend=True)
                )
            else:
                for name, sub in m.module.named_modules():
                    if isinstance(sub, nn.Linear):
                        self._handles.append(
                            sub.register_forward_hook(
                                lambda mod, args, out, m=m, name=name: self._hit_linear(m, name or "<self>", out),
                                prepend=True,
                            )
                        )

    @property
    def done(self) -> bool:
        return len(self._steps_hit) >= self.steps and self.step() not in self._steps_hit

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def targets(self, m: Any) -> bool:
        if self.mpu is not None:
            return self.mpu in (m.mpu_id, m.name)
        return m.gpu == self.gpu  # read at every forward: a rebind clears it

    def _arm(self, m: Any) -> None:
        step = self.step()
        active = self.targets(m) and (step in self._steps_hit or len(self._steps_hit) < self.steps)
        if active:
            self._steps_hit.add(step)
        self._armed[id(m)] = active

    def _hit(self, m: Any, where: str, out: Any) -> Any:
        if not self._armed.get(id(m)) or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        self._armed[id(m)] = False  # one corruption per forward of the MPU
        bad, idx, before, after = corrupt(
            out, self.kind, self._gen, bit=self.bit, noise_scale=self.noise_scale, element=self.element
        )
        self.hits.append(Hit(self.step(), m.mpu_id, m.gpu, where, idx, before, after))
        return bad

    def _hit_linear(self, m: Any, name: str, out: Any) -> Any:
        return self._hit(m, name, out)

    def _hit_output(self, m: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return self._hit(m, "<output>", out)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            first = self._hit(m, "<output>", out[0])
            return None if first is None else (first, *out[1:])
        return None


def inject(
    guard: Any, *, kind: str, steps: int = 1, mpu: str | None = None, gpu: int | None = None, **kwargs: Any
) -> Injector:
    """Corrupt the MPUs of `guard` (an attached Guard) from its current step on."""
    return Injector(list(guard.mpus), lambda: guard.current_step, kind, steps=steps, mpu=mpu, gpu=gpu, **kwargs)


def inject_mpus(mpus: Iterable[Any], step: Callable[[], int], **kwargs: Any) -> Injector:
    return Injector(list(mpus), step, **kwargs)
