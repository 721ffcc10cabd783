"""The linear layers the checksums know: module type, where the weight is, whether it is stored
transposed. A public registration, with built-in entries:

    mscale.hook.checks.linears.register(MyLinear, weight="w", bias="b", transposed=False)

- `torch.nn.Linear`: y = x W^T + b, W of shape (out, in).
- Hugging Face `transformers.pytorch_utils.Conv1D` (the GPT-2 family): y = x W + b, W of shape
  (in, out): transposed.
- Transformer Engine `transformer_engine.pytorch.Linear` and Megatron-Core's
  `ColumnParallelLinear` / `RowParallelLinear`, wherever those import (W of shape (out, in) per
  partition; Megatron's forward returns (output, bias), and with `skip_bias_add` the bias is
  left out of the output). Transformer Engine's `LayerNormLinear` is not registered: its GEMM
  reads the normalised input, which its forward hook does not see.

ABFT needs, per layer, the GEMM's input (the module's first argument), its output (the module's
output, or its first element) and the weight as the GEMM used it; a registered type must compute
y = x op(W) + b with exactly those.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LinearKind:
    """How to read one linear module type: `weight` and `bias` name its attributes (bias None:
    none), `transposed` says W is stored (in, out) rather than (out, in)."""

    type: type
    weight: str = "weight"
    bias: str | None = "bias"
    transposed: bool = False

    def weight_of(self, module: nn.Module) -> torch.Tensor:
        return getattr(module, self.weight)

    def bias_of(self, module: nn.Module) -> torch.Tensor | None:
        if self.bias is None or getattr(module, "skip_bias_add", False):
            return None  # Megatron's skip_bias_add: the bias is returned apart, not added
        b = getattr(module, self.bias, None)
        return b if isinstance(b, torch.Tensor) and b.numel() else None

    def output_of(self, out: object) -> torch.Tensor | None:
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return out[0]
        return None


_KINDS: dict[type, LinearKind] = {}


def register(module_type: type, *, weight: str = "weight", bias: str | None = "bias", transposed: bool = False) -> None:
    """Check modules of `module_type` (and its subclasses) as linear layers."""
    if not isinstance(module_type, type) or not issubclass(module_type, nn.Module):
        raise TypeError(f"register: expected an nn.Module subclass, got {module_type!r}")
    if not isinstance(weight, str) or not weight:
        raise ValueError("register: weight must name the module's weight attribute")
    _KINDS[module_type] = LinearKind(module_type, weight, bias, bool(transposed))


def kind_of(module: nn.Module) -> LinearKind | None:
    """The registration that applies to `module` (its own type's, else its nearest base's)."""
    _builtins()
    for t in type(module).__mro__:
        k = _KINDS.get(t)
        if k is not None:
            return k
    return None


_OPTIONAL = (  # (module, class, transposed): registered when they import
    ("transformers.pytorch_utils", "Conv1D", True),
    ("transformer_engine.pytorch", "Linear", False),
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear", False),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear", False),
)
_tried: set[tuple[str, str]] = set()


def _builtins() -> None:
    _KINDS.setdefault(nn.Linear, LinearKind(nn.Linear))
    for mod, name, transposed in _OPTIONAL:
        if (mod, name) in _tried or mod.split(".")[0] not in sys.modules:
            continue  # tried, or not imported by the job: no model of it exists (no import cost here)
        _tried.add((mod, name))
        try:
            cls = getattr(importlib.import_module(mod), name)
        except Exception:  # not installed (or broken): no entry, nothing else changes
            continue
        _KINDS.setdefault(cls, LinearKind(cls, transposed=transposed))
