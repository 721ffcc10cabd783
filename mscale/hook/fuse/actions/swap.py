"""L1 MPU swap: move the MPU (parameters, gradients, optimizer state) to a standby GPU.

The standby is a GPU of the node that no MPU of this job uses, that no action of the job
avoids (quarantined, or failed on by one of its MPUs: an SDC there may hit any MPU). It moves
verified weights only: the MPU's weights are checked first against the newest trusted in-memory
snapshot and, if corrupted, repaired (restore_weights). Inside a forward the fuse then
re-runs the MPU's forward for the current batch on the standby, so the step completes with
a correct output. No standby: ActionFailed("no healthy standby"), and the fuse escalates.
With a link to the agent the standby is the agent's answer from its node view (every rank's
GPUs, their health, quarantines: mscale.hook.fuse.standby, mscale.daemon.standby); its "none"
escalates the same way, and only without an answer in time does the job choose alone.
A sharded model's (FSDP2) shards never leave the process group's device: weights verified as
above, the binding moved on simulated GPUs only, the event says so (docs/healing.md#under-fsdp2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import Result
from mscale.hook.fuse.actions.base import ActionFailed, Executor, FuseContext
from mscale.snapshot.sharded import is_sharded

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard
    from mscale.hook.core.mpu import Mpu

log = structlog.get_logger("mscale.fuse")


class Swaps:
    """Per job: the GPUs each MPU failed on, each MPU's last swap. The weights' fingerprints
    are the fingerprint watch's (restore_weights' state): a second per-step pass of its own
    over every MPU cost 5 ms of a 490 ms step on an 8M LLaVA."""

    def __init__(self, fuse: FuseContext) -> None:
        self.gpu_count: int | None = fuse.gpu_count  # None: found on first use
        self.failed_on: dict[str, set[int]] = {}
        self.last: dict[str, tuple[int, int, bool]] = {}  # mpu_id -> (from gpu, to gpu, weights restored)
        self.kept_on: dict[str, str] = {}  # mpu_id -> the device its shards stayed on (FSDP2)

    def avoid_gpus(self, fuse: FuseContext) -> set[int]:
        return set().union(*self.failed_on.values())


def apply(fuse: FuseContext, state: Swaps, d: Decision) -> str:
    m = fuse.guard.mpu(d.target.mpu_id)
    if d.target.gpu is not None and d.target.gpu != m.gpu:
        return Result.NOOP  # a command about a GPU this MPU has already left (another path moved it)
    old = m.gpu
    sharded = is_sharded(fuse.guard.model)
    pinned = sharded and m.device.type != "cpu"  # a real GPU: the binding stays with the shards
    standby = old if pinned else standby_for(fuse, state, m)
    if standby is None:
        raise ActionFailed("no healthy standby GPU")
    restored = verify_weights(fuse, state, m)  # restores from the in-memory snapshot on a mismatch
    state.failed_on.setdefault(m.mpu_id, set()).add(old)
    if not pinned:
        move_mpu(fuse.guard, m, standby, shards=sharded)
    state.last[m.mpu_id] = (old, standby, restored)
    state.kept_on[m.mpu_id] = str(m.device) if sharded else ""
    return Result.APPLIED


def event(state: Swaps, d: Decision) -> tuple[str, dict[str, str]]:
    if d.target.mpu_id not in state.last:
        return "", {}
    old, new, restored = state.last[d.target.mpu_id]
    what = f"gpu {old} -> {new}" + (", weights restored from the snapshot" if restored else "")
    if device := state.kept_on.get(d.target.mpu_id, ""):
        what += f"; sharded (FSDP2): its shards stay on {device}, the process group's device"
    return what, {"to_gpu": str(new)}


def standby_for(fuse: FuseContext, state: Swaps, m: Mpu) -> int | None:
    """A healthy GPU for `m`: none the job avoids, not its own, preferably unused; among
    those, the one with the best measured profile (mscale.contracts.msrp)."""
    import torch

    from mscale.contracts.msrp import choose_standby

    if state.gpu_count is None:
        state.gpu_count = (
            torch.cuda.device_count() if torch.cuda.is_available() else max(8, 1 + max(o.gpu for o in fuse.guard.mpus))
        )
    bad = {m.gpu}.union(*(g for g in fuse.dispatch("avoid_gpus") if isinstance(g, set)))
    asked = fuse.ask_standby(m, bad) if fuse.ask_standby is not None else None  # the node's view
    if asked is not None:  # (mscale.hook.fuse.standby): a GPU, or -1 for none; None: no answer, choose here
        return asked if asked >= 0 else None
    used = {o.gpu for o in fuse.guard.mpus if o is not m}
    free = [g for g in range(state.gpu_count) if g not in bad and g not in used]
    shared = [g for g in range(state.gpu_count) if g not in bad and g in used]
    candidates = free or shared
    return choose_standby(fuse.guard, m, candidates)  # the best measured profile (MSRP) first


def move_mpu(guard: Guard, m: Mpu, gpu: int, *, shards: bool = False) -> None:
    """Rebind `m` to GPU `gpu`: on a GPU node its parameters, gradients, buffers and optimizer
    state move to that device behind a device-boundary adapter (`Guard.rebind`, through
    mscale.hook.fuse.placement.place, the helper the L2 CPU fallback uses too), and it takes that
    GPU's uuid; on CPU the simulated binding moves. `shards` (FSDP2): only the binding moves."""
    import torch

    device = torch.device("cuda", gpu) if m.device.type == "cuda" and not shards else None
    guard.rebind(m, gpu, device=device)


def verify_weights(fuse: FuseContext, state: Swaps, m: Mpu) -> bool:
    """Check the MPU's weights against the newest trusted in-memory snapshot (restore_weights',
    once a step) and repair them when corrupted: only verified weights move. True when repaired."""
    from mscale.hook.fuse.actions.restore_weights import Watch

    weights = fuse.state_of(Watch)
    return weights is not None and bool(weights.check(fuse, m))  # it logs its finding


EXECUTOR = Executor(actions.get("l1_swap"), apply, state=Swaps, event=event)
