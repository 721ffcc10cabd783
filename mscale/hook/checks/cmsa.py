"""CMSA: per-MPU gradient clipping that gives noisy modalities proportionally more room.

    clip_i = base * mult_i * (1 + alpha * GVC_i)      GVC_i = std(g_i) / mean(|g_i|)

g_i is every gradient element of MPU i (GVC estimated from one row in 8 of each gradient
matrix, see `grad_stats`), GVC_i its gradient variation coefficient, mult_i 1
unless raised (`raise_threshold`, used by the L2 fuse to absorb a degraded MPU's noisier
gradients). When ||g_i|| > clip_i the MPU's gradients are scaled to clip_i.

Cold start (`warmup_steps`, default 10, counted in training steps from the first one seen, so
that steps re-run after a rollback clip as they did): the first half unclipped (alpha unknown), the
second half with a small alpha (`probe_alpha`), then alpha is fitted once: rho is the
Pearson correlation, over the warm-up steps, between the mean GVC of a step and the loss
improvement that followed it (loss_t - loss_t+1). Noisy gradients that went with progress
earn room: alpha = probe_alpha + (alpha_max - probe_alpha) * max(0, rho); noisy gradients
that went with no progress or with worse loss keep alpha at probe_alpha * (1 + min(0, rho))
(down to 0). The clip ratio of an MPU is the share of its clipped steps since the fit began
(`cmsa_clip_ratio{mpu_id}`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, cast

import torch

from mscale.hook.core.mpu import Mpu, by_key
from mscale.snapshot.values import StateDict

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class CmsaConfig:
    base: float = 1.0
    warmup_steps: int = 10
    probe_alpha: float = 0.1
    alpha_max: float = 1.0

    def __post_init__(self) -> None:
        if not self.base > 0:
            raise ValueError(f"base: expected > 0, got {self.base}")
        if self.warmup_steps < 4:
            raise ValueError(f"warmup_steps: expected >= 4 (two unclipped, two probing), got {self.warmup_steps}")
        if not 0 <= self.probe_alpha <= self.alpha_max:
            raise ValueError(
                f"probe_alpha/alpha_max: expected 0 <= probe <= max, got {self.probe_alpha}, {self.alpha_max}"
            )


# GVC is estimated from one row in this many of each gradient matrix. Not fewer: gradient
# rows are correlated (row i of dW is sum_n dy_ni x_n) and heavy-tailed (GVC ~2.2 where a
# Gaussian gives 1.25), so the estimate's error follows the number of rows, not elements.
# Measured on the benchmark model (hidden 512, 8 steps, each MPU against its full-gradient GVC):
# worst error 8% at 1 row in 8, 12.5% at 1 in 16, 18% at 1 in 32; with alpha <= 1 that moves
# the clip threshold by up to ~5.5% / 8.6% / 12%, for a saving of ~0.25% of a step per halving.
# (Taking the second moment exactly from the norm pass is worse, 17% at 1 in 8: the sampled
# moments' errors partly cancel in the ratio.)
GVC_ROWS = 8
# After the cold start GVC is re-estimated one step in GVC_EVERY, the latest estimate in force
# in between (GradStatistics): it only moves the clip threshold (by alpha * GVC) and drifts
# over hundreds of steps, while its sampled pass costs ~0.5% of a step at
# benchmarks/hook_overhead.py's realistic shape, as much as the rest of the gradient statistics:
# one step in 8 is 0.06% of a step on average, an estimate at most 7 steps old.
GVC_EVERY = 8


# One row per MPU (and one for the rest of the model) in grad_stats' one read: the norm squared
# of its sharded gradients (summed over the shards), of its unsharded ones (counted once), and
# GVC's sums over the sampled elements (sum |g|, sum g^2, sum g).
ROW = 5
SHARDED, PLAIN = 0, 1

# one MPU's sample buffer, kept while its gradients' shapes hold: (the sampled shapes, the
# float32 buffer, a view of it per sampled gradient)
_Buffer = tuple[tuple[torch.Size, ...], torch.Tensor, list[torch.Tensor]]


def _sample(g: torch.Tensor) -> torch.Tensor:
    return g[::GVC_ROWS] if g.dim() >= 2 and g.shape[0] >= 8 * GVC_ROWS else g


def _local(g: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP2 DTensor) gradient; a plain one as it is."""
    return g.to_local() if hasattr(g, "to_local") else g


def _shard_group(mesh: DeviceMesh) -> ProcessGroup:
    """The process group a sharded parameter's shards are spread over: the mesh's last dimension
    (FSDP2's 1-D mesh, or the shard dimension of HSDP's (replicate, shard) mesh)."""
    return mesh.get_group(mesh.ndim - 1)


def _over_shards(values: torch.Tensor, counts: list[int], mesh: DeviceMesh | None) -> torch.Tensor:
    """Sums the per-shard sums (norms squared, GVC sums, sample counts appended) over the shard
    group when the MPUs' parameters are sharded (FSDP2: `mesh`, their device mesh), so that the
    norms and GVC are the whole gradient's on every rank; `values` unchanged otherwise (mesh
    None). The parts of unsharded gradients (ROW's PLAIN slot) are the shard group's first
    rank's alone: each rank holds the whole of those, counted once."""
    if mesh is None:
        return values
    import torch.distributed as dist

    group = _shard_group(mesh)
    out = torch.cat([values, torch.tensor(counts, dtype=values.dtype, device=values.device)])
    if dist.get_rank(group) != 0:
        out[PLAIN : len(values) : ROW] *= 0.0  # (a NaN or an Inf stays one: found on every rank)
    dist.all_reduce(out, group=group)
    return out


def _gvc_row(
    mpu_id: str, grads: list[torch.Tensor], l2sq: torch.Tensor, buffers: dict[str, _Buffer] | None
) -> tuple[torch.Tensor, int]:
    """One MPU's row for grad_stats' one read, on the device: (its norms squared, sharded and
    not: `l2sq`, sum |g|, sum g^2, sum g) over every GVC_ROWS-th row of each gradient matrix (vectors whole), gathered in one
    float32 buffer per MPU (strided reductions are several times slower on CPU), kept in
    `buffers` while the shapes hold; and the count of sampled elements."""
    sample = [_sample(g) for g in grads]
    shapes = tuple(s.shape for s in sample)
    n = sum(s.numel() for s in sample)
    device = grads[0].device
    cached = None if buffers is None else buffers.get(mpu_id)
    if cached is None or cached[0] != shapes or cached[1].device != device:
        flat = torch.empty(n, dtype=torch.float32, device=device)
        views, off = [], 0
        for shape, s in zip(shapes, sample, strict=True):
            views.append(flat[off : off + s.numel()].view(shape))
            off += s.numel()
        cached = (shapes, flat, views)
        if buffers is not None:
            buffers[mpu_id] = cached
    _, flat, views = cached
    with torch.no_grad():
        torch._foreach_copy_(views, sample)
        s_sum = flat.sum()
        s_l2 = torch.linalg.vector_norm(flat)
        s_l1 = flat.abs_().sum()
        stats = torch.stack((s_l1, s_l2, s_sum)).to(torch.float64)
        stats[1] = stats[1].square()
        return torch.cat((l2sq, stats)), n  # stays on the device: one sync in grad_stats


def _norm_and_gvc(row: list[float], n: int, gvc: bool) -> tuple[float, float | None]:
    """An MPU's (gradient norm, GVC) from its row as read back (see _gvc_row); GVC None when
    not estimated this step, 0.0 when nothing was sampled."""
    sharded, plain, s_l1, s_l2sq, s_sum = row
    l2sq = sharded + plain
    norm = math.sqrt(l2sq) if l2sq >= 0 else math.nan
    if not gvc:
        return norm, None
    if n == 0:
        return 0.0, 0.0
    mean = s_sum / n
    var = max(s_l2sq / n - mean * mean, 0.0) if math.isfinite(s_l2sq) else math.nan
    mean_abs = s_l1 / n
    return norm, (math.sqrt(var) / mean_abs if mean_abs > 0 else (0.0 if math.isfinite(mean_abs) else math.nan))


def _norms(
    with_grad: Sequence[torch.nn.Parameter],
    grads: list[torch.Tensor],
    known: dict[int, tuple[torch.Tensor, int, torch.Tensor]] | None,
) -> list[torch.Tensor]:
    """The norms of `grads` (those of `with_grad`, in order), one `_foreach_norm` over those not
    in `known`: a norm taken this step of the same gradient tensor, unchanged since (same
    object, same version) and of the dtype this pass would give."""
    if not known:
        return list(torch._foreach_norm(grads, 2))
    out: list[torch.Tensor | None] = [
        k[2]
        if (k := known.get(id(p))) and k[0] is p.grad and k[1] == p.grad._version and k[2].dtype == g.dtype
        else None
        for p, g in zip(with_grad, grads, strict=True)
    ]
    missing = [i for i, n in enumerate(out) if n is None]
    taken = iter(torch._foreach_norm([grads[i] for i in missing], 2) if missing else ())
    return [n if n is not None else next(taken) for n in out]  # the missing ones in their order


def grad_stats(
    mpus: Sequence[Mpu],
    params: Iterable[torch.nn.Parameter],
    buffers: dict[str, _Buffer] | None = None,
    *,
    gvc: bool = True,
    known: dict[int, tuple[torch.Tensor, int, torch.Tensor]] | None = None,
) -> tuple[float, dict[str, tuple[float, float | None]]]:
    """(global gradient norm over `params`, {mpu_id: (grad norm, GVC)}) with one device sync;
    GVC None when `gvc` is False (the norms only: see GVC_EVERY).

    Norms are exact (one pass over the gradients, one `_foreach_norm` per MPU). GVC is a
    statistic for CMSA's thresholds: it is estimated from every GVC_ROWS-th row of each
    gradient matrix (vectors whole), gathered into one contiguous float32 buffer per MPU
    (strided reductions are several times slower on CPU) whose sum, sum of squares and sum
    of magnitudes are three passes over an eighth of the gradients. `buffers` (a dict the
    caller keeps) reuses those buffers across steps. `known`: norms already taken this step
    ({id(parameter): (gradient, its version, norm)}, GradStatistics.offer), not taken again."""
    rows: list[torch.Tensor] = []
    counts: list[int] = []
    in_mpus: set[int] = set()
    mesh: DeviceMesh | None = None  # the parameters' device mesh when sharded (FSDP2)
    for m in mpus:
        ps = m.parameters()  # (its module tree walked once, the parameters read live: Mpu._tree)
        in_mpus.update(id(p) for p in ps)
        if mesh is None:
            mesh = next((p.device_mesh for p in ps if hasattr(p, "device_mesh")), None)
        with_grad = [p for p in ps if p.grad is not None]
        grads = [_local(g) for p in with_grad if (g := p.grad) is not None]
        if not grads:
            counts.append(0)
            rows.append(torch.zeros(ROW, dtype=torch.float64))
            continue
        l2sq = _split(with_grad, _norms(with_grad, grads, known))
        if not gvc:
            counts.append(0)
            rows.append(torch.cat((l2sq, l2sq.new_zeros(ROW - 2))))
            continue
        row, n = _gvc_row(m.mpu_id, grads, l2sq, buffers)
        counts.append(n)
        rows.append(row)
    rows.append(_rest_row([p for p in params if p.grad is not None and id(p) not in in_mpus]))
    # every MPU's row and the rest read back with one sync, gathered on the device most rows
    # are on (rows of MPUs without gradients are CPU zeros; a no-op on CPU)
    devs = [r.device for r in rows]
    dev = max(set(devs), key=devs.count)
    values = _over_shards(torch.cat([r.to(dev) for r in rows]), counts, mesh).tolist()
    counts = [round(c) for c in values[len(rows) * ROW :]] or counts
    out: dict[str, tuple[float, float | None]] = {}
    total = 0.0
    for i in range(len(rows)):
        total += values[ROW * i + SHARDED] + values[ROW * i + PLAIN]
    for i, m in enumerate(mpus):
        out[m.mpu_id] = _norm_and_gvc(values[ROW * i : ROW * (i + 1)], counts[i], gvc)
    return (math.sqrt(total) if total >= 0 else math.nan), out


def _rest_row(rest: list[torch.nn.Parameter]) -> torch.Tensor:
    """The row of the rest of the model (the parameters outside every MPU, with a gradient):
    its norms only, which add to the global norm."""
    if not rest:
        return torch.zeros(ROW, dtype=torch.float64)
    l2sq = _split(rest, list(torch._foreach_norm([_local(g) for p in rest if (g := p.grad) is not None], 2)))
    return torch.cat((l2sq, l2sq.new_zeros(ROW - 2)))


def _split(with_grad: Sequence[torch.nn.Parameter], norms: list[torch.Tensor]) -> torch.Tensor:
    """(norm squared of the sharded gradients, of the others) from the gradients' norms, in the
    order of `with_grad`, on their device in float64."""
    with torch.no_grad():
        sq = torch.stack(norms).to(torch.float64).square()
        sharded = [hasattr(p.grad, "to_local") for p in with_grad]
        if all(sharded):
            return torch.stack((sq.sum(), sq.new_zeros(())))
        if not any(sharded):
            return torch.stack((sq.new_zeros(()), sq.sum()))
        mask = torch.tensor(sharded, device=sq.device)
        return torch.stack((sq[mask].sum(), sq[~mask].sum()))


class GvcState(TypedDict):
    """What GradStatistics' state_dict holds: the kept GVC estimates, step -> {mpu_id: GVC}."""

    estimates: dict[int, dict[str, float]]


class GradStatistics:
    """The guard's gradient statistics of each step: exact norms every step, GVC when CMSA's
    schedule asks (`Cmsa.wants_gvc`), and otherwise the GVC in force, the latest estimate at or
    before the step. The estimates of the last KEPT_ESTIMATES estimated steps are kept, so that
    a step re-run after a rollback sees the same GVC as when it first ran (a rolled-back run
    continues bitwise as an uninterrupted one); none in force, or a non-finite one, is redone."""

    KEPT_ESTIMATES = 64

    def __init__(self) -> None:
        self._buffers: dict[str, _Buffer] = {}  # grad_stats' sample buffers, reused
        self._estimates: dict[int, dict[str, float]] = {}  # step -> {mpu_id: GVC}
        # norms another detector took this step (the gradient check at the commit point, one
        # rank), reused by the next `measure` and cleared by it: a pass over those gradients saved
        self._known: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def offer(self, p: torch.nn.Parameter, norm: torch.Tensor) -> None:
        """The 2-norm of `p.grad` as it is now, for this step's `measure` (used only while that
        gradient is the same tensor, unchanged)."""
        if p.grad is not None:
            self._known[id(p)] = (p.grad, p.grad._version, norm)

    def in_force(self, step: int, mpu_ids: Iterable[str]) -> dict[str, float] | None:
        earlier = [s for s in self._estimates if s <= step]
        if not earlier:
            return None
        estimate = self._estimates[max(earlier)]
        usable = estimate.keys() == set(mpu_ids) and all(math.isfinite(v) for v in estimate.values())
        return estimate if usable else None

    def measure(self, mpus: Sequence[Mpu], params: Iterable[torch.nn.Parameter], step: int, scheduled: bool) -> float:
        """Sets each MPU's grad_norm and gvc; returns the global gradient norm over `params`."""
        kept = None if scheduled else self.in_force(step, [m.mpu_id for m in mpus])
        known, self._known = self._known, {}
        total, per_mpu = grad_stats(mpus, params, self._buffers, gvc=kept is None, known=known)
        for m in mpus:
            m.grad_norm, gvc = per_mpu[m.mpu_id]
            m.gvc = kept[m.mpu_id] if kept is not None else (math.nan if gvc is None else gvc)
        if kept is None:
            self._estimates[step] = {m.mpu_id: m.gvc for m in mpus}
            if len(self._estimates) > self.KEPT_ESTIMATES:
                del self._estimates[min(self._estimates)]
        return total

    def state_dict(self) -> GvcState:
        return {"estimates": {s: dict(e) for s, e in self._estimates.items()}}

    def load_state_dict(self, state: GvcState) -> None:
        self._estimates = {int(s): dict(e) for s, e in state["estimates"].items()}


class CmsaFit(TypedDict):
    """What Cmsa's state_dict holds: the fit and its progress (see Cmsa.state_dict)."""

    alpha: float | None
    rho: float | None
    steps: int
    clipped: dict[str, int]
    clip: dict[str, float]
    first: int | None
    warm: dict[int, tuple[float, float]]


class Cmsa:
    def __init__(self, mpus: Sequence[Mpu], config: CmsaConfig | None = None) -> None:
        self.mpus = list(mpus)
        self.config = config or CmsaConfig()
        self.alpha: float | None = None  # None: unclipped cold start
        self.rho: float | None = None
        self.multiplier: dict[str, float] = {m.mpu_id: 1.0 for m in self.mpus}
        self.clip: dict[str, float] = {}
        self.steps = 0  # steps with clipping active
        self.clipped: dict[str, int] = {m.mpu_id: 0 for m in self.mpus}
        self._first: int | None = None  # the first step seen: the cold start counts from it
        self._warm: dict[int, tuple[float, float]] = {}  # step -> (mean GVC, loss) in the warm-up

    # --- API for the fuse --------------------------------------------------------------

    def raise_threshold(self, mpu: Mpu | str, factor: float) -> float:
        """Multiply an MPU's clip threshold by `factor` (> 0); returns the new multiplier."""
        if not factor > 0:
            raise ValueError(f"factor: expected > 0, got {factor}")
        key = mpu.mpu_id if isinstance(mpu, Mpu) else by_key(self.mpus, mpu).mpu_id
        self.multiplier[key] *= factor
        return self.multiplier[key]

    def reset_threshold(self, mpu: Mpu | str) -> None:
        key = mpu.mpu_id if isinstance(mpu, Mpu) else by_key(self.mpus, mpu).mpu_id
        self.multiplier[key] = 1.0

    def clip_ratio(self, mpu_id: str) -> float:
        return self.clipped.get(mpu_id, 0) / self.steps if self.steps else 0.0

    def wants_gvc(self, step: int) -> bool:
        """Whether this step re-estimates GVC: every step of the cold start (the fit pairs each
        step's GVC with the loss change that followed it), then one step in GVC_EVERY."""
        first = step if self._first is None else self._first
        return step - first < self.config.warmup_steps or step % GVC_EVERY == 0

    def threshold(self, mpu: Mpu, alpha: float | None = None) -> float:
        alpha = (self.alpha if alpha is None else alpha) or 0.0
        gvc = mpu.gvc if math.isfinite(mpu.gvc) else 0.0
        return self.config.base * self.multiplier[mpu.mpu_id] * (1.0 + alpha * gvc)

    # --- per step (called by the Guard after grad_stats filled mpu.grad_norm / mpu.gvc) --

    def apply(self, step: int, loss: float | None) -> dict[str, bool]:
        """Clip this step's gradients. The cold start is counted in steps from the first one
        seen, not in calls: a rollback that re-runs steps of the warm-up re-runs them as they
        ran (unclipped, then probing), and their figures replace the abandoned ones."""
        c = self.config
        if self._first is None:
            self._first = step
        i = max(0, step - self._first)
        alpha = None
        if i < c.warmup_steps:
            gvcs = [m.gvc for m in self.mpus if math.isfinite(m.gvc)]
            if loss is not None and math.isfinite(loss) and gvcs:
                self._warm[step] = (sum(gvcs) / len(gvcs), loss)
            if i < c.warmup_steps // 2:
                return {}  # unclipped: alpha unknown
            alpha = c.probe_alpha
            if self.alpha is None:
                self.alpha = c.probe_alpha
        elif self.rho is None:
            self._fit()
        self.steps += 1
        out: dict[str, bool] = {}
        for m in self.mpus:
            clip = self.threshold(m, alpha)
            self.clip[m.mpu_id] = clip
            # the norm from grad_stats' pass (shared with the loss detector); a factor
            # clip/norm >= 1 would leave the gradients as they are: no multiply then
            norm = m.grad_norm
            hit = math.isfinite(norm) and norm > clip
            out[m.mpu_id] = hit
            if hit:
                self.clipped[m.mpu_id] += 1
                grads = [p.grad for p in m.parameters() if p.grad is not None]
                torch._foreach_mul_(grads, clip / (norm + 1e-6))
        return out

    # --- snapshotted (CmsaState): the fit and its progress, not the fuse's multipliers -----

    def state_dict(self) -> CmsaFit:
        return {
            "alpha": self.alpha,
            "rho": self.rho,
            "steps": self.steps,
            "clipped": dict(self.clipped),
            "clip": dict(self.clip),
            "first": self._first,
            "warm": dict(self._warm),  # (mean GVC, loss) tuples: immutable, shared
        }

    def load_state_dict(self, state: CmsaFit) -> None:
        unknown = set(state["clipped"]) - set(self.clipped)
        if unknown:
            raise ValueError(f"CMSA state: MPUs {sorted(unknown)} are not this guard's {sorted(self.clipped)}")
        self.alpha, self.rho, self.steps = state["alpha"], state["rho"], int(state["steps"])
        self.clipped = {**dict.fromkeys(self.clipped, 0), **state["clipped"]}
        self.clip = dict(state["clip"])
        self._first = state["first"]
        self._warm = {int(s): (float(g), float(loss)) for s, (g, loss) in state["warm"].items()}

    def _fit(self) -> None:
        c = self.config
        warm = [self._warm[s] for s in sorted(self._warm)]
        pairs = [(g, warm[i][1] - warm[i + 1][1]) for i, (g, _) in enumerate(warm[:-1])]
        rho = _pearson(pairs)
        self.rho = rho if rho is not None else 0.0
        if self.rho >= 0:
            self.alpha = c.probe_alpha + (c.alpha_max - c.probe_alpha) * self.rho
        else:
            self.alpha = c.probe_alpha * (1.0 + self.rho)


class CmsaState:
    """What the snapshots hold of CMSA (the snapshot engine's `extra`, as SNAPSHOT_NAME): the
    fitted alpha and the cold start's progress, and the kept GVC estimates, so that a run
    restarted from disk or rolled back clips as the uninterrupted run did. The fuse's threshold
    multipliers are left out: they follow the fuse's levels, which the snapshots do not hold.
    Optional: a snapshot from before it existed restores with CMSA as it is (a restart then
    clips afresh, with a new cold start)."""

    SNAPSHOT_NAME = "cmsa"
    snapshot_optional = True

    def __init__(self, cmsa: Cmsa | None, grad_stats: GradStatistics) -> None:
        self.cmsa, self.grad_stats = cmsa, grad_stats

    def state_dict(self) -> StateDict:
        return {
            "cmsa": self.cmsa.state_dict() if self.cmsa is not None else None,
            "gvc": self.grad_stats.state_dict(),
        }

    def load_state_dict(self, state: StateDict | None) -> None:
        if state is None:  # an older snapshot: nothing of CMSA in it
            return
        fit, gvc = state.get("cmsa"), state.get("gvc")
        if not isinstance(gvc, dict) or not isinstance(fit, dict | None):
            raise ValueError(
                f"the snapshot's CMSA state is malformed: cmsa {type(fit).__name__}, gvc {type(gvc).__name__}"
            )
        if self.cmsa is not None and fit is not None:
            self.cmsa.load_state_dict(cast(CmsaFit, fit))  # the tables its own state_dict() wrote
        self.grad_stats.load_state_dict(cast(GvcState, gvc))


def _pearson(pairs: list[tuple[float, float]]) -> float | None:
    if len(pairs) < 3:
        return None
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))
