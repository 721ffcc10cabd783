"""The tensors and the loss in what a module or a model returns (a tensor, a tuple, a dict, a
Hugging Face ModelOutput): what the checks look at and where the guard finds the step's loss;
and what a module was called with (ModelInputs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch


class ModelInputs(NamedTuple):
    """What a module was called with: the batch, as the model (or an MPU) saw it."""

    args: tuple[object, ...]
    kwargs: dict[str, object]


def output_tensors(output: object) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (tensor, tuple, dict, ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in output_tensors(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in output_tensors(v)]
    return []


def loss_of(output: object) -> torch.Tensor | None:
    """The scalar loss in a model's output (a 0-d tensor, or a mapping or ModelOutput with
    "loss"); None when there is none."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None
