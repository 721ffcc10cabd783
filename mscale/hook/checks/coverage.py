"""Which checks run in a step: rotation of the ABFT-checked layers and of the replays, sized by
the budget (mscale.hook.checks.budget), with full coverage for an MPU under suspicion.

Layers. The checked layers of each MPU are taken in a fixed order, round robin from a cursor.
Each step checks at least `floor = ceil(L / max_gap_steps)` of an MPU's L layers, so every
layer is checked at least once every ceil(L / floor) <= max_gap_steps steps, whatever the
budget. Beyond the floors, the checksum's allowance (seconds) buys more layers, one at a time
across the MPUs in turn, at the measured cost per element (input + output + weight elements of
a layer: ABFT reads each once) times 1 + `unseen_cost` (the cache and memory traffic a check
costs the step beyond its timed work). An MPU in incident mode has every layer checked.

Replays. A replay re-runs one MPU's forward, far more than a layer's check, so replays are
paid from a bank: each step adds `replay_share` of the budget, at most what the guard's other
work leaves of it (`spare_s`; layers bought beyond the floors give way), and the next MPU in
rotation is replayed when the bank holds its replay cost (measured; before its first replay,
its forward time). Where the rest takes the whole budget the bank gets nothing:
`replay_max_gap_steps` (400 by default) replays each MPU at least that often whatever the bank.
The tighter of the two is each MPU's `replay_gap_steps`, the bound for a fault only a replay sees.
An MPU in incident mode is replayed every step; one whose forward runs collectives (an FSDP2
`fully_shard` inside it) never: a replay on one rank alone would be a collective the other
ranks do not join (its `replay_gap_steps` is inf; ABFT still checks it).

Incident mode (`suspect`): every layer checked and the forward replayed, every step for
`incident_steps` steps; a new suspicion extends the window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mscale.findings import Finding
    from mscale.hook.core.mpu import Mpu

SMOOTHING = 0.2


@dataclass
class MpuRotation:
    """One MPU's checked layers (by module id, in order) and their check history."""

    layers: list[int]
    max_gap: int
    cursor: int = 0
    sizes: dict[int, int] = field(default_factory=dict)  # elements a check of the layer reads
    seen: dict[int, int] = field(default_factory=dict)  # step each layer was first seen running
    last: dict[int, int] = field(default_factory=dict)  # step each layer was last checked
    interval: dict[int, int] = field(default_factory=dict)  # its last interval between checks
    planned: frozenset[int] = frozenset()
    incident_until: int = -1  # incident mode through this step
    incident_why: str = ""
    last_replay: int = -1
    replay_cost_s: float = 0.0  # smoothed seconds per replay (before the first: the forward's)
    replayed: bool = False  # replay_cost_s was measured on a replay
    replayable: bool = True  # False: its forward runs collectives (FSDP2), never replayed alone

    @property
    def floor(self) -> int:
        return math.ceil(len(self.layers) / self.max_gap) if self.layers else 0

    def in_incident(self, step: int) -> bool:
        return step <= self.incident_until

    def take(self, n: int) -> list[int]:
        """The next `n` layers from the cursor (moving it)."""
        n = min(n, len(self.layers))
        out = [self.layers[(self.cursor + i) % len(self.layers)] for i in range(n)]
        self.cursor = (self.cursor + n) % len(self.layers) if self.layers else 0
        return out

    def see(self, layer: int, step: int) -> None:
        """A layer ran (a linear module that is never called, such as MultiheadAttention's
        out_proj, whose weight the functional form reads, is never in the rotation)."""
        if layer not in self.seen:
            self.seen[layer] = step
            self.layers.append(layer)

    def mark_checked(self, step: int) -> None:
        for layer in self.planned:
            prev = self.last.get(layer)
            if prev is not None and prev != step:
                self.interval[layer] = step - prev
            self.last[layer] = step

    def coverage(self) -> float:
        return len(self.planned) / len(self.layers) if self.layers else 1.0

    def gap(self, step: int) -> int:
        """The largest gap, in steps, between checks of any layer: the last interval between
        two checks, or the steps since the last one when longer (0: no layer)."""
        worst = 0
        for layer in self.layers:
            last = self.last.get(layer)
            since = step - last if last is not None else step - self.seen.get(layer, 0) + 1
            worst = max(worst, self.interval.get(layer, 0), since)
        return worst


class Schedule:
    """The plan of each step for all MPUs (keys are the MPUs' ids)."""

    def __init__(
        self,
        *,
        max_gap_steps: int,
        replay_share: float,
        replay_max_gap_steps: int,
        incident_steps: int,
        unseen_cost: float = 0.0,
    ) -> None:
        self.max_gap = max_gap_steps
        self.unseen_cost = unseen_cost  # a bought layer's price: (1 + unseen_cost) x its timed cost
        self.replay_share = replay_share
        self.replay_max_gap = replay_max_gap_steps
        self.incident_steps = incident_steps
        self.mpus: dict[str, MpuRotation] = {}
        self.s_per_element = 0.0  # smoothed checksum seconds per element checked
        self.bank_s = 0.0
        self.deposit_s: float | None = None  # smoothed seconds paid into the bank a step
        self.replay_cursor = 0
        self.replays: set[str] = set()  # MPUs replayed this step
        self.elements, self.bought_s = 0, 0.0  # this step's: elements planned, the layers bought beyond the floors (s)

    def add(self, mpu_id: str, layers: list[int], *, replayable: bool = True) -> None:
        self.mpus[mpu_id] = MpuRotation(layers, self.max_gap, replayable=replayable)

    def suspect(self, mpu_id: str, step: int, why: str) -> bool:
        """Incident mode for `mpu_id` from `step` on; True when it was not in one already."""
        r = self.mpus.get(mpu_id)
        if r is None:
            return False
        new = not r.in_incident(step - 1)
        r.incident_until = max(r.incident_until, step + self.incident_steps - 1)
        r.incident_why = why
        return new

    def plan(self, step: int, allowance_s: float, budget_s: float, spare_s: float | None = None) -> None:
        """Choose this step's layers and replays. `allowance_s`: the checksum's allowance;
        `budget_s`: the budget in seconds, `replay_share` of which the replay bank is paid, at
        most `spare_s` (what the guard's other work leaves; None: no limit)."""
        chosen: dict[str, list[int]] = {}
        for mid, r in self.mpus.items():
            chosen[mid] = list(r.layers) if r.in_incident(step) else r.take(r.floor)
        cost = floors = self._cost(chosen)
        # more layers while the allowance lasts, one MPU after another
        growing = [mid for mid, r in self.mpus.items() if not r.in_incident(step)]
        while growing and self.s_per_element > 0:
            for mid in list(growing):
                r = self.mpus[mid]
                if len(chosen[mid]) >= len(r.layers):
                    growing.remove(mid)
                    continue
                nxt = r.layers[r.cursor]
                extra = self._size(r, nxt) * self.s_per_element * (1.0 + self.unseen_cost)
                if cost + extra > allowance_s:
                    growing.clear()
                    break
                chosen[mid].extend(r.take(1))
                cost += extra
        self.bought_s = (cost - floors) / (1.0 + self.unseen_cost)  # their timed price
        for mid, r in self.mpus.items():
            r.planned = frozenset(chosen[mid])
        self.elements = sum(self._size(self.mpus[mid], x) for mid, ls in chosen.items() for x in ls)
        self._plan_replays(step, budget_s, spare_s)

    def _plan_replays(self, step: int, budget_s: float, spare_s: float | None) -> None:
        ids = [mid for mid, r in self.mpus.items() if r.replayable]
        self.replays = {mid for mid in ids if self.mpus[mid].in_incident(step)}
        deposit = self.replay_share * budget_s
        deposit = deposit if spare_s is None else max(0.0, min(deposit, spare_s))
        self.deposit_s = deposit if self.deposit_s is None else (1 - SMOOTHING) * self.deposit_s + SMOOTHING * deposit
        self.bank_s = min(self.bank_s + deposit, 4 * self._max_replay_cost() + budget_s)
        if not ids:
            return
        if self.replay_max_gap:  # the ceiling: an MPU not replayed for that long goes now
            for mid in ids:
                r = self.mpus[mid]
                due = r.last_replay + self.replay_max_gap if r.last_replay >= 0 else self._first_due(mid)
                if step >= due:
                    self.replays.add(mid)
        mid = ids[self.replay_cursor % len(ids)]
        r = self.mpus[mid]
        if r.replay_cost_s > 0 and self.bank_s >= r.replay_cost_s:
            self.replays.add(mid)
        for mid in self.replays:
            self.mpus[mid].last_replay = step
            self.bank_s -= self.mpus[mid].replay_cost_s
            if mid == ids[self.replay_cursor % len(ids)]:
                self.replay_cursor += 1
        self.bank_s = max(self.bank_s, -4 * self._max_replay_cost())  # forced replays overdraw it

    def _first_due(self, mid: str) -> int:
        # stagger the MPUs' first forced replays over the ceiling
        ids = [m for m, r in self.mpus.items() if r.replayable]
        return (ids.index(mid) + 1) * self.replay_max_gap // len(ids) - 1

    def _max_replay_cost(self) -> float:
        return max((r.replay_cost_s for r in self.mpus.values()), default=0.0)

    def replayed(self, mpu_id: str, seconds: float) -> None:
        r = self.mpus[mpu_id]
        r.replay_cost_s = seconds if not r.replayed else (1 - SMOOTHING) * r.replay_cost_s + SMOOTHING * seconds
        r.replayed = True

    def forward_took(self, mpu_id: str, seconds: float) -> None:
        """The MPU's forward time: its replay cost until a replay is measured (a replay runs
        that forward again)."""
        r = self.mpus.get(mpu_id)
        if r is not None and not r.replayed and seconds > 0:
            r.replay_cost_s = seconds

    def replay_gap(self) -> float:
        """Steps between two replays of an MPU paid from the bank at its smoothed deposit (each
        MPU's turn comes once the bank has paid for every MPU's replay); inf without a bank."""
        per_step, total = self.deposit_s or 0.0, sum(r.replay_cost_s for r in self.mpus.values() if r.replayable)
        return math.ceil(total / per_step) if per_step > 0 and total > 0 else math.inf

    def replay_rate_s(self) -> float:
        """Seconds of background replays a step over a run: the bank's smoothed deposit, or the
        ceiling's turns (each MPU once in `replay_max_gap_steps`) where they cost more."""
        total = sum(r.replay_cost_s for r in self.mpus.values() if r.replayable)
        return max(self.deposit_s or 0.0, total / self.replay_max_gap if self.replay_max_gap else 0.0)

    def measured(self, seconds: float) -> None:
        """The checksum's seconds in the step that ended, for the elements it planned."""
        if self.elements > 0 and seconds > 0:
            s = seconds / self.elements
            self.s_per_element = s if self.s_per_element == 0 else (1 - SMOOTHING) * self.s_per_element + SMOOTHING * s

    def _size(self, r: MpuRotation, layer: int) -> int:
        if layer in r.sizes:
            return r.sizes[layer]
        known = [v for rot in self.mpus.values() for v in rot.sizes.values()]
        return int(sum(known) / len(known)) if known else 1

    def _cost(self, chosen: dict[str, list[int]]) -> float:
        return self.s_per_element * sum(self._size(self.mpus[m], x) for m, ls in chosen.items() for x in ls)

    def figures(self, step: int) -> dict[str, dict[str, float]]:
        """Per MPU: coverage ratio of the step, the achieved max gap, incident mode (0/1),
        replayed this step (0/1), and the steps between its replays (`replay_gap`, or the
        ceiling `replay_max_gap_steps` when tighter; at least the steps since its last one)."""
        gap = self.replay_gap()
        if self.replay_max_gap:
            gap = min(gap, self.replay_max_gap)
        return {
            mid: {
                "coverage_ratio": r.coverage(),
                "max_gap_steps": float(r.gap(step)),
                "incident": 1.0 if r.in_incident(step) else 0.0,
                "replayed": 1.0 if mid in self.replays else 0.0,
                "replay_gap_steps": (
                    float(max(gap, step - r.last_replay if r.last_replay >= 0 else 0)) if r.replayable else math.inf
                ),
            }
            for mid, r in self.mpus.items()
        }


# Findings that put MPUs under suspicion: a failed check is the checksum's own (it opens the
# incident itself); these come from the other detectors.
_ANOMALIES = frozenset(
    {
        "loss_nonfinite",
        "loss_spike_action",
        "loss_jump",
        "grad_norm_spike",
        "grad_norm_nonfinite",
        "grad_norm_jump",
        "replica_diverged",
        "weight_corruption",
    }
)


def suspicions(event: Finding | dict[str, object], mpus: Sequence[Mpu]) -> list[tuple[str, str]]:
    """The (mpu_id, why) an event puts under suspicion. `event`: a Finding (a loss or gradient
    anomaly: its MPU, or every MPU when it names none; a replica mismatch: its MPU; a GPU
    finding: the MPUs on that GPU) or an agent's heal command carrying a GPU reason (Xid, ECC,
    throttling, health: "gpu_*"), which targets its MPU or the MPUs on its GPU."""
    if isinstance(event, dict):
        reason = str(event.get("reason", ""))
        if event.get("type") != "heal" or event.get("end") or not reason.startswith("gpu_"):
            return []
        if reason == "gpu_recovered":
            return []
        mpu_id, gpu = str(event.get("mpu_id") or ""), event.get("gpu")
    else:
        reason = event.reason.value
        if reason.startswith("gpu_") and reason != "gpu_recovered":
            mpu_id, gpu = "", event.labels.get("gpu")
        elif reason in _ANOMALIES:
            mpu_id, gpu = event.labels.get("mpu_id", ""), None
        else:
            return []
    if mpu_id:
        return [(m.mpu_id, reason) for m in mpus if mpu_id in (m.mpu_id, m.name)]
    if gpu not in (None, ""):
        return [(m.mpu_id, reason) for m in mpus if str(m.gpu) == str(gpu)]
    return [(m.mpu_id, reason) for m in mpus]
