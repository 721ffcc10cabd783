"""MPUs (modality processing units): the named sub-modules the guard watches.

Given explicitly as a mapping of names to sub-modules, or found by module name for the
common multimodal layouts wherever they sit in the tree (Hugging Face nests them under
`model.`). Each MPU has an id ("001", "002", ...), a torch device and the index of the GPU
it is bound to: on a GPU node the device's index, on a CPU machine a simulated index of the
agent's simulated node, so a fault injected on simulated GPU k hits exactly its MPUs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from mscale.healing.fsm import Level
from mscale.hook.core.families import KNOWN_CHILDREN, KNOWN_NAMES
from mscale.link import MpuInfo

# reporting and id order: encoders, then the resampler and the aligner, then the text model
_ORDER = ("vision", "audio", "resampler", "aligner", "text")
UNCOVERED_SHARE = 0.10  # trainable parameters outside every MPU above which discovery warns
WALK_EVERY = 64  # steps between walks of an MPU's module tree (Mpu._tree)


class MpuLayoutError(ValueError):
    """The model's MPUs could not be found (or the given mapping is wrong)."""


@dataclass(eq=False)
class Mpu:
    """One MPU and what the guard and its plugins know about it.

    Plugins may read every field; they change the binding only through `Guard.rebind`,
    and `fuse_level` is theirs to set (the fuse plugin), reported to the agent as is.
    """

    mpu_id: str
    name: str
    module: nn.Module
    path: str  # dotted path in the model, "" for the root
    gpu: int  # bound GPU index (simulated on CPU machines)
    gpu_uuid: str = ""
    fuse_level: str = Level.HEALTHY.value  # a fuse state (mscale.healing.fsm.Level)
    # checksum state (maintained by the checksum detector)
    consecutive_failures: int = 0
    checksum_failures_total: int = 0
    checksum_checks_total: int = 0
    last_checksum_ok: bool = True
    # per-step measurements (reset at each step's begin)
    forward_s: float = 0.0
    backward_s: float = 0.0
    grad_norm: float = 0.0
    gvc: float = 0.0
    distill_share: float = 0.0  # the L3 term's share of the loss at the last step (the fuse's L3)
    _fwd_start: float | None = field(default=None, repr=False)  # the guard's, at each forward
    _bwd_start: float = field(default=0.0, repr=False)
    _bwd_end: float = field(default=0.0, repr=False)
    # the module tree walked once: nn.Module.parameters() nests a generator per level, about
    # 0.2 ms for a tower of 50 modules, and the guard asks several times a step (see _tree)
    _walked: tuple[nn.Module, ...] | None = field(default=None, repr=False)
    _first: torch.Tensor | None = field(default=None, repr=False)  # its first parameter or buffer
    _steps_walked: int = field(default=0, repr=False)

    def _tree(self) -> tuple[nn.Module, ...]:
        """The MPU's modules, walked anew every WALK_EVERY steps and after a rebind (`forget`):
        parameters are read live from them, so a moved, replaced or re-frozen parameter is seen
        at once; only a sub-module added to the tree waits for the next walk."""
        if self._walked is None:
            self._walked = tuple(self.module.modules())
            self._first = next(
                (t for m in self._walked for t in (*m._parameters.values(), *m._buffers.values()) if t is not None),
                None,
            )
        return self._walked

    def forget(self) -> None:
        """Walk the module tree again at the next use (the MPU was rebound or restructured)."""
        self._walked = self._first = None

    @property
    def device(self) -> torch.device:
        self._tree()
        return self._first.device if self._first is not None else torch.device("cpu")

    def parameters(self) -> list[nn.Parameter]:
        """The trained parameters (requiring a gradient), each once, in module order."""
        seen: set[int] = set()
        out: list[nn.Parameter] = []
        for m in self._tree():
            for p in m._parameters.values():
                if p is not None and p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def describe(self) -> MpuInfo:
        """The registration record sent to the agent."""
        return MpuInfo(
            mpu_id=self.mpu_id,
            name=self.name,
            path=self.path,
            device=str(self.device),
            gpu=self.gpu,
            gpu_uuid=self.gpu_uuid,
            fuse_level=self.fuse_level,
            params=sum(p.numel() for p in self.module.parameters()),
        )

    def memory(self) -> dict[str, int]:
        """Device memory in use and in all (bytes), for the step report; empty off CUDA."""
        dev = self.device
        if dev.type != "cuda":
            return {}
        try:
            free, total = torch.cuda.mem_get_info(dev)
            return {"memory_used_bytes": total - free, "memory_total_bytes": total}
        except RuntimeError:
            return {}

    def _reset_step(self) -> None:
        self.forward_s = self.backward_s = 0.0
        self._bwd_start = self._bwd_end = 0.0
        self._steps_walked += 1
        if self._steps_walked >= WALK_EVERY:
            self._steps_walked = 0
            self.forget()

    def _mark_backward_start(self) -> None:
        if not self._bwd_start:
            self._bwd_start = time.perf_counter()

    def _mark_backward_end(self) -> None:
        self._bwd_end = time.perf_counter()


def _find(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    found: dict[str, tuple[str, nn.Module]] = {}
    # named_modules is breadth-unaware; prefer the shallowest match per MPU name
    modules = dict(model.named_modules())
    candidates = sorted(((path.count("."), path, m) for path, m in modules.items() if path), key=lambda t: t[0])
    for _, path, module in candidates:
        parent, _, attr = path.rpartition(".")
        name = KNOWN_CHILDREN.get(type(modules[parent]).__name__, {}).get(attr) or KNOWN_NAMES.get(attr)
        if name is None or name in found:
            continue
        # a match nested inside an MPU already found is part of it, not another MPU
        if any(path.startswith(p + ".") for p, _ in found.values()):
            continue
        found[name] = (path, module)
    return found


def _path_of(model: nn.Module, module: nn.Module) -> str:
    for path, m in model.named_modules():
        if m is module:
            return path
    raise MpuLayoutError(f"MPU module {type(module).__name__} is not a sub-module of the model")


def _default_gpu(module: nn.Module, position: int) -> int:
    for p in module.parameters():
        if p.device.type == "cuda":
            return p.device.index or 0
        break
    return position  # CPU: simulated GPU index, one per MPU in order


def _uuid(gpu: int, module: nn.Module) -> str:
    for p in module.parameters():
        if p.device.type == "cuda":
            try:
                return "GPU-" + str(torch.cuda.get_device_properties(p.device).uuid)
            except (RuntimeError, AttributeError):
                return ""
        break
    return ""


def uuid_of(gpu: int, given: str | None = None, known: Mapping[int, str] | None = None, *, cuda: bool = True) -> str:
    """The uuid of GPU `gpu` after a rebind: `given` when the caller knows it; else CUDA's for
    that index when the MPU is on CUDA (`cuda`; a simulated binding names no real GPU); else one seen for that index in this process (`known`:
    indices do not change under a running process). Otherwise (a simulated CPU binding to a GPU
    never seen) "": the old GPU's uuid would name the wrong GPU."""
    if given:
        return given
    if cuda and torch.cuda.is_available() and 0 <= gpu < torch.cuda.device_count():
        try:
            return "GPU-" + str(torch.cuda.get_device_properties(gpu).uuid)
        except (RuntimeError, AttributeError):
            pass
    return (known or {}).get(gpu, "")


def discover(
    model: nn.Module, mpus: Mapping[str, nn.Module | str] | None = None, gpus: Mapping[str, int] | None = None
) -> list[Mpu]:
    """The model's MPUs: `mpus` maps names to sub-modules (or dotted paths); None finds
    them by module name. `gpus` maps MPU names to GPU indices (default: the parameters'
    CUDA device, else simulated index = position). A `torch.compile` wrapper is the guard's to unwrap
    (mscale.hook.integrations.compiled.unwrap)."""
    if mpus is None:
        found = _find(model)
        if not found:
            children = ", ".join(n for n, _ in model.named_children()) or "none"
            raise MpuLayoutError(
                f"no MPUs found in {type(model).__name__}: none of the module names "
                f"{', '.join(sorted(KNOWN_NAMES))} occur (top-level children: {children}); "
                "pass mpus={'vision': model.encoder, 'text': model.decoder, ...} to name them"
            )
        order = sorted(found, key=lambda n: _ORDER.index(n))
        named = [(n, found[n][0], found[n][1]) for n in order]
    else:
        if not mpus:
            raise MpuLayoutError("mpus is empty: give at least one name -> sub-module")
        named = []
        for name, m in mpus.items():
            if isinstance(m, str):
                try:
                    module = model.get_submodule(m)
                except AttributeError:
                    raise MpuLayoutError(f"MPU {name!r}: no sub-module at path {m!r}") from None
                named.append((name, m, module))
            elif isinstance(m, nn.Module):
                named.append((name, _path_of(model, m), m))
            else:
                raise MpuLayoutError(f"MPU {name!r}: expected an nn.Module or a dotted path, got {type(m).__name__}")
        seen: dict[int, str] = {}
        for name, _, module in named:
            if id(module) in seen:
                raise MpuLayoutError(f"MPUs {seen[id(module)]!r} and {name!r} are the same module")
            seen[id(module)] = name
    if mpus is None:
        uncovered(model, [m for _, _, m in named])
    gpus = dict(gpus or {})
    unknown = set(gpus) - {n for n, _, _ in named}
    if unknown:
        raise MpuLayoutError(f"gpus names unknown MPUs: {', '.join(sorted(unknown))}")
    out = []
    for i, (name, path, module) in enumerate(named):
        gpu = gpus.get(name, _default_gpu(module, i))
        if not isinstance(gpu, int) or gpu < 0:
            raise MpuLayoutError(f"gpus[{name!r}]: expected a GPU index >= 0, got {gpu!r}")
        out.append(
            Mpu(mpu_id=f"{i + 1:03d}", name=name, module=module, path=path, gpu=gpu, gpu_uuid=_uuid(gpu, module))
        )
    return out


def uncovered(model: nn.Module, modules: list[nn.Module], share: float = UNCOVERED_SHARE) -> list[str]:
    """The largest modules whose trainable parameters lie outside every MPU, when those are more
    than `share` of all trainable ones (else []): logged as a warning saying how to map them."""
    inside = {id(p) for m in modules for p in m.parameters()}
    # the LM head is the text model's output layer, outside its module in Hugging Face (GIT's `output`)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    skip = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    skip |= {id(p) for n, p in model.named_parameters() if n.startswith("lm_head.")}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in skip]
    total = sum(p.numel() for _, p in params)
    outside = [(n, p) for n, p in params if id(p) not in inside]
    left = sum(p.numel() for _, p in outside)
    if not total or left <= share * total:
        return []
    covered = {n.rsplit(".", 1)[0] for n, p in params if id(p) in inside}
    names: set[str] = set()
    for n, _ in outside:  # the shallowest prefix holding no MPU parameter
        parts = n.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if not any(c == prefix or c.startswith(prefix + ".") for c in covered):
                names.add(prefix)
                break
    top = sorted(names)
    import structlog  # (at call time: the guard's logger configuration applies)

    structlog.get_logger("mscale.hook").warning(
        "mpus_uncovered",
        share=round(left / total, 3),
        modules=top[:10],
        how=f"name them in mpus= with the MPUs found (a name -> a module or dotted path, e.g. '{top[0]}')",
    )
    return top


def by_key(mpus: Iterable[Mpu], key: str) -> Mpu:
    """An MPU by id or name."""
    for m in mpus:
        if key in (m.mpu_id, m.name):
            return m
    raise KeyError(f"no MPU {key!r} (known: {', '.join(f'{m.mpu_id}={m.name}' for m in mpus)})")
