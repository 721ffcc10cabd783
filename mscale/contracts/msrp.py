"""MSRP, the modality-sensitive resource profile, in the data it travels as (torch-free).

A device profile is what the job's micro-probes measured on one GPU (on CPU: the host):
    {"bandwidth_bytes_per_s": float, "matmul_flops": float, "dtype": str, "measured_at": float}
and an MPU's profile what it achieves there:
    {"flops_per_step": float, "achieved_flops": float, "memory_bytes": float}
(measured by mscale.hook.core.msrp). This module ranks devices by their profiles for the L1
standby choice, and finds the profiles a guard's plugins hold. Pure functions: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def _num(d: Mapping[str, Any] | None, key: str) -> float:
    v = d.get(key) if d else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def score(profile: Mapping[str, Any] | None, *, compute_weight: float = 0.5) -> float:
    """One number to order devices by: the weighted geometric mean of matmul throughput and
    memory bandwidth, each in its unit (FLOP/s, bytes/s). 0 for a device with no profile."""
    flops, bandwidth = _num(profile, "matmul_flops"), _num(profile, "bandwidth_bytes_per_s")
    if flops <= 0 or bandwidth <= 0:
        return 0.0
    w = min(1.0, max(0.0, compute_weight))
    return math.exp(w * math.log(flops) + (1 - w) * math.log(bandwidth))


def compute_weight(mpu: Mapping[str, Any] | None, device: Mapping[str, Any] | None) -> float:
    """How compute-bound an MPU is on its device (0..1): its achieved FLOP/s over the device's
    matmul throughput. A compute-bound MPU wants the faster matmul; the others the bandwidth."""
    achieved, peak = _num(mpu, "achieved_flops"), _num(device, "matmul_flops")
    if achieved <= 0 or peak <= 0:
        return 0.5
    return min(1.0, achieved / peak)


def rank_standby(
    candidates: Iterable[int], profiles: Mapping[int, Mapping[str, Any]], *, weight: float = 0.5
) -> list[int]:
    """`candidates` (GPU indices, allowed ones only, in the caller's order of preference),
    best measured profile first; devices without a profile keep their order after those with
    one. Ties keep the caller's order."""
    order = list(candidates)
    position = {g: i for i, g in enumerate(order)}
    return sorted(order, key=lambda g: (-score(profiles.get(g), compute_weight=weight), position[g]))


def guard_profiles(guard: Any) -> tuple[dict[int, dict], dict[str, dict]]:
    """(device profiles by GPU index, MPU profiles by id) held by the guard's MSRP plugin(s)."""
    devices: dict[int, dict] = {}
    mpus: dict[str, dict] = {}
    for p in list(getattr(guard, "plugins", ())):
        fn = getattr(p, "msrp_profiles", None)
        if fn is not None:
            d, m = fn()
            devices.update(d)
            mpus.update(m)
    return devices, mpus


def choose_standby(guard: Any, mpu: Any, candidates: list[int]) -> int | None:
    """The L1 standby for `mpu` among `candidates` (already the allowed ones): the best
    measured profile for this MPU's mix of compute and memory; the first candidate when none
    is measured."""
    if not candidates:
        return None
    devices, mpus = guard_profiles(guard)
    weight = compute_weight(mpus.get(getattr(mpu, "mpu_id", "")), devices.get(getattr(mpu, "gpu", -1)))
    return rank_standby(candidates, devices, weight=weight)[0]


def msrp_binding(guard: Any, mpu: Any) -> dict[str, Any]:
    """{"msrp": {"device": ..., "mpu": ...}} for an MPU's entry in a snapshot's
    resource_binding.json, or {} when no MSRP plugin of the guard measured it."""
    devices, mpus = guard_profiles(guard)
    device, own = devices.get(getattr(mpu, "gpu", -1)), mpus.get(getattr(mpu, "mpu_id", ""))
    if device is None and own is None:
        return {}
    return {"msrp": {"device": device, "mpu": own}}
