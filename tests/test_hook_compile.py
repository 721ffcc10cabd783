"""A compiled model gets a clear error at attach, naming what to do, and nothing is hooked."""

from __future__ import annotations

import pytest
import torch

import mscale
from mscale.sim.tinymm import TinyConfig, TinyMultimodal


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_compiled_model_is_refused_with_what_to_do() -> None:
    model = TinyMultimodal(TinyConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model)  # lazily: nothing is compiled before its first call
    with pytest.raises(TypeError, match=r"compiled with torch\.compile.*without torch\.compile.*enabled=False"):
        mscale.attach(compiled, opt, job_id="c", connect=False)
    assert _hooks(model) == 0 and not opt._optimizer_step_pre_hooks


def test_a_compiled_mpu_is_refused_too_and_enabled_false_leaves_it_alone() -> None:
    model = TinyMultimodal(TinyConfig())
    model.vision_tower.compile()  # in place (nn.Module.compile)
    with pytest.raises(TypeError, match="'vision_tower' is compiled"):
        mscale.attach(model, job_id="c", connect=False)
    assert _hooks(model) == 0
    guard = mscale.attach(model, job_id="c", enabled=False)  # the documented way out
    assert _hooks(model) == 0
    guard.detach()
