"""Replay of one MPU's forward on the same input, compared with what the step computed.

The MPU's forward is run again under no_grad and compared: max |difference| <= rtol * max
|output| (`ChecksumConfig.replay_rtol`, 1e-5), in any dtype: a recomputation on the same device
is bitwise equal with deterministic kernels, so replay sees what an output sum cannot (a
transient mantissa flip in bf16, a fault outside any linear layer: a norm, an activation,
attention, a residual add). Replay changes nothing the run sees:

- the RNG state of the original forward is restored for the replay (dropout draws the same
  masks) and the training RNG stream is put back afterwards;
- BatchNorm's running statistics are swapped for copies during the replay, so they are updated
  once per step;
- an argument that the forward fills in place, a `transformers` Cache (Idefics3 passes a
  `DynamicCache` into its text model), is given to the replay as it was before the step's
  forward: a deep copy taken then (`fresh_copies`), so the replay does not run against the cache
  the first forward filled.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from mscale.hook.core.outputs import ModelInputs

Rng = tuple[torch.Tensor, torch.Tensor | None]  # a device's RNG state (CPU, CUDA's or None), as rng_get takes it
# fresh copies of a forward's cache inputs (fresh_copies), by ("arg", index) or ("kw", name)
Copies = dict[tuple[str, int | str], object]
Saved = tuple[Rng, Copies]  # what a replay needs of the step's forward, taken before it ran


def rng_get(device: torch.device) -> Rng:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def rng_set(device: torch.device, state: Rng) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _is_cache(v: object) -> bool:
    # transformers.Cache and its subclasses (DynamicCache, ...) without importing transformers
    return any(c.__name__ == "Cache" and "transformers" in c.__module__ for c in type(v).__mro__)


def fresh_copies(args: tuple[object, ...], kwargs: dict[str, object]) -> Copies:
    """Deep copies of the cache arguments of a forward, keyed by ("arg", i) or ("kw", name),
    taken before the forward fills them."""
    out: Copies = {}
    for i, v in enumerate(args):
        if _is_cache(v):
            out[("arg", i)] = copy.deepcopy(v)
    for k, v in kwargs.items():
        if _is_cache(v):
            out[("kw", k)] = copy.deepcopy(v)
    return out


def _with_copies(
    args: tuple[object, ...], kwargs: dict[str, object], copies: Copies
) -> tuple[tuple[object, ...], dict[str, object]]:
    if not copies:
        return args, kwargs
    a = list(args)
    kw = dict(kwargs)
    for (_, key), v in copies.items():
        fresh = copy.deepcopy(v)  # the replay fills it; the stored copy stays as it was
        if isinstance(key, int):  # ("arg", index)
            a[key] = fresh
        else:  # ("kw", name)
            kw[key] = fresh
    return tuple(a), kw


def stand_in_stats(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
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


def run_again(module: nn.Module, device: torch.device, rng: Rng, inputs: ModelInputs, copies: Copies) -> object:
    """The module's forward again on `inputs` with the RNG state `rng`, under no_grad."""
    saved = rng_get(device)
    rng_set(device, rng)
    stats = stand_in_stats(module)  # the step's forward updated them once; not the replay
    args, kwargs = _with_copies(inputs.args, inputs.kwargs, copies)
    try:
        with torch.no_grad():
            return module(*args, **kwargs)
    finally:
        rng_set(device, saved)
        for layer, name, original in stats:
            layer._buffers[name] = original


def compare(outs: list[torch.Tensor], again: list[torch.Tensor], rtol: float) -> str:
    """'' when the replay's outputs match the step's within rtol x max |output|; else why not."""
    if len(again) != len(outs):
        return f"replay returned {len(again)} tensors, the step {len(outs)}"
    for i, (a, b) in enumerate(zip(outs, again, strict=True)):
        if a.shape != b.shape:
            return f"replay output {i}: shape {tuple(b.shape)} != {tuple(a.shape)}"
        a64, b64 = a.detach().to(torch.float64), b.to(torch.float64)
        diff = (a64 - b64).abs().max().item() if a.numel() else 0.0
        ref = a64.abs().max().item() if a.numel() else 0.0
        tol = rtol * max(ref, 1e-30)
        if not (math.isfinite(diff) and diff <= tol):
            return f"replay output {i}: max difference {diff:.3g} > tolerance {tol:.3g}"
    return ""


def runs_collectives(module: torch.nn.Module) -> bool:
    """Whether the module's forward runs collectives of its own: an FSDP2 `fully_shard` (or an
    FSDP1 wrapper) on it or inside it all-gathers its parameters in forward, so a replay on one
    rank alone would wait on, or cross, the other ranks' collectives."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in module.modules())
