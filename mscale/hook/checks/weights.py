"""Weight fingerprints: a weight changed outside the optimizer is found before it is used.

A fingerprint of a tensor is the sum, wrapping modulo 2^64, of its bytes read as
little-endian 64-bit words (the last word padded with zeros): exact and order-free, and any
single changed element changes it (it moves one or two words by a nonzero amount below 2^64
in total), where a float sum would round a low-bit change away. Words, not elements: a plain
vectorised add, 6.6x faster on CPU than float32 bit patterns summed as int32 into int64.
Small tensors (biases, norms) are fingerprinted together in one fused pass per device (their
word views concatenated, one cumulative sum, read at each tensor's end), larger ones, and those
whose bytes are not whole aligned words, one by one; all of a device's sums are read back at once.

`WeightWatch` keeps the fingerprints of a guard's model: the trained weights are split into
`groups` groups of about equal bytes; each time the weights settle (after the optimizer, a
rollback) the next group is fingerprinted and checked before the next forward: one pass over
1/groups of them a window instead of two over all (docs/hook.md). Frozen ones are fingerprinted
once, checked every `frozen_every` steps. A mismatch is a WEIGHT_CORRUPTION finding per tensor
with its MPU, in the step that would first use it. A write in an unchecked group's window goes
unseen by the fingerprints (under DDP the replicas compare within their bound:
mscale.hook.checks.replicas; a write that makes its MPU's output non-finite is found then:
actions/restore_weights.py); one that makes a tensor's largest magnitude grow beyond any
optimizer step (an exponent bit) is found when its group is next recorded, at most `groups`
settles later: each record also takes the group's largest magnitudes (`implausible`). A new shape, dtype
or device (an L2 fallback, a swap on a GPU) starts the fingerprints over: a move, not a
corruption. The repair is the fuse's (actions/restore_weights.py, whose per-job state this is).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from mscale.findings import Finding, Reason, Severity
from mscale.snapshot.trust import PLAUSIBLE

if TYPE_CHECKING:
    from mscale.hook.core.mpu import Mpu

# what a group of tensors is laid out as: (shape, dtype, device) each
Layout = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]

SOURCE = "weights"
# 64-bit words of one fused pass (its int64 copy: 8 MiB)
BATCH_MAX = 1 << 20
# tensors of more words than this are summed on their own: the fused pass copies and runs a
# cumulative sum (sequential, several times slower than a sum), worth it only where the cost
# of a call per tensor (about 8 us) dominates: biases and norms, not matrices (at 1 << 15 the
# 256x256 projections of an 8M LLaVA went fused and its pass took 11 ms against 1.9 ms)
OWN_MIN = 1 << 10


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's bytes as an int64 view (it follows in-place updates), or None when they
    are not whole aligned words (a copy is then taken at each pass: word_sum)."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 8 or t.data_ptr() % 8:
        return None
    return t.detach().reshape(-1).view(torch.uint8).view(torch.int64)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) parameter's local shard: each rank fingerprints what it holds."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def word_sum(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of one tensor, as a 1-element int64 tensor on its device."""
    words = _words(t)
    if words is None:  # a copy, padded to whole words (its own storage: aligned)
        raw = t.detach().reshape(-1).view(torch.uint8)
        words = torch.cat((raw, raw.new_zeros(-raw.numel() % 8))).view(torch.int64)
    return words.sum().reshape(1)


class Fingerprint:
    """Fingerprints of a fixed list of tensors; `compute()` returns them as one int64 CPU
    tensor in the list's order (one device read-back per device)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self._ptrs: tuple[int, ...] = ()
        self._plan: list[tuple[list[int], list[torch.Tensor], torch.Tensor | None]] = []

    def layout(self) -> Layout:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in self.tensors)

    def _build(self) -> None:
        groups: dict[torch.device, list[list[int]]] = {}  # device -> chunks of indices
        filled: dict[torch.device, int] = {}  # words in each group's last chunk
        plan: list[tuple[list[int], list[torch.Tensor], torch.Tensor | None]] = []
        for i, t in enumerate(self.tensors):
            words = _words(t)
            if words is None or not 0 < words.numel() <= min(OWN_MIN, BATCH_MAX):
                # on its own, viewed afresh at each pass (a non-contiguous tensor's flat
                # reshape is a copy: kept, it would go stale)
                plan.append(([i], [t], None))
            else:
                key = t.device
                chunks = groups.setdefault(key, [[]])
                if filled.get(key, 0) + words.numel() > BATCH_MAX:
                    chunks.append([])
                    filled[key] = 0
                chunks[-1].append(i)
                filled[key] = filled.get(key, 0) + words.numel()
        for idx in (chunk for chunks in groups.values() for chunk in chunks if chunk):
            views = [w for i in idx if (w := _words(self.tensors[i])) is not None]  # follow in-place updates
            ends = torch.tensor([v.numel() for v in views], device=views[0].device).cumsum(0) - 1
            plan.append((idx, views, ends))
        self._plan = plan

    def compute(self) -> torch.Tensor:
        ptrs = tuple(t.data_ptr() for t in self.tensors)
        if ptrs != self._ptrs:  # new storage (a restore by assignment, a move): new views
            self._build()
            self._ptrs = ptrs
        out = torch.zeros(len(self.tensors), dtype=torch.int64)
        parts: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}  # device -> (indices, sums)
        with torch.no_grad():
            for idx, views, ends in self._plan:
                if ends is None:
                    sums = word_sum(views[0])
                elif not views:
                    continue
                else:
                    c = torch.cat(views).cumsum(0)[ends]
                    sums = torch.diff(c, prepend=c.new_zeros(1))
                where, got = parts.setdefault(sums.device, ([], []))
                where += idx
                got.append(sums)
            for where, got in parts.values():  # one read-back per device
                out[where] = torch.cat(got).cpu()
        return out


def charge(guard: object, who: str, since: float) -> None:
    """Charge the host time since `since` to the guard's budget, where the guard keeps one
    (`guard.budget.charge`, mscale.hook.checks.budget): the fuse's per-step work is in the budget."""
    budget = getattr(guard, "budget", None)
    if budget is not None and callable(getattr(budget, "charge", None)):
        budget.charge(who, time.perf_counter() - since)


def split_by_bytes(tensors: Sequence[torch.Tensor], groups: int) -> list[list[int]]:
    """Indices of `tensors` in `groups` groups of about equal bytes (largest first into the
    lightest group), each group in the tensors' order; fewer groups when there are fewer tensors."""
    groups = max(1, min(groups, len(tensors)))
    load = [0] * groups
    out: list[list[int]] = [[] for _ in range(groups)]
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].numel() * tensors[i].element_size()):
        g = load.index(min(load))
        out[g].append(i)
        load[g] += tensors[i].numel() * tensors[i].element_size()
    return [sorted(g) for g in out]


class Watched(Protocol):
    """What WeightWatch reads of the guard it watches (mscale.hook.core.guard.Guard): its model,
    its MPUs (the owners named in findings) and, without an `emit` of its own, where findings go."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def mpus(self) -> Sequence[Mpu]: ...

    def emit(self, finding: Finding) -> None: ...


class WeightWatch:
    """The fingerprints of a guard's model and their checks (see the module docstring).
    `emit` receives the findings; `check(step)` returns the corrupted tensors' names.
    groups: the trained weights are split into this many groups of about equal bytes, and each
    settle records the next group in turn (the check after it compares that group): one pass
    over 1/groups of them per window between steps instead of two over all of them."""

    def __init__(
        self,
        guard: Watched,
        *,
        frozen_every: int = 1,
        groups: int = 1,
        emit: Callable[[Finding], None] | None = None,
    ) -> None:
        if frozen_every < 1:
            raise ValueError(f"frozen_every: expected >= 1, got {frozen_every}")
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups: expected an int >= 1, got {groups!r}")
        self.guard = guard
        self.frozen_every = frozen_every
        self.groups = groups
        self._emit = emit or guard.emit
        self.corrupted: list[tuple[str, str]] = []  # (mpu_id or "", tensor name) found this step
        self.checks = 0
        self.turn = 0  # the trained group the next settle records
        self.due: str | None = None  # the trained group the next check compares
        self._build()

    def _build(self) -> None:
        g = self.guard
        owner: dict[int, Mpu] = {}
        for m in g.mpus:
            for p in m.module.parameters():  # frozen ones too (Mpu.parameters() is the trained)
                owner.setdefault(id(p), m)
        trained: list[tuple[str, torch.Tensor]] = []
        frozen: list[tuple[str, torch.Tensor]] = []
        for name, p in g.model.named_parameters():
            # requiring a gradient: trained (re-fingerprinted at each step end, whatever updated
            # it before then); not requiring one: frozen
            (trained if p.requires_grad else frozen).append((name, _local(p)))
        self.owner = {name: owner.get(id(p)) for name, p in g.model.named_parameters()}
        split = split_by_bytes([p for _, p in trained], self.groups) if trained else [[]]
        self.trained_keys = [f"trained:{i}" for i in range(len(split))]
        self.names = {key: [trained[i][0] for i in idx] for key, idx in zip(self.trained_keys, split, strict=True)}
        self.names["frozen"] = [n for n, _ in frozen]
        self.prints = {
            key: Fingerprint([trained[i][1] for i in idx]) for key, idx in zip(self.trained_keys, split, strict=True)
        }
        self.prints["frozen"] = Fingerprint([p for _, p in frozen])
        self.ref: dict[str, tuple[Layout, torch.Tensor]] = {}
        self.peaks: dict[str, tuple[Layout, torch.Tensor]] = {}  # each trained group's largest magnitudes
        self.implausible: list[str] = []  # trained tensors whose largest magnitude jumped (see `_peaks`)
        self.tensors = {n: _local(p) for n, p in g.model.named_parameters()}  # by name: the event check's
        self.settle(frozen=True)

    def settle(self, *, frozen: bool = False) -> None:
        """The weights are what they should be (after an optimizer step, a restore): record the
        next trained group's fingerprints (and the frozen ones' when `frozen`, or when new)."""
        t0 = time.perf_counter()
        key = self.trained_keys[self.turn % len(self.trained_keys)]
        self.turn = (self.turn + 1) % len(self.trained_keys)
        self.ref[key] = (self.prints[key].layout(), self.prints[key].compute())
        self.due = key
        self._peaks(key)
        if frozen or "frozen" not in self.ref:
            self.ref["frozen"] = (self.prints["frozen"].layout(), self.prints["frozen"].compute())
        charge(self.guard, SOURCE, t0)

    def _peaks(self, key: str) -> None:
        """The group's largest magnitudes against its record of a rotation before: a tensor whose
        largest magnitude went non-finite or grew past PLAUSIBLE times the larger of 1 and its
        last one is no optimizer's work (mscale.snapshot.trust), though its fingerprint, taken
        now, holds it: a write in another group's window. Its name joins `implausible` (the
        fuse checks its MPU's weights against the snapshots: actions/restore_weights.py)."""
        fp = self.prints[key]
        if not fp.tensors:
            return
        now = torch.zeros(len(fp.tensors))
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(fp.tensors):
            if t.numel():  # an FSDP2 shard may be empty
                by_device.setdefault(t.device, []).append(i)
        with torch.no_grad():  # aminmax: one pass, no copy (a third of the fingerprint's time)
            for idx in by_device.values():
                ends = torch.stack([torch.stack(torch.aminmax(fp.tensors[i].detach())).float() for i in idx])
                now[idx] = ends.cpu().abs().amax(dim=1)
        layout, was = fp.layout(), self.peaks.get(key)
        self.peaks[key] = (layout, now)
        if was is None or was[0] != layout:
            return
        bad = ~torch.isfinite(now) | (now > PLAUSIBLE * was[1].clamp(min=1.0))
        self.implausible += [self.names[key][i] for i in bad.nonzero().flatten().tolist()]

    def _current(self) -> list[str]:
        """The groups whose records are of the weights as they are now: the trained group
        recorded at the last settle, and the frozen weights."""
        return [k for k in (self.due, "frozen") if k is not None]

    def check(self, step: int) -> list[tuple[str, str]]:
        """Compare the weights with their fingerprints (the trained group due, and the frozen
        weights every `frozen_every` steps); one finding per changed tensor, emitted once all
        are known (a repair run on the first finding sees them all). Returns [(mpu_id, tensor)]."""
        found: list[tuple[str, str]] = []
        self.checks += 1
        t0 = time.perf_counter()
        for key in self._current():
            fp = self.prints[key]
            if key == "frozen" and (not fp.tensors or step % self.frozen_every):
                continue
            layout, ref = self.ref[key]
            if fp.layout() != layout:  # moved or re-typed: a new placement, fingerprinted anew
                self.ref[key] = (fp.layout(), fp.compute())
                continue
            now = fp.compute()
            if not torch.equal(now, ref):
                found += [(key, self.names[key][i]) for i in (now != ref).nonzero().flatten().tolist()]
        charge(self.guard, SOURCE, t0)
        self.corrupted = [self._where(name) for _, name in found]
        for key, name in found:
            self._report(key.partition(":")[0], name, step)
        if any(key == "frozen" for key, _ in found) and not self.matches("frozen"):
            # not repaired: the frozen weights as they are now are the baseline (reported once)
            self.ref["frozen"] = (self.prints["frozen"].layout(), self.prints["frozen"].compute())
        return self.corrupted

    def matches(self, *kinds: str) -> bool:
        """Whether the weights (of `kinds`: "trained", "frozen"; default both) match their
        recorded fingerprints (the trained: the group recorded at the last settle)."""
        for key in self._current():
            if kinds and key.partition(":")[0] not in kinds:
                continue
            layout, ref = self.ref[key]
            fp = self.prints[key]
            if fp.layout() != layout or not torch.equal(fp.compute(), ref):
                return False
        return True

    def _where(self, name: str) -> tuple[str, str]:
        m = self.owner.get(name)
        return (m.mpu_id if m is not None else "", name)

    def report(self, names: list[str], step: int, *, why: str) -> None:
        """Trained weights found changed by another check (restore_weights' on an MPU's failure)."""
        self.corrupted = [self._where(name) for name in names]
        for name in names:
            self._report("trained", name, step, found=why)

    def _report(self, kind: str, name: str, step: int, found: str = "") -> None:
        m = self.owner.get(name)
        labels = {"tensor": name, "weights": kind, "step": str(step)}
        if m is not None:
            labels.update(mpu_id=m.mpu_id, mpu=m.name, gpu=str(m.gpu))
            if m.gpu_uuid:
                labels["gpu_uuid"] = m.gpu_uuid
        where = f"{m.name} ({m.mpu_id})" if m is not None else "outside every MPU"
        self._emit(
            Finding(
                SOURCE,
                Reason.WEIGHT_CORRUPTION,
                Severity.CRITICAL,
                f"{kind} weight {name} of {where} changed outside the optimizer"
                + (f" (found when {found})" if found else " since the last step"),
                labels,
            )
        )
