"""Weights checked before they are trusted: when an MPU's output fails (a checksum, a non-finite
value), its weights are checked before the fault is blamed on the device.

The rotating fingerprints (mscale.hook.weights) check 1/8 of the trained weights before each
forward, so a weight written in another group's window goes into the forward unseen. If the
write breaks the MPU's output (a high exponent bit), the output check fires, and the fuse would
count it against the device: L1 would move the corrupted weights to a standby, L2 and L3 follow,
the weight stays. So on such an event, before the failure is counted, the failing MPU's weights
are compared, all of them, with what they should be (paid on the event only, nothing a step):

1. Bit for bit (by fingerprint) where a record of the weights as they are now exists: the
   trained group recorded after the last optimizer step, the frozen weights, and all of the
   MPU's weights when the snapshot trusted below is of the last completed step (its copy).
2. Otherwise against the trusted snapshot of an older step S, from which the optimizer has moved
   the weights since: fingerprints cannot tell its updates from a corruption, so a weight counts
   as corrupted when an element is not finite or moved further than optimizer steps move one,
   more than PLAUSIBLE times the larger of 1 and its tensor's largest magnitude in the snapshot
   (a flip of an exponent bit worth 2^32 or more; Adam moves an element by at most about 32 x lr
   a step). A smaller change that still breaks the output is left to the fuse (it counts).

The snapshot trusted is the newest whose copy of the MPU's weights is finite and within the same
bound of the copy before it (the oldest held is trusted): a weight hit right after the optimizer
step can land in the newest copy, which runs beside the next forward (mscale.snapshot.memory).
The repair is restore_weights' (mscale.hook.actions.restore_weights): in place from a snapshot of
the last step, else S's weights for this step and a rollback to S with the steps since re-run on
the same batches, so the run goes on as the fault-free run would.

Cost, on the event only: one fingerprint pass over the MPU's weights, and about three passes over
them and over the two newest snapshot copies (the bound); on the 8.1M LLaVA of
benchmarks/attach_overhead.py (docs/healing.md) tens of milliseconds for the vision tower.
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
    """What the check found: the corrupted weights' names, the snapshot trusted (None: none
    held), and whether that snapshot is of the last completed step (an in-place repair)."""

    corrupted: list[str] = field(default_factory=list)
    snapshot: Any = None
    current: bool = False


def host_copies(snap: Any, names: list[str]) -> dict[str, torch.Tensor]:
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
            a = t.detach().to("cpu", torch.float32)
            b = w.detach().to("cpu", torch.float32)
            bound = PLAUSIBLE * max(1.0, float(b.abs().max()))
            if not bool(torch.isfinite(a).all()) or float((a - b).abs().max()) > bound:
                bad.add(n)
    return bad


def trusted(engine: Any, names: list[str]) -> Any:
    """The newest in-memory snapshot whose copy of `names` is sane against the copy before it
    (the oldest held is trusted), or None when none is held."""
    held = [s for s in (engine.latest(t) for t in sorted(getattr(engine, "memory_steps", None) or [])) if s]
    for s in held:
        s.wait_ready()
    for newer, older in zip(reversed(held), list(reversed(held))[1:], strict=False):
        if not beyond(host_copies(newer, names), host_copies(older, names)):
            return newer
    return held[0] if held else None


def _exact(watch: Any, names: list[str], now: torch.Tensor, snap: Any, current: bool) -> set[str]:
    """The weights whose fingerprint differs from a record of them as they are now."""
    live = {n: watch.tensors[n] for n in names}
    recorded = watch.recorded_now()
    bad: set[str] = set()
    for i, n in enumerate(names):
        rec = recorded.get(n)
        same = rec is not None and rec[0] == (tuple(live[n].shape), live[n].dtype, live[n].device)
        if same and rec is not None and rec[1] != int(now[i]):
            bad.add(n)
    if snap is None or not current:
        return bad
    host = host_copies(snap, names)
    held = [n for n in names if n in host and host[n].shape == live[n].shape and host[n].dtype == live[n].dtype]
    if held:
        prints = Fingerprint([host[n] for n in held]).compute().tolist()
        bad |= {n for n, p in zip(held, prints, strict=True) if p != int(now[names.index(n)])}
    return bad


def check_mpu(fuse: Any, watch: Any, mpu_id: str) -> Verdict:
    """Compare MPU `mpu_id`'s weights with what they should be (the module docstring)."""
    t0 = time.perf_counter()
    names, now = watch.of_mpu(mpu_id)
    engine = fuse.snapshot_engine
    snap = trusted(engine, names) if engine is not None else None
    current = snap is not None and snap.step == getattr(engine, "step", None)
    bad = _exact(watch, names, now, snap, current)
    if snap is not None and not current:
        frozen = set(watch.names["frozen"])
        trained = {n: watch.tensors[n] for n in names if n not in frozen}
        bad |= beyond(trained, host_copies(snap, names))
    charge(fuse.guard, SOURCE, t0)
    return Verdict(sorted(bad, key=names.index), snap, current)
