"""The demo's HEALED verdict for one scripted fault: honest, not "an action ran".

A fault is healed when (1) every action its level calls for was applied (booked "applied" by
the fuse or the agent; `mark_suspect`, a dropped step or a failed action do not count), and
(2) the job shows the fault's effect ended:

- output corruption on a GPU (L1): the MPUs that were on it were swapped off it, and their
  checksums on the new placement are clean for the rest of the fault's window;
- corruption that follows an MPU (L1, L2, L3): the swap, the degradation and the distillation
  were applied, and the MPU's checksums are clean again at the end of the window;
- a loss spike (LR cooling): the loss is back in its band (the median of the window's last
  steps within 1.5x the median before the spike) with no further spike finding;
- a NaN loss (rollback): the job rolled back, every later loss is finite, no NaN reached the
  weights, and the loss is back in its band;
- an Xid (emergency snapshot, quarantine, L1): the snapshot was written, the GPU quarantined,
  and every MPU that was on it left it, with clean checksums on the new placement.

`judge` returns (healed, healed_by, evidence): the applied actions that count and what shows
the effect ended, or what is missing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from mscale.healing.words import Result

CLEAN_CHECKS = 3  # clean checks of an MPU that show its output is good again
BAND = 1.5  # the loss is back when within this factor of its median before the fault
_BAD_CHECK = ("checksum_failure", "nonfinite_output")
_LOSS_FINDINGS = ("loss_jump", "loss_spike_action", "loss_nonfinite")


def needed(chaos: dict) -> tuple[str, ...]:
    """The actions the fault's level calls for (the healing policy's answer to it)."""
    kind = chaos["kind"]
    if kind == "corrupt":
        return ("l1_swap",) if "gpu" in chaos else ("l1_swap", "l2_degrade", "l3_distill")
    return {
        "loss_spike": ("lr_cool",),
        "nan_loss": ("rollback",),
        "xid": ("emergency_snapshot", "quarantine_gpu", "l1_swap"),
        "ecc": ("emergency_snapshot", "quarantine_gpu", "l1_swap"),
    }.get(kind, ())


def _step(f: Any) -> int:
    try:
        return int(f.labels.get("step", -1))
    except ValueError:
        return -1


def judge(
    chaos: dict,
    start: int,
    end: int | None,
    findings: Sequence[Any],
    checks: Sequence[tuple[int, dict[str, tuple[int, bool]]]],
    losses: Sequence[tuple[int, float]],
    *,
    mpus_at_start: dict[str, tuple[str, int]],
    nan_in_weights: bool = False,
) -> tuple[bool, list[str], str]:
    """Verdict for a fault injected at step `start`, whose window ends at `end` (the next
    fault's injection, None: the end of the run). `checks`: per step run, MPU id -> (GPU,
    checksum ok); `mpus_at_start`: MPU id -> (name, GPU) when it was injected."""

    def inside(s: int) -> bool:
        return s >= start and (end is None or s < end)

    window = [f for f in findings if inside(_step(f))]
    applied = [f for f in window if f.reason.value == "heal_action" and f.labels.get("result") == Result.APPLIED]
    by_action: dict[str, list[Any]] = {}
    for f in applied:
        by_action.setdefault(f.labels.get("action", ""), []).append(f)
    need = needed(chaos)
    missing = [a for a in need if a not in by_action]
    healed_by = [
        f"{a}"
        + (f"({f.labels['mpu_id']})" if f.labels.get("mpu_id") else "")
        + (f" -> gpu {f.labels['to_gpu']}" if f.labels.get("to_gpu") else "")
        for a in need
        for f in by_action.get(a, [])[:1]
    ]
    if not need:
        return False, [], f"no healing is defined for a {chaos['kind']} fault"
    if missing:
        return False, healed_by, f"not applied: {', '.join(missing)}"
    if chaos["kind"] in ("corrupt", "xid", "ecc"):
        rows = [(s, c) for s, c in checks if inside(s)]
        healed, evidence = _placement_clean(chaos, start, rows, mpus_at_start)
    else:
        healed, evidence = _loss_back(
            chaos, start, inside, window, losses, by_action.get("rollback", []), nan_in_weights
        )
    return healed, healed_by, evidence


def _placement_clean(
    chaos: dict,
    start: int,
    rows: list[tuple[int, dict[str, tuple[int, bool]]]],
    mpus_at_start: dict[str, tuple[str, int]],
) -> tuple[bool, str]:
    """A corruption or an Xid: every MPU that was on the faulty GPU (or the corrupted MPU) left
    it and its last checks of the window are clean."""
    if "gpu" in chaos:
        targets = [m for m, (_, g) in mpus_at_start.items() if g == int(chaos["gpu"])]
    else:
        targets = [m for m, (name, _) in mpus_at_start.items() if chaos.get("mpu") in (m, name)]
    if not targets:
        return False, "no MPU was on the faulty placement"
    for m in targets:
        home = mpus_at_start[m][1]
        moved = [s for s, c in rows if m in c and c[m][0] != home] if "gpu" in chaos else [s for s, _ in rows]
        if not moved:
            return False, f"MPU {m} never left GPU {home}"
        after = [c[m] for s, c in rows if m in c and s >= (moved[0] if moved else start)]
        last = after[-CLEAN_CHECKS:]
        if len(last) < CLEAN_CHECKS or not all(ok for _, ok in last):
            return False, f"MPU {m}: its last checks are not clean"
        if "gpu" in chaos and any(g == int(chaos["gpu"]) for g, _ in after[-CLEAN_CHECKS:]):
            return False, f"MPU {m} is back on GPU {chaos['gpu']}"
    where = "on the new placement" if "gpu" in chaos else "at the end of the window"
    return True, f"{CLEAN_CHECKS}+ clean checks {where}"


def _loss_back(
    chaos: dict,
    start: int,
    inside: Callable[[int], bool],
    window: list[Any],
    losses: Sequence[tuple[int, float]],
    rollbacks: list[Any],
    nan_in_weights: bool,
) -> tuple[bool, str]:
    """A loss spike or a NaN loss: no further spike, the loss back in its band (and for a NaN:
    none in the weights, every loss after the rollback finite)."""
    before = [v for s, v in losses if start - 10 <= s < start and math.isfinite(v)]
    later = [v for s, v in losses if inside(s) and s > start]
    if chaos["kind"] == "nan_loss":
        if nan_in_weights:
            return False, "a NaN reached the weights"
        rolled = rollbacks[0]
        later = [v for s, v in losses if inside(s) and _step(rolled) < s]
        if not all(math.isfinite(v) for v in later[1:]):
            return False, "a later loss is not finite"
    spikes = [f for f in window if f.reason.value in _LOSS_FINDINGS and _step(f) > start + 1]
    if spikes:
        return False, f"the loss spiked again at step {_step(spikes[0])}"
    tail = [v for v in later if math.isfinite(v)][-5:]
    if not before or len(tail) < 3:
        return False, "too few steps to tell whether the loss is back in its band"
    ratio = statistics.median(tail) / statistics.median(before)
    if ratio > BAND:
        return False, f"the loss is {ratio:.2f}x its level before the fault"
    return True, f"loss back in its band ({ratio:.2f}x its level before)"
