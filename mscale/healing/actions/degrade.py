"""L2 modality degradation: the standby fails too, or none is healthy.

The MPU keeps training degraded: image inputs of a vision MPU at half resolution (a forward
pre-hook pools them, so the tower sees a quarter of the patches), its CMSA clip threshold
raised by the fuse's `l2_clip_factor` to absorb the noisier gradients, and its forward on a
fallback where one applies (`run_degraded`):

- on an accelerator (cuda) the MPU always moves to the CPU (parameters, gradients, the
  optimizer state of its parameters); its forward takes its inputs to the CPU and gives its
  outputs back on the original device, so the rest of the model is unchanged ("cpu").
  Written without a GPU to run it on: untested here. A fused optimizer (fused=True) cannot
  step parameters on two device types; the default foreach one can.
- already on the CPU, only with `healing.l2_precision_fallback` (off by default): its forward
  runs under torch.autocast("cpu", bfloat16), floating outputs cast back to the input dtype
  ("bf16"). The ABFT checks pick their tolerance from each Linear's output dtype, so bf16
  GEMMs are checked at bf16 tolerance (1e-2 against 2e-6 in fp32): corruption below that goes
  unseen while degraded, and L3 may never engage. Hence opt-in.

The forward is wrapped by an instance attribute (what nn.Module.__call__ calls), inside the
guard's hooks: they see the MPU's inputs and outputs as the model does. Undone on recovery.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mscale.healing.actions.base import ActionSpec
from mscale.healing.fsm import Level


@dataclass
class Fallback:
    kind: str  # "cpu" or "bf16": an event label
    undo: Callable[[], None]


def run_degraded(module: Any, optimizer: Any = None, *, precision: bool = False) -> Fallback | None:
    """Put `module` on its fallback: the CPU when it runs on cuda; else bf16 autocast when
    `precision` is set; else none (None: the MPU runs as it did)."""
    import torch

    home = _device_of(module)
    if home.type == "cuda":
        return cpu_fallback(module, optimizer)
    if precision:
        return bf16_fallback(module, dtype=torch.bfloat16)
    return None


def bf16_fallback(module: Any, dtype: Any = None) -> Fallback:
    import torch

    dtype = dtype or torch.bfloat16
    default = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)

    def forward(inner: Callable, args: tuple, kwargs: dict) -> Any:
        back = next((t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()), default)
        with torch.autocast("cpu", dtype=dtype):
            out = inner(*args, **kwargs)
        return _map(out, lambda t: t.to(back) if t.is_floating_point() and t.dtype != back else t)

    return Fallback("bf16", _wrap(module, forward))


def cpu_fallback(module: Any, optimizer: Any = None) -> Fallback:
    import torch

    home, cpu = _device_of(module), torch.device("cpu")
    _move(module, optimizer, cpu)

    def forward(inner: Callable, args: tuple, kwargs: dict) -> Any:
        args, kwargs = _map((args, kwargs), lambda t: t.to(cpu))
        return _map(inner(*args, **kwargs), lambda t: t.to(home))

    unwrap = _wrap(module, forward)

    def undo() -> None:
        unwrap()
        _move(module, optimizer, home)

    return Fallback("cpu", undo)


def _wrap(module: Any, forward: Callable[[Callable, tuple, dict], Any]) -> Callable[[], None]:
    """Route module(...) through `forward(inner, args, kwargs)`; returns the undo."""
    own = module.__dict__.get("forward")  # an earlier instance override, kept under ours
    inner = module.forward

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return forward(inner, args, kwargs)

    module.forward = wrapped

    def undo() -> None:
        if module.__dict__.get("forward") is not wrapped:
            return  # someone wrapped it again since: leave theirs
        if own is None:
            del module.forward
        else:
            module.forward = own

    return undo


def _device_of(module: Any) -> Any:
    import torch

    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _move(module: Any, optimizer: Any, device: Any) -> None:
    """Parameters and their gradients (Module.to moves both, same Parameter objects, so the
    optimizer's references hold) and the optimizer state of those parameters (scalar step
    counters stay where the optimizer keeps them)."""
    import torch

    module.to(device)
    if optimizer is None:
        return
    for p in module.parameters():
        st = optimizer.state.get(p, {})
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != device:
                st[k] = v.to(device)


def _tensors(obj: Any) -> list:
    out: list = []
    _map(obj, lambda t: out.append(t) or t)
    return out


def _map(obj: Any, fn: Callable) -> Any:
    """Apply `fn` to every tensor in nested tuples, lists and dicts (a plain dict is copied,
    a dict subclass such as transformers' ModelOutput is changed in place to keep its type)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is dict:
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = _map(obj[k], fn)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def apply(fuse, d) -> str:
    m = fuse.guard.mpu(d.target.mpu_id)
    fuse.degrade(m)
    return "applied"


ACTION = ActionSpec("l2_degrade", "L2", Level.L2_DEGRADED, apply,
                    "run the MPU degraded (CPU or bf16 fallback, reduced resolution, raised clip)")
