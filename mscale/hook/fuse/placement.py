"""Moving an MPU between devices, one code path for the L1 swap (`Guard.rebind`) and the L2
CPU fallback, and the device-boundary adapter that keeps the rest of the model unchanged.

`move(module, optimizer, device)` moves the parameters, their gradients (`Module.to` moves
both and keeps the same Parameter objects, so the optimizer's references hold), the buffers
(BatchNorm running statistics) and the optimizer state of those parameters: every tensor of
dimension >= 1 (exp_avg, exp_avg_sq, momentum_buffer...). Scalar step counters stay where the
optimizer keeps them: with its parameter when the parameter group is `fused` or `capturable`
(those optimizers keep `step` on the parameter's device), on the CPU otherwise (the default
foreach and for-loop optimizers keep `step` there, whatever the parameter's device).

`place(module, optimizer, device)` is `move` plus the boundary adapter: a module moved off the
device where it first ran (its "home", where the modules around it stay) gets its forward
wrapped so that each call's tensor inputs (nested in tuples, lists, dicts, ModelOutput) go to
the module's current device and its outputs come back to the device the inputs came from (the
home device when the call has no tensor input or any of them is on it, else the first one's). Back at home, the adapter is removed. The
wrapper is an instance attribute (what nn.Module.__call__ calls), so forward hooks on the
module, the guard's among them, see its inputs and outputs as the model does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch
from torch import nn

_ADAPTER = "_mscale_boundary"  # the module attribute holding its adapter

T = TypeVar("T")

# a module's own forward, as `wrap_forward` hands it on: called with the arguments it is given
Inner = Callable[..., object]
# `forward(inner, args, kwargs)`: what `wrap_forward` routes a module's calls through
Forward = Callable[[Inner, tuple[object, ...], dict[str, object]], object]


def map_tensors(obj: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """Apply `fn` to every tensor in nested tuples, lists and dicts (a plain dict is copied,
    a dict subclass such as transformers' ModelOutput is changed in place to keep its type).
    The result has the structure, so the type, of `obj`."""
    return cast(T, _mapped(obj, fn))


def _mapped(obj: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is dict:
        return {k: _mapped(v, fn) for k, v in obj.items()}
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = _mapped(obj[k], fn)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple: built from its fields
        make: Callable[..., object] = type(obj)
        return make(*(_mapped(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_mapped(v, fn) for v in obj)
    return obj


def tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor in `obj`, in `map_tensors` order."""
    out: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        out.append(t)
        return t

    map_tensors(obj, keep)
    return out


def device_of(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def move(module: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device | str) -> None:
    """Move `module` (parameters, gradients, buffers) and its parameters' optimizer state to
    `device`; see the module docstring for the scalar step counters."""
    device = torch.device(device)
    before = list(module.parameters())
    module.to(device)
    if optimizer is None:
        return
    _follow(optimizer, before, list(module.parameters()))
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for p in module.parameters():
        st = optimizer.state.get(p)
        if not st:
            continue
        g = group_of.get(id(p), {})
        with_param = bool(g.get("fused") or g.get("capturable"))
        for k, v in st.items():
            if not isinstance(v, torch.Tensor) or v.device == device:
                continue
            if v.dim() > 0 or with_param:
                st[k] = v.to(device)


def _follow(optimizer: torch.optim.Optimizer, before: list[nn.Parameter], after: list[nn.Parameter]) -> None:
    """Point the optimizer at the module's parameters where `Module.to` made new ones (a move
    between tensor types that cannot share a Parameter, e.g. to meta, or
    torch.__future__.set_overwrite_module_params_on_conversion(True)): its param groups and
    its state, re-keyed. Hooks registered on the old Parameter objects stay on them."""
    new = {id(a): b for a, b in zip(before, after, strict=True) if a is not b}
    if not new:
        return
    for g in optimizer.param_groups:
        g["params"] = [new.get(id(p), p) for p in g["params"]]
    for a in before:
        if id(a) in new and a in optimizer.state:
            optimizer.state[new[id(a)]] = optimizer.state.pop(a)


def wrap_forward(module: nn.Module, forward: Forward) -> Callable[[], None]:
    """Route module(...) through `forward(inner, args, kwargs)`; returns the undo."""
    own = module.__dict__.get("forward")  # an earlier instance override, kept under ours
    inner = module.forward

    def wrapped(*args: object, **kwargs: object) -> object:
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


class Boundary:
    """A module's device-boundary adapter: inputs to its device, outputs back where they came from."""

    def __init__(self, module: nn.Module, home: torch.device) -> None:
        self.module, self.home = module, home
        self.calls = 0
        self._undo = wrap_forward(module, self._forward)

    def _forward(self, inner: Inner, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        self.calls += 1
        here = device_of(self.module)
        seen = [t.device for t in tensors((args, kwargs))]
        # mixed inputs (a CPU mask beside hidden states): the home device when any came from it
        origin = self.home if not seen or self.home in seen else seen[0]
        if origin != here:
            args, kwargs = map_tensors((args, kwargs), lambda t: t.to(here) if t.device != here else t)
        out = inner(*args, **kwargs)
        if origin == here:
            return out
        return map_tensors(out, lambda t: t.to(origin) if t.device != origin else t)

    def remove(self) -> None:
        self._undo()
        if self.module.__dict__.get(_ADAPTER) is self:
            del self.module.__dict__[_ADAPTER]


def boundary(module: nn.Module) -> Boundary | None:
    """The module's adapter, or None (it runs where it first ran)."""
    b = module.__dict__.get(_ADAPTER)
    return b if isinstance(b, Boundary) else None


def adapt(module: nn.Module, home: torch.device | str) -> Boundary:
    """The module's adapter, installed with `home` (where its callers run) if it has none."""
    b = boundary(module)
    if b is None:
        b = module.__dict__[_ADAPTER] = Boundary(module, torch.device(home))
    return b


def place(module: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device | str) -> None:
    """Move `module` with its optimizer state to `device` and keep its callers unchanged: an
    adapter while it is away from its home device, none once it is back."""
    device = torch.device(device)
    b = boundary(module)
    home = b.home if b is not None else device_of(module)
    move(module, optimizer, device)
    if device == home:
        if b is not None:
            b.remove()
    else:
        adapt(module, home)
