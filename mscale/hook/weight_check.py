"""Weights checked before they are trusted: when an MPU's output fails (a checksum, a non-finite
value), its weights are checked before the fault is blamed on the device.

The rotating fingerprints (mscale.hook.weights) check 1/8 of the trained weights before each
forward, so a weight written in another group's window goes into the forward unseen. If the
write is large enough to break the MPU's output (a high exponent bit), the output check fires,
and the fuse would count it against the device: L1 would move the corrupted weights to a standby,
L2 and L3 follow, the weight stays. So on such an event, before the failure is counted, the
failing MPU's weights are compared, all of them (one pass over that MPU, paid on the event only),
with what they should be:

1. Exactly (bit for bit, by fingerprint), where a record of the weights as they are now exists:
   the trained group recorded at the last optimizer step, the frozen weights, and all of the
   MPU's weights when the newest verified in-memory snapshot is of the last completed step (its
   capture: every weight's fingerprint taken when the snapshot's copy began).
2. Otherwise against the newest verified snapshot of step S, which the optimizer has moved the
   weights away from since: the fingerprints cannot tell its updates from a corruption, so an
   element counts as corrupted when it is not finite or moved further than optimizer steps do,
   more than PLAUSIBLE times the larger of 1 and its tensor's largest magnitude in the snapshot
   (an exponent bit flip of 2^32 or more; Adam moves an element by at most about 32 x lr a step).
   A smaller change that still breaks the output is left to the fuse (it is counted).

A snapshot is verified when its copy of the MPU's weights matches its capture (a weight written
while the copy ran beside the next forward is in the copy, not in the capture); one without a
capture (taken before the fuse attached, or not by the fuse's step end) is trusted as before.
The repair is restore_weights' (mscale.hook.actions.restore_weights): in place from a snapshot of
the last step, else S's weights for this step and a rollback to S with the steps since re-run
on the same batches, so the run goes on as the fault-free run would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mscale.hook.weights import SOURCE, Fingerprint, charge

PLAUSIBLE = float(1 << 16)


@dataclass
class Verdict:
    """What the check found: the corrupted weights' names, the newest verified snapshot (None:
    none held), and whether that snapshot is of the last completed step (an in-place repair)."""

    corrupted: list[str] = field(default_factory=list)
    snapshot: Any = None
    current: bool = False


def host_copies(snap: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """The snapshot's host copies of the model tensors `names` (those it holds)."""
    wanted = {f"model/{n}": n for n in names}
    return {wanted[k]: t for d in snap.tensors.values() for k, t in d.items() if k in wanted}


def verified(watch: Any, snap: Any, names: list[str]) -> bool:
    """Whether the snapshot's copy of `names` matches its capture (True without a capture)."""
    cap = watch.captured.get(id(snap))
    if cap is None:
        return True
    snap.wait_ready()
    host = host_copies(snap, names)
    if set(host) != set(names):
        return False
    layout, prints = cap
    for n in names:
        i = watch.index[n]
        shape, dtype, _ = layout[i]
        if tuple(host[n].shape) != shape or host[n].dtype != dtype:
            return False
    got = Fingerprint([host[n] for n in names]).compute()
    return torch.equal(got, prints[[watch.index[n] for n in names]])


def newest_verified(engine: Any, watch: Any, names: list[str]) -> Any:
    """The newest in-memory snapshot whose copy of `names` verifies, or None."""
    for step in sorted(getattr(engine, "memory_steps", []) or [], reverse=True):
        snap = engine.latest(step)
        if snap is not None and verified(watch, snap, names):
            return snap
    return None


def _same(layout: tuple, t: torch.Tensor) -> bool:
    return layout == (tuple(t.shape), t.dtype, t.device)


def _exact(watch: Any, names: list[str], now: torch.Tensor, snap: Any, current: bool) -> set[str]:
    """The weights whose fingerprint differs from a record of them as they are now."""
    bad: set[str] = set()
    live = {n: watch.full.tensors[watch.index[n]] for n in names}
    recorded = watch.recorded_now()
    for i, n in enumerate(names):
        rec = recorded.get(n)
        if rec is not None and _same(rec[0], live[n]) and rec[1] != int(now[i]):
            bad.add(n)
    if snap is None or not current:
        return bad
    cap = watch.captured.get(id(snap))
    if cap is None:  # no capture: the snapshot's copy itself, fingerprinted
        host = host_copies(snap, names)
        held = [n for n in names if n in host and tuple(host[n].shape) == tuple(live[n].shape)]
        held = [n for n in held if host[n].dtype == live[n].dtype]
        prints = Fingerprint([host[n] for n in held]).compute() if held else torch.zeros(0, dtype=torch.int64)
        bad |= {n for n, p in zip(held, prints.tolist(), strict=True) if p != int(now[names.index(n)])}
        return bad
    layout, every = cap
    for i, n in enumerate(names):
        j = watch.index[n]
        if _same(layout[j], live[n]) and int(every[j]) != int(now[i]):
            bad.add(n)
    return bad


def _beyond(watch: Any, names: list[str], snap: Any) -> set[str]:
    """The trained weights holding an element not finite, or moved since the snapshot by more
    than PLAUSIBLE times the larger of 1 and its tensor's largest magnitude there."""
    bad: set[str] = set()
    host = host_copies(snap, names)
    with torch.no_grad():
        for n in names:
            w = watch.full.tensors[watch.index[n]]
            if not w.requires_grad or n not in host or tuple(host[n].shape) != tuple(w.shape):
                continue
            was = host[n].to(torch.float32)
            now = w.detach().to("cpu", torch.float32)
            bound = PLAUSIBLE * max(1.0, float(was.abs().max())) if was.numel() else PLAUSIBLE
            if not bool(torch.isfinite(now).all()) or float((now - was).abs().max()) > bound:
                bad.add(n)
    return bad


def check_mpu(fuse: Any, watch: Any, mpu_id: str) -> Verdict:
    """Compare MPU `mpu_id`'s weights with what they should be (the module docstring)."""
    t0 = time.perf_counter()
    names, now = watch.of_mpu(mpu_id)
    engine = fuse.snapshot_engine
    snap = newest_verified(engine, watch, names) if engine is not None else None
    current = snap is not None and snap.step == getattr(engine, "step", None)
    bad = _exact(watch, names, now, snap, current)
    if snap is not None and not current:
        bad |= _beyond(watch, names, snap)
    charge(fuse.guard, SOURCE, t0)
    return Verdict(sorted(bad, key=names.index), snap, current)
