"""Shape-preserving L2 reductions per model family: less work in a vision MPU, every tensor the
rest of the model receives as it expects.

- `vit`: a vision tower with a fixed input size that can interpolate its position embeddings
  (CLIP, SigLIP: `forward(..., interpolate_pos_encoding=...)`, `config.image_size` and
  `config.patch_size`; the project's tiny model's tower too, with `cfg`). The image runs at `scale` resolution (a multiple of the patch size),
  so the tower sees scale^2 of the patches; every (B, 1 + g'^2, D) token tensor of its output
  (the last hidden state and each layer's) is resampled back to the g x g patch grid the
  model expects, the CLS token kept.
- `merge`: a dynamic-resolution tower taking flattened patches and their grid (Qwen2-VL:
  `forward(hidden_states, grid_thw)` with `spatial_merge_size`). Each image is rebuilt from its
  patches, resized to `scale` of its grid (kept a multiple of the merge size) and cut into
  patches again; the merged tokens (`pooler_output`, one per m x m window, as many as the
  image's placeholder tokens) and the unmerged ones are resampled back to the original grids.
  An image whose grid cannot shrink and stay a multiple of the merge size keeps its size.

Neither ever shrinks an image below a `MIN_GRID` x `MIN_GRID` patch grid: a smaller grid keeps
too little of the image to learn from (on the tiny LLaVA, 100 steps of its 4x4 grid run at 2x2
left the model blind to its images long after the reduction was undone; at 8x8 -> 4x4 it
recovered: benchmarks/fuse_real_models.py), so a tower whose grid cannot shrink and stay at
or above it gets no reduction. Anything else: no reduction applies either (`reduction_for`
returns None, `why_none` says why; L2 says so). A reduction
wraps the module's forward (`mscale.hook.fuse.placement.wrap_forward`), inside the guard's hooks:
they see the model's own inputs and an output of the expected shapes, and a checksum replay of
the same inputs runs the same reduced path. If the reduced forward raises, the module's own
forward runs for that call (the error kept in `failures` for the fuse, which undoes the
reduction and escalates): an error of the degradation never reaches the training loop.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from mscale.hook.fuse.placement import Forward, Inner, map_tensors, wrap_forward

MIN_GRID = 4  # patches per side below which no image is shrunk


@dataclass
class Reduction:
    """One MPU's installed reduction."""

    kind: str  # "vit" or "merge": an event label
    detail: str  # what it does, for the event
    undo: Callable[[], None]
    failures: list[str] = field(default_factory=list)  # errors of the reduced forward, not yet handled
    calls: int = 0  # forwards that ran reduced


def _accepts(module: nn.Module, name: str) -> bool:
    # the class's forward too: the L2 fallback's wrapper, installed first, takes *args, **kwargs
    with contextlib.suppress(TypeError, ValueError):
        return any(name in inspect.signature(f).parameters for f in (module.forward, type(module).forward))
    return False


def _config(module: nn.Module) -> object:
    """The module's config (a Hugging Face `config`, the tiny model's `cfg`), read by name."""
    return getattr(module, "config", None) or getattr(module, "cfg", None)


def _vit_sizes(module: nn.Module) -> tuple[int, int] | None:
    """(image size, patch size) in pixels from the module's config, when it gives both."""
    cfg = _config(module)
    size, patch = getattr(cfg, "image_size", None), getattr(cfg, "patch_size", None)
    return (size, patch) if isinstance(size, int) and isinstance(patch, int) else None


def family(module: nn.Module) -> str | None:
    """The reduction that applies to `module`: "vit", "merge" or None."""
    if _accepts(module, "interpolate_pos_encoding") and _vit_sizes(module) is not None:
        return "vit"
    if _accepts(module, "grid_thw") and isinstance(getattr(module, "spatial_merge_size", None), int):
        return "merge"
    return None


def _small_grid(grid: int, scale: float, multiple: int = 1) -> int:
    """The reduced side of a `grid`-patch side at `scale`: a multiple of `multiple`, never
    below MIN_GRID (rounded up to that multiple); `grid` itself when it cannot shrink."""
    floor = -(-MIN_GRID // multiple) * multiple
    small = max(floor, int(grid * scale) // multiple * multiple)
    return small if small < grid else grid


def why_none(module: nn.Module, scale: float) -> str:
    """Why `reduction_for(module, scale)` installs nothing ("" when it does)."""
    if not 0 < scale < 1:
        return f"l2_resolution {scale:g} asks for no reduction"
    kind = family(module)
    if kind is None:
        return "no shape-preserving reduction applies to this model"
    sizes = _vit_sizes(module)
    if kind == "vit" and sizes is not None:
        grid = sizes[0] // sizes[1]
        if _small_grid(grid, scale) >= grid:
            return f"its {grid}x{grid} patch grid cannot shrink and keep {MIN_GRID}x{MIN_GRID}"
    return ""


def reduction_for(module: nn.Module, scale: float) -> Reduction | None:
    """Install the reduction for `module` at `scale` (0 < scale < 1); None when none applies."""
    if not 0 < scale < 1:
        return None
    kind = family(module)
    if kind == "vit":
        return _vit(module, scale)
    if kind == "merge":
        return _merge(module, scale)
    return None


def _guarded(
    module: nn.Module,
    kind: str,
    detail: str,
    reduced: Forward,
) -> Reduction:
    red = Reduction(kind, detail, undo=lambda: None)

    def forward(inner: Inner, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        try:
            out = reduced(inner, args, kwargs)
        except Exception as e:  # the module's own forward for this call; the fuse undoes the reduction
            red.failures.append(f"{type(e).__name__}: {e}")
            return inner(*args, **kwargs)
        red.calls += 1
        return out

    red.undo = wrap_forward(module, forward)
    return red


# --- fixed-size towers with interpolated position embeddings (CLIP, SigLIP) -----------------


def _resample_tokens(t: torch.Tensor, grid: tuple[int, int], cls: int) -> torch.Tensor:
    """(B, cls + h'*w', D) -> (B, cls + h*w, D): the patch grid resized, the leading tokens kept."""
    b, n, d = t.shape
    side = round((n - cls) ** 0.5)
    patches = t[:, cls:].transpose(1, 2).reshape(b, d, side, side)
    up = F.interpolate(patches.float(), size=grid, mode="bilinear", align_corners=False).to(t.dtype)
    return torch.cat([t[:, :cls], up.flatten(2).transpose(1, 2)], dim=1)


def _vit(module: nn.Module, scale: float) -> Reduction | None:
    sizes = _vit_sizes(module)
    if sizes is None:
        return None
    size, patch = sizes
    grid = size // patch
    small = _small_grid(grid, scale) * patch  # pixels, a multiple of the patch size
    if small >= size:
        return None
    full = grid * grid
    small_n = (small // patch) ** 2

    def reduced(inner: Inner, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        kwargs = dict(kwargs)
        key = "pixel_values" if "pixel_values" in kwargs else None
        x = kwargs[key] if key else (args[0] if args else None)
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or tuple(x.shape[-2:]) != (size, size):
            return inner(*args, **kwargs)  # not the image this tower expects: as is
        small_x = F.interpolate(x, size=(small, small), mode="bilinear", align_corners=False, antialias=True)
        if key:
            kwargs[key] = small_x
        else:
            args = (small_x, *args[1:])
        kwargs["interpolate_pos_encoding"] = True
        out = inner(*args, **kwargs)

        def back(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 3 and t.shape[1] - small_n in (0, 1) and t.shape[1] != full:
                return _resample_tokens(t, (grid, grid), t.shape[1] - small_n)
            return t

        return map_tensors(out, back)

    detail = f"images at {small}x{small} of {size}x{size} (position embeddings interpolated, features resampled to the {grid}x{grid} grid)"
    return _guarded(module, "vit", detail, reduced)


# --- dynamic-resolution towers over flattened patches (Qwen2-VL) -----------------------------


def _unpatch(x: torch.Tensor, thw: tuple[int, int, int], c: int, tp: int, p: int, m: int) -> torch.Tensor:
    """Flattened patches of one image/video, in merge-window order -> (t*tp, c, H, W)."""
    t, gh, gw = thw
    x = x.reshape(t, gh // m, gw // m, m, m, c, tp, p, p)
    x = x.permute(0, 6, 5, 1, 3, 7, 2, 4, 8)  # t, tp, c, gh/m, m, p, gw/m, m, p
    return x.reshape(t * tp, c, gh * p, gw * p)


def _patch(x: torch.Tensor, t: int, c: int, tp: int, p: int, m: int) -> torch.Tensor:
    """(t*tp, c, H, W) -> flattened patches in merge-window order (inverse of `_unpatch`)."""
    h, w = x.shape[-2] // p, x.shape[-1] // p
    x = x.reshape(t, tp, c, h // m, m, p, w // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, c * tp * p * p)


def _windows_to_grid(x: torch.Tensor, t: int, h: int, w: int, m: int) -> torch.Tensor:
    """(t*h*w, D) tokens in merge-window order -> (t, D, h, w)."""
    d = x.shape[-1]
    return x.reshape(t, h // m, w // m, m, m, d).permute(0, 5, 1, 3, 2, 4).reshape(t, d, h, w)


def _grid_to_windows(x: torch.Tensor, m: int) -> torch.Tensor:
    t, d, h, w = x.shape
    return x.reshape(t, d, h // m, m, w // m, m).permute(0, 2, 4, 3, 5, 1).reshape(t * h * w, d)


def _resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    return F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False).to(x.dtype)


def _merge(module: nn.Module, scale: float) -> Reduction | None:
    cfg = _config(module)
    m = int(module.spatial_merge_size)  # type: ignore[arg-type]
    p = int(getattr(cfg, "patch_size", 0) or 0)
    tp = int(getattr(cfg, "temporal_patch_size", 1) or 1)
    c = int(getattr(cfg, "in_channels", 3) or 3)
    if p <= 0:
        return None

    def reduced(inner: Inner, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        kwargs = dict(kwargs)
        x = kwargs.pop("hidden_states", args[0] if args else None)
        grid = kwargs.pop("grid_thw", args[1] if len(args) > 1 else None)
        rest = args[2:]
        if not isinstance(x, torch.Tensor) or not isinstance(grid, torch.Tensor) or x.dim() != 2:
            raise ValueError("expected (hidden_states, grid_thw) tensors")
        rows = [tuple(int(v) for v in r) for r in grid.tolist()]
        if x.shape[1] != c * tp * p * p or x.shape[0] != sum(t * h * w for t, h, w in rows):
            raise ValueError(f"patches {tuple(x.shape)} do not match grid_thw {rows} and the patch size")
        small_x, small_rows = _shrink_patches(x, rows, scale, (c, tp, p, m))
        small_grid = torch.tensor(small_rows, dtype=grid.dtype, device=grid.device)
        out = inner(small_x, small_grid, *rest, **kwargs)
        return map_tensors(out, lambda tensor: _regrid(tensor, rows, small_rows, m))

    detail = f"images at {scale:g}x of their patch grid (multiples of the {m}x{m} merge), features resampled to the original grid"
    return _guarded(module, "merge", detail, reduced)


def _shrink_patches(
    x: torch.Tensor, rows: list[tuple[int, ...]], scale: float, shape: tuple[int, int, int, int]
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Each image's patches (rows of grid_thw) rebuilt into the image, resized to `scale` of its
    grid (a multiple of the merge size `m`) and cut into patches again; an image whose grid
    cannot shrink keeps its patches. `shape`: (channels, temporal patch, patch size, m).
    The patches and their grids."""
    c, tp, p, m = shape
    parts, small_rows = [], []
    for chunk, (t, h, w) in zip(torch.split(x, [t * h * w for t, h, w in rows]), rows, strict=True):
        sh, sw = _small_grid(h, scale, m), _small_grid(w, scale, m)
        if (sh, sw) == (h, w):
            parts.append(chunk)
        else:
            img = _unpatch(chunk, (t, h, w), c, tp, p, m)
            parts.append(_patch(_resize(img, (sh * p, sw * p)), t, c, tp, p, m))
        small_rows.append((t, sh, sw))
    return torch.cat(parts), small_rows


def _regrid(
    tensor: torch.Tensor, rows: list[tuple[int, ...]], small_rows: list[tuple[int, int, int]], m: int
) -> torch.Tensor:
    """An output of the small grids resampled back to the original ones: the merged tokens
    (one per m x m window) and the unmerged ones; any other tensor as it is."""
    if tensor.dim() != 2:
        return tensor
    merged_small = [t * h * w // (m * m) for t, h, w in small_rows]
    unmerged_small = [t * h * w for t, h, w in small_rows]
    n = tensor.shape[0]
    if n == sum(merged_small) and n != sum(t * h * w // (m * m) for t, h, w in rows):
        pieces = torch.split(tensor, merged_small)
        return torch.cat(
            [
                _resize(pc.reshape(t, h // m, w // m, -1).permute(0, 3, 1, 2), (gh // m, gw // m))
                .permute(0, 2, 3, 1)
                .reshape(-1, pc.shape[-1])
                for pc, (t, h, w), (_, gh, gw) in zip(pieces, small_rows, rows, strict=True)
            ]
        )
    if n == sum(unmerged_small) and n != sum(t * h * w for t, h, w in rows):
        pieces = torch.split(tensor, unmerged_small)
        return torch.cat(
            [
                _grid_to_windows(_resize(_windows_to_grid(pc, t, h, w, m), (gh, gw)), m)
                for pc, (t, h, w), (_, gh, gw) in zip(pieces, small_rows, rows, strict=True)
            ]
        )
    return tensor
