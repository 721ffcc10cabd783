"""Which layer of an MPU a fault is in, found on the event only (nothing per clean step).

The checks that see a fault at an MPU's output (its non-finite check, its output statistics)
name the MPU; ABFT names a linear only in the steps it checks it. When one of them fires, this
module looks inside, at a cost paid by that event alone:

- **A non-finite output** (`graph_blame`): the forward's autograd graph is still whole in the
  step (in-step verdicts judge it right after the MPU's forward). The tensors its nodes saved
  for backward are the forward's own intermediates: the earliest node that saved a NaN or +Inf
  (-Inf is an attention mask's, or a masked row's log-sum-exp) consumed the first bad value, and the module that made it is, of the modules owning a
  trained parameter (its `AccumulateGrad`) a few nodes below it, the latest in the order the
  first forward called them (an earlier module's bad output would have been saved bad by an
  earlier node). Works for a fault that a re-run does not repeat. Cost: one
  `isfinite` over every saved tensor of the MPU, about one pass over its activations.
- **A shift of the output's scale** (`profile`, `departure`): the MPU's forward is run
  again on the step's inputs with a temporary forward hook on every submodule taking the
  ln(mean square) of its output, and compared with the same profile taken once, by one re-run
  of the MPU's first training forward: the first submodule, in call order, whose output is not
  finite, else the one whose scale moved most (more than half of what the MPU's output moved,
  which must be past `FLOOR`) is named. Cost: one forward of the MPU and a norm per submodule
  output, on the event (and once, for the baseline).
- **A non-finite loss** (`nonfinite_state`): the parameters and the optimizer state are
  scanned for non-finite tensors (an Inf written into an `exp_avg` reaches the loss through
  the weight it updates, outside every MPU's checks); cost: one `isfinite` over each.

The layer found goes on the finding as its `layer` label (a tensor's name as `tensor`); when
none is found the finding keeps naming the MPU. Limits: docs/campaign.md, "Right layer".
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mscale.hook.checks.replay import rng_get, run_again
from mscale.hook.core.outputs import ModelInputs, output_tensors

if TYPE_CHECKING:
    from mscale.hook.core.mpu import Mpu

FLOOR = 0.5  # the least move of a submodule's ln(mean square) named (a ratio of e^0.25 = 1.28 in RMS)
MAX_NODES = 200_000  # autograd nodes walked at most (a bound on the event's cost)
MAX_DEPTH = 8  # nodes walked down from a consumer to the module that owns a parameter
MAX_NAMED = 4  # tensors named at most on one finding
TIES = 0.1  # submodules moved within this share of the largest move are one move (the first named)

Profile = list[tuple[str, float]]  # (submodule's path, ln mean square; nan: not finite), in call order
Unread = tuple[list[str], torch.Tensor]  # a profile's paths and its mean squares, still on the device
Node = torch.autograd.graph.Node


def owners(module: nn.Module, prefix: str) -> dict[int, str]:
    """id(parameter) -> the path (under `prefix`) of the module that holds it."""
    out: dict[int, str] = {}
    for name, m in module.named_modules():
        for p in m.parameters(recurse=False):
            out.setdefault(id(p), ".".join(x for x in (prefix, name) if x))
    return out


def call_order(p: Profile) -> dict[str, int]:
    """Each submodule's place in the order a forward called them (its first call), from a profile."""
    out: dict[str, int] = {}
    for i, (name, _) in enumerate(p):
        out.setdefault(name, i)
    return out


class _Freed(Exception):
    """A node's saved tensors are gone (its backward ran): the graph tells nothing."""


def _saved(node: Node) -> list[torch.Tensor]:
    """The tensors an autograd node saved for backward (its `_saved_*` attributes)."""
    out: list[torch.Tensor] = []
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            v = getattr(node, name)
        except RuntimeError as e:  # freed by the backward that ran: nothing left to read
            raise _Freed(name) from e
        except Exception:  # a value this torch cannot hand out
            continue
        for t in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                out.append(t)
    return out


def _kids(node: Node) -> list[Node]:
    return [c for c, _ in node.next_functions if c is not None]


def _nodes(roots: list[Node]) -> list[Node]:
    order: list[Node] = []
    seen: set[int] = set()
    queue = deque(roots)
    while queue and len(order) < MAX_NODES:
        n = queue.popleft()
        if id(n) in seen:
            continue
        seen.add(id(n))
        order.append(n)
        queue.extend(_kids(n))
    return order


def _bad_below(order: list[Node], bad: set[int]) -> dict[int, bool]:
    """Per node: whether a node below it (towards the inputs) is `bad` (saved a NaN or +Inf)."""
    below: dict[int, bool] = {}
    for root in order:
        stack = [(root, False)]
        while stack:
            n, done = stack.pop()
            if id(n) in below:
                continue
            kids = _kids(n)
            if done:
                below[id(n)] = any(id(c) in bad or below.get(id(c), False) for c in kids)
            else:
                stack.append((n, True))
                stack.extend((c, False) for c in kids if id(c) not in below)
    return below


def _owners(start: Node, params: dict[int, str]) -> list[str]:
    """The modules owning a parameter within `MAX_DEPTH` nodes below `start`."""
    level, seen, found = [start], {id(start)}, []
    for _ in range(MAX_DEPTH):
        found += [params[id(v)] for n in level if (v := getattr(n, "variable", None)) is not None and id(v) in params]
        nxt = []
        for c in (c for n in level for c in _kids(n)):
            if id(c) not in seen:
                seen.add(id(c))
                nxt.append(c)
        level = nxt
    return found


def graph_blame(outs: Sequence[torch.Tensor], params: dict[int, str], order: dict[str, int]) -> str | None:
    """The module whose output first went non-finite in the forward that made `outs`, read off
    its autograd graph (see the module docstring): of the modules holding `params` a few nodes
    below the first node that saved a NaN or +Inf, the latest in call `order` (going up a
    graph towards its inputs reaches modules called earlier, so the latest of those that feed
    the node is the one whose output it consumed); None when it names none."""
    roots = [t.grad_fn for t in outs if t.grad_fn is not None]
    nodes = _nodes(roots)
    if not nodes:
        return None
    try:
        with torch.no_grad():
            saved = [_saved(n) for n in nodes]
    except _Freed:
        return None
    flat = [~(t.isnan().any() | t.isposinf().any()) for ts in saved for t in ts]  # -inf: masks, logsumexp
    ok = torch.stack([f.cpu() for f in flat]).tolist() if flat else []  # one read
    bad, at = set(), 0
    for n, ts in zip(nodes, saved, strict=True):
        if not all(ok[at : at + len(ts)]):
            bad.add(id(n))
        at += len(ts)
    below = _bad_below(nodes, bad)
    first = [n for n in nodes if id(n) in bad and not below.get(id(n), False)]
    if not first and all(bool(t.isfinite().all()) for t in outs):
        return None  # nothing non-finite: nothing to name
    # the producers of the first bad node's inputs; none saved bad: the outputs' own producers
    starts = [c for n in first for c in _kids(n)] if first else roots
    found = {o for s in starts for o in _owners(s, params)}
    return max(found, key=lambda o: order.get(o, -1)) if found else None


def _record(rows: list[tuple[str, torch.Tensor]], name: str, module: nn.Module, args: object, out: object) -> None:
    ts = output_tensors(out)
    if ts:
        t = ts[0].detach()
        rows.append((name, torch.linalg.vector_norm(t, dtype=torch.float32).square() / max(t.numel(), 1)))


def profile(module: nn.Module, prefix: str, run: Callable[[], object]) -> Unread | None:
    """`run()` (a forward of `module`) with a forward hook on every submodule and the module
    itself: each call's output mean square, in call order, left on the device (`read` reads it:
    a profile taken inside a step reads nothing there)."""
    rows: list[tuple[str, torch.Tensor]] = []
    handles = [
        m.register_forward_hook(functools.partial(_record, rows, ".".join(p for p in (prefix, n) if p)))
        for n, m in module.named_modules()
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    if not rows:
        return None
    return [n for n, _ in rows], torch.stack([v.to(rows[0][1].device, torch.float64) for _, v in rows])


def read(p: Unread | None) -> Profile:
    """A profile's ln(mean square) per call (nan: not finite), one host read."""
    if p is None:
        return []
    names, values = p
    return [
        (n, math.log(v) if math.isfinite(v) and v > 0 else (-math.inf if v == 0 else math.nan))
        for n, v in zip(names, values.tolist(), strict=True)
    ]


def _keyed(p: Profile) -> dict[tuple[str, int], float]:
    """Each call as (path, its call number), a module called twice in a forward told apart."""
    seen: dict[str, int] = {}
    out = {}
    for name, x in p:
        seen[name] = seen.get(name, 0) + 1
        out[(name, seen[name])] = x
    return out


def departure(now: Profile, base: Profile, whole: str) -> str | None:
    """The first submodule of `now` whose output is not finite, else the one whose ln(mean square)
    moved most from `base` (the first in call order within `TIES` of it: a container repeats its
    last child's output after it), when that is more than half of what the output of `whole`
    (the MPU) moved; None when the MPU's output did not move past `FLOOR` (the re-run does not
    show the shift). Largest, not first: training moves every submodule's scale a little from
    the baseline (most where no norm follows), a fault most where it enters."""
    bad = next((n for n, x in now if math.isnan(x)), None)
    if bad is not None or not base:
        return bad
    a, b = _keyed(now), _keyed(base)
    moved = {k: abs(x - b[k]) for k, x in a.items() if k in b and math.isfinite(x) and math.isfinite(b[k])}
    out = max((v for (n, _), v in moved.items() if n == whole), default=0.0)
    inner = {k: v for k, v in moved.items() if k[0] != whole}
    top = max(inner.values(), default=0.0)
    if out <= FLOOR or top <= out / 2:
        return None
    return next(n for (n, _), v in inner.items() if v >= top * (1 - TIES))


def nonfinite_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The parameters (`name`) and optimizer state tensors (`name:key`) holding a NaN or Inf,
    at most `MAX_NAMED`, parameters first."""
    names = {id(p): n for n, p in model.named_parameters()}
    found: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        for n, p in model.named_parameters():
            found.append((n, p.detach().isfinite().all()))
        state = optimizer.state if optimizer is not None else {}
        for q, s in state.items():
            for key, v in s.items() if isinstance(s, dict) else ():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
                    found.append((f"{names.get(id(q), '?')}:{key}", v.isfinite().all()))
        if not found:
            return []
        ok = torch.stack([f.to("cpu") for _, f in found]).tolist()
    return [n for (n, _), good in zip(found, ok, strict=True) if not good][:MAX_NAMED]


class Locator:
    """The checksum detector's localization on an event: `saw` each MPU's training forward
    (its inputs kept for the step; at its first forward, the baseline profile, one re-run of
    it, once), `nonfinite` and `shifted` when a check fires. `quiet(on)` sets the detector's
    replaying flag: its hooks and the guard's leave a re-run alone."""

    def __init__(self, quiet: Callable[[bool], None]) -> None:
        self._quiet = quiet
        self._inputs: dict[str, ModelInputs] = {}  # each MPU's last training forward's, by id
        self._raw: dict[str, Unread | None] = {}  # each MPU's profile at its first training forward
        self._base: dict[str, Profile] = {}  # ... read, at the first event that needs it

    def forget(self, mpu: Mpu) -> None:
        """The MPU moved (device, fuse level): its baseline is taken again at its next forward."""
        self._raw.pop(mpu.mpu_id, None)
        self._base.pop(mpu.mpu_id, None)

    def saw(self, mpu: Mpu, inputs: ModelInputs) -> None:
        if not mpu.module.training:
            return
        self._inputs[mpu.mpu_id] = inputs  # a reference: nothing copied
        if mpu.mpu_id not in self._raw:
            self._raw[mpu.mpu_id] = self._profile(mpu)

    def _baseline(self, mpu: Mpu) -> Profile:
        if mpu.mpu_id not in self._base:
            self._base[mpu.mpu_id] = read(self._raw.get(mpu.mpu_id))
        return self._base[mpu.mpu_id]

    def _profile(self, mpu: Mpu) -> Unread | None:
        """The MPU's forward on this step's inputs again (no_grad, the RNG put back), profiled."""
        inputs = self._inputs.get(mpu.mpu_id)
        if inputs is None:
            return None
        dev = mpu.device
        self._quiet(True)
        try:
            return profile(mpu.module, mpu.path, lambda: run_again(mpu.module, dev, rng_get(dev), inputs, {}))
        except Exception:  # a forward that cannot run again out of its loop: nothing named
            return None
        finally:
            self._quiet(False)

    def nonfinite(self, mpu: Mpu, outs: list[torch.Tensor] | None) -> str | None:
        """The module a non-finite output of the MPU came from: off the forward's graph, given
        the `outs` of a forward judged in its step (no re-run: a transient fault would not
        repeat, and the graph has what the forward made); for an output judged at the commit
        point (`outs` None: backward has freed the graph), the first non-finite submodule output
        of a re-run (a fault the re-run repeats)."""
        if outs is None:
            now = read(self._profile(mpu))
            return next((n for n, x in now if math.isnan(x)), None)
        order = call_order(self._baseline(mpu))
        self._quiet(True)  # a checkpointed forward recomputes when its saved tensors are read
        try:
            return graph_blame(outs, owners(mpu.module, mpu.path), order)
        finally:
            self._quiet(False)

    def shifted(self, mpu: Mpu) -> str | None:
        """The first submodule of the MPU that moved from its baseline in a re-run of this step."""
        now = read(self._profile(mpu))
        return departure(now, self._baseline(mpu), mpu.path) if now else None
