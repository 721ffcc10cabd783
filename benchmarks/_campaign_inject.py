"""The campaign's own injector: each fault of a campaign (benchmarks/_campaign_schema.py) put
into a training run by this module's hooks alone (forward hooks and pre-hooks put in front of
every other hook, tensor hooks on gradients, an optimizer step pre-hook, direct writes to a
weight), never through the guard's code paths.

    inj = Injector(fault, model, opt)     # hooks installed, nothing active yet
    for batch in loader:
        inj.begin(step)                   # before the forward: arms the fault, writes weights
        batch = inj.batch(batch)          # the input-batch surface
        ...
    inj.remove()

Timing: a fault is active at the training iterations its trigger and lifetime give. "once"
(the default retrigger): a step re-run after a rollback finds it gone, as a transient upset
would; "every_attempt" (the fault follows the module): it fires whenever the step runs. A
GEMM fault that is not persistent corrupts the linear's first call in a step only (a
recomputation of it is right); a persistent one corrupts every call. A persistent fault in
a weight or optimizer state is stuck at its first corrupted value (rewritten every step).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from benchmarks._campaign_schema import FLIP_BIT, NOISE, SCALE, Fault

_INT = {torch.float32: (torch.int32, 32), torch.float16: (torch.int16, 16), torch.bfloat16: (torch.int16, 16)}


def indices(t: torch.Tensor, scope: str, seed: int) -> torch.Tensor:
    """The elements a fault touches: one, one row (of the last dimension), 1%, 10% or all, drawn
    from `seed` (the kit takes the middle element and the first row; in a language model's
    logits both are often a position no label reads, so every fault there would be harmless)."""
    n = t.numel()
    g = torch.Generator().manual_seed(seed)
    if scope == "single":
        return torch.randint(0, n, (1,), generator=g)
    if scope == "row":
        width = min(t.shape[-1] if t.ndim else 1, n)
        row = int(torch.randint(0, max(1, n // width), (1,), generator=g))
        return torch.arange(row * width, (row + 1) * width)
    if scope == "100%":
        return torch.arange(n)
    k = max(1, n // (100 if scope == "1%" else 10))
    return torch.randperm(n, generator=g)[:k]


def corrupted(values: torch.Tensor, f: Fault, seed: int) -> torch.Tensor:
    """`values` (a flat float tensor) as the fault's operation leaves them (a new tensor)."""
    v = values.detach().clone()
    if f.op == "set_value":
        return v.fill_(float(f.value if f.value is not None else float("nan")))
    if f.op == "sign_flip":
        return -v
    if f.op == "scale":
        return v * float(f.factor if f.factor is not None else SCALE[f.magnitude])
    if f.op == "noise":
        std = float(f.std if f.std is not None else NOISE[f.magnitude])
        return v + std * torch.randn(v.shape, generator=torch.Generator().manual_seed(seed), dtype=v.dtype)
    int_dtype, width = _INT[v.dtype]
    start = min(FLIP_BIT[f.magnitude], width - 1 - f.bits)
    mask = sum(1 << b for b in range(start, start + f.bits))
    if width == 32 and mask >= 1 << 31:
        mask -= 1 << 32
    return torch.bitwise_xor(v.contiguous().view(int_dtype), mask).view(v.dtype)


def corrupt_tensor(t: torch.Tensor, f: Fault, seed: int) -> torch.Tensor:
    """An activation, a gradient or a loss with the fault in it, out of place; gradients flow
    through it as through the right value (a wrong result, not a different function)."""
    flat = t.detach().reshape(-1)
    idx = indices(t, f.scope, seed)
    bad = flat.clone()
    bad[idx] = corrupted(flat[idx], f, seed)
    return t + (bad.view_as(t) - t.detach())


class Injector:
    """One fault's hooks on one model (and its optimizer), armed step by step."""

    def __init__(self, f: Fault, model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> None:
        self.f, self.model, self.opt = f, model, opt
        self.seed = seed + zlib.crc32(f.fault_id.encode()) % 65_536  # each fault its own elements
        self.live = False
        self.fired: set[int] = set()  # steps it has fired in ("once": not again after a rollback)
        self.armed: list[int] = []  # each step it was armed in, re-runs included
        self.calls = 0  # forwards of the target corrupted in this step
        self.stuck: dict[str, torch.Tensor] = {}
        self.handles: list[Any] = []
        self._install()

    def _module(self) -> torch.nn.Module:
        try:
            return self.model.get_submodule(self.f.module_path)
        except AttributeError as e:
            raise ValueError(f"fault {self.f.fault_id}: no module {self.f.module_path!r} in the model") from e

    def _param(self) -> torch.nn.Parameter:
        name = self.f.parameter or "weight"
        p = getattr(self._module(), name, None)
        if not isinstance(p, torch.nn.Parameter):
            raise ValueError(f"fault {self.f.fault_id}: {self.f.module_path!r} has no parameter {name!r}")
        return p

    def _install(self) -> None:
        s = self.f.surface
        if s in ("compute", "output"):
            self.handles.append(self._module().register_forward_hook(self._on_output, prepend=True))
        elif s == "input":
            self.handles.append(self._module().register_forward_pre_hook(self._on_input, prepend=True))
        elif s == "loss":
            self.handles.append(self.model.register_forward_hook(self._on_loss, prepend=True))
        elif s == "gradient":
            self.handles.append(self._param().register_hook(self._on_grad))
        elif s == "optimizer_state":
            self._param()  # named now: a wrong target fails before the run
            self.handles.append(self.opt.register_step_pre_hook(self._on_opt_step))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.live = False

    def begin(self, step: int) -> None:
        """Before step `step`'s forward: whether the fault is active in it; a weight written now."""
        f = self.f
        self.live = f.active(step) and (f.follows or f.iterations is None or step not in self.fired)
        self.calls = 0
        if not self.live:
            return
        self.fired.add(step)
        self.armed.append(step)
        if f.surface == "weight":
            with torch.no_grad():
                self._write(self._param().data, "weight", step)

    def _write(self, t: torch.Tensor, key: str, step: int) -> None:
        """A weight or a state tensor corrupted in place (a persistent fault: stuck at its first value)."""
        flat = t.view(-1)
        idx = indices(t, self.f.scope, self.seed)
        if key in self.stuck:
            flat[idx] = self.stuck[key]
            return
        flat[idx] = corrupted(flat[idx], self.f, self.seed + step)
        if self.f.iterations is None:
            self.stuck[key] = flat[idx].clone()

    def batch(self, batch: dict) -> dict:
        if not (self.live and self.f.surface == "data"):
            return batch
        return {**batch, self.f.batch_key: corrupt_tensor(batch[self.f.batch_key], self.f, self.seed)}

    def _take(self) -> bool:
        if not self.live:
            return False
        if self.f.surface == "compute" and self.f.iterations is not None and self.calls:
            return False  # a transient GEMM fault: the recomputation is right
        self.calls += 1
        return True

    def _on_output(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        if not self._take():
            return None
        if isinstance(out, torch.Tensor):
            return corrupt_tensor(out, self.f, self.seed)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (corrupt_tensor(out[0], self.f, self.seed), *out[1:])
        if hasattr(out, "last_hidden_state"):  # a tower's output (a ModelOutput)
            out["last_hidden_state"] = corrupt_tensor(out["last_hidden_state"], self.f, self.seed)
            return out
        raise TypeError(f"fault {self.f.fault_id}: cannot corrupt a {type(out).__name__} output")

    def _on_input(self, module: torch.nn.Module, args: tuple) -> Any:
        if not args or not isinstance(args[0], torch.Tensor) or not self._take():
            return None
        return (corrupt_tensor(args[0], self.f, self.seed), *args[1:])

    def _on_loss(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        if getattr(out, "loss", None) is None or not self._take():
            return None
        loss = out["loss"]
        bad = corrupted(loss.detach().reshape(1), self.f, self.seed).reshape(())
        out["loss"] = loss * (bad / loss.detach())  # the loss and its gradients off by one ratio, as a wrong loss scale
        return out

    def _on_grad(self, g: torch.Tensor) -> torch.Tensor | None:
        if not self.live:
            return None
        return corrupt_tensor(g, self.f, self.seed)

    def _on_opt_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self.live:
            return
        state = self.opt.state.get(self._param(), {})
        key = self.f.state_key or "exp_avg"
        if key in state:
            with torch.no_grad():
                self._write(state[key], key, 0)
