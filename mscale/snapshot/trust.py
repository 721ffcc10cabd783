"""Live weights against the in-memory snapshots: which snapshot to trust, and which weights no
optimizer step since it explains (the fuse's weights check: mscale.hook.fuse.actions.restore_weights).

Against a snapshot of the last completed step the weights must be bitwise its copy. Against an
older one (step S) the optimizer has moved every trained weight since, and nothing short of
re-running the steps tells its updates from a corruption bit for bit; so there a tensor counts
as corrupted when an element is not finite or has moved from S's copy by more than PLAUSIBLE
times the larger of 1 and the tensor's largest magnitude at S: a flipped exponent bit worth 2^32
or more, far beyond optimizer steps (Adam moves an element by at most about 32 x lr a step).
A snapshot is trusted when its copy passes the same test against the copy before it (the oldest
held is trusted): a weight hit right after the optimizer step can land in the newest copy, which
is taken beside the next forward (memory.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine
    from mscale.snapshot.memory import MemorySnapshot

PLAUSIBLE = float(1 << 16)


def host_copies(snap: MemorySnapshot, names: list[str]) -> dict[str, torch.Tensor]:
    """The snapshot's host copies of the model tensors `names` (those it holds)."""
    wanted = {f"model/{n}": n for n in names}
    return {wanted[k]: t for d in snap.tensors.values() for k, t in d.items() if k in wanted}


def beyond(now: dict[str, torch.Tensor], was: dict[str, torch.Tensor]) -> set[str]:
    """The names whose tensor in `now` holds an element not finite, or further from `was` than
    PLAUSIBLE times the larger of 1 and the largest magnitude in `was` (same shapes only)."""
    bad: set[str] = set()
    with torch.no_grad():
        for n, t in now.items():
            w = was.get(n)
            if w is None or tuple(w.shape) != tuple(t.shape) or not t.numel():
                continue
            a, b = t.detach().to("cpu", torch.float32), w.to(torch.float32)
            if not bool(torch.isfinite(a).all()) or float((a - b).abs().max()) > PLAUSIBLE * max(
                1.0, float(b.abs().max())
            ):
                bad.add(n)
    return bad


def differs(now: dict[str, torch.Tensor], snap: MemorySnapshot) -> set[str]:
    """The names whose tensor in `now` is not bitwise the snapshot's copy (same shape and dtype)."""
    host = host_copies(snap, list(now))
    same = {n for n, h in host.items() if h.shape == now[n].shape and h.dtype == now[n].dtype}
    return {n for n in same if not torch.equal(now[n].detach().cpu(), host[n])}


def trusted(engine: SnapshotEngine, names: list[str]) -> MemorySnapshot | None:
    """The newest in-memory snapshot whose copy of `names` passes `beyond` against the copy
    before it (the oldest held is trusted), or None when none is held. Waits for the copies."""
    held = [s for s in (engine.latest(t) for t in sorted(getattr(engine, "memory_steps", None) or [])) if s]
    for s in held:
        s.wait_ready()
    newest_first = held[::-1]
    for newer, older in zip(newest_first, newest_first[1:], strict=False):
        if not beyond(host_copies(newer, names), host_copies(older, names)):
            return newer
    return held[0] if held else None


def unexplained(
    live: dict[str, torch.Tensor], frozen: set[str], engine: SnapshotEngine
) -> tuple[list[str], MemorySnapshot | None]:
    """The names of `live` (one MPU's weights) its newest trusted snapshot does not explain:
    bitwise against one of the last completed step (`engine.step`), else beyond what optimizer
    steps move (the `frozen` skipped: they are checked bitwise before each forward); and that
    snapshot (None: none held)."""
    snap = trusted(engine, list(live))
    if snap is None:
        return [], None
    if snap.step == getattr(engine, "step", None):
        bad = differs(live, snap)
    else:
        bad = beyond({n: t for n, t in live.items() if n not in frozen}, host_copies(snap, list(live)))
    return [n for n in live if n in bad], snap
