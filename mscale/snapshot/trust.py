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
is taken beside the next forward (memory.py). Nor is one whose optimizer state is poisoned
(`state_bad`): a moment not finite, or Adam's first moment beyond what its second allows. With
m_t = (1-b1) sum b1^k g_(t-k) and v_t = (1-b2) sum b2^k g_(t-k)^2, Cauchy-Schwarz gives
m_t^2 <= (1-b1)^2 / (1-b2) / (1 - b1^2/b2) v_t at every step (about 52.9 v_t at 0.9, 0.999):
an exp_avg scaled up, or an exp_avg_sq scaled down, past that is no gradient's doing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine
    from mscale.snapshot.memory import MemorySnapshot

PLAUSIBLE = float(1 << 16)
MARGIN = 4.0  # on m^2 / v: float rounding of the moments, far below any corruption worth finding
TINY = torch.finfo(torch.float32).tiny  # an exp_avg_sq below it rounds to 0 (state_bad: its own dtype's)


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


def moment_bound(optimizer: object) -> float | None:
    """The largest m^2 / v Adam's moments reach under the optimizer's betas (the module
    docstring), with MARGIN; None where no bound holds (b1^2 >= b2) or none is known."""
    bound = 0.0
    for group in getattr(optimizer, "param_groups", None) or [{}]:
        b1, b2 = (float(b) for b in group.get("betas", (0.9, 0.999)))  # (tensors too)
        if not (0 <= b1 < 1 and 0 < b2 < 1) or b1 * b1 >= b2:
            return None
        bound = max(bound, (1 - b1) ** 2 / (1 - b2) / (1 - b1 * b1 / b2))
    return MARGIN * bound


def state_bad(snap: MemorySnapshot, bound: float | None) -> set[str]:
    """The parameters whose optimizer state in the snapshot is poisoned: a floating-point
    tensor of it not finite, or exp_avg^2 > bound * exp_avg_sq somewhere (no bound: None)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for d in snap.tensors.values():
        for k, t in d.items():
            if k.startswith("optim/"):
                fqn, _, name = k[6:].rpartition("/")
                state.setdefault(fqn, {})[name] = t
    bad: set[str] = set()
    with torch.no_grad():
        for fqn, st in state.items():
            if not all(bool(torch.isfinite(t).all()) for t in st.values() if t.is_floating_point() and t.numel()):
                bad.add(fqn)
                continue
            m, v = st.get("exp_avg"), st.get("exp_avg_sq")
            if bound is None or m is None or v is None or m.shape != v.shape or not m.numel():
                continue
            m32 = m.to(torch.float32)
            floor = torch.finfo(v.dtype).tiny if v.is_floating_point() else 0.0  # v below it: rounded to 0
            if bool((torch.addcmul(v.to(torch.float32) + floor, m32, m32, value=-1.0 / bound) < 0).any()):
                bad.add(fqn)
    return bad


def maxima(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each floating-point tensor's largest magnitude (NaN or Inf where it holds one): one
    `_foreach_norm` of order inf, one read of each tensor, nothing allocated its size."""
    keys = [k for k, t in tensors.items() if t.is_floating_point() and t.numel()]
    if not keys:
        return {}
    with torch.no_grad():
        norms = torch._foreach_norm([tensors[k] for k in keys], float("inf"))
        return dict(zip(keys, torch.stack([n.to(torch.float64) for n in norms]).tolist(), strict=True))


def suspect(
    snap: MemorySnapshot, weights: dict[str, float], bound: float | None, before: dict[str, float] | None
) -> set[str]:
    """The per-step test of a new snapshot (restore_weights' verification), on each tensor's
    largest magnitude alone (`weights`: its weights' `maxima`; one read of the state): a weight or
    a state tensor not finite, max |exp_avg|^2 > bound * max exp_avg_sq, or a weight's largest
    magnitude past (PLAUSIBLE + 1) times the larger of 1 and its largest at the snapshot
    before (`before`, its maxima). Whatever it names, `state_bad` and `beyond` name too (the
    largest m's element breaks the bound; a largest magnitude that grew so moved by more than
    PLAUSIBLE), so the snapshot `trusted` then picks is an older one."""
    state: dict[str, dict[str, float]] = {}
    for k, top in maxima({k: t for d in snap.tensors.values() for k, t in d.items() if k.startswith("optim/")}).items():
        fqn, _, key = k[6:].rpartition("/")
        state.setdefault(fqn, {})[key] = top
    bad = {n for n, w in weights.items() if not math.isfinite(w)}
    bad |= {n for n, w in weights.items() if before and n in before and w > (PLAUSIBLE + 1) * max(1.0, before[n])}
    for fqn, st in state.items():
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if not all(math.isfinite(x) for x in st.values()) or (
            bound is not None and m is not None and v is not None and m * m > bound * (v + TINY)
        ):
            bad.add(fqn)
    return bad


def trusted(engine: SnapshotEngine, names: list[str]) -> MemorySnapshot | None:
    """The newest in-memory snapshot that passed its verification (verify.py: one in flight
    waited for), whose optimizer state is not poisoned (`state_bad`) and whose copy of `names`
    passes `beyond` against the copy before it (the oldest held: its state alone), or None
    when none is. Waits for the copies."""
    held = [s for s in (engine.latest(t) for t in sorted(getattr(engine, "held_steps", None) or [])) if s]
    for s in held:
        s.wait_ready()
    bound = moment_bound(getattr(engine, "optimizer", None))
    newest_first = held[::-1]
    for newer, older in zip(newest_first, [*newest_first[1:], None], strict=True):
        if state_bad(newer, bound):
            continue
        if older is None or not beyond(host_copies(newer, names), host_copies(older, names)):
            return newer
    return None


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
