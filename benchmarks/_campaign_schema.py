"""Fault campaigns in lm-resiliency 0.2.0's incident schema (its docs/fault_injection.md):

    {"schema_version": 1, "name": ..., "seed": ..., "clock": {"type": "training_iteration"},
     "incidents": [{"incident_id": ..., "trigger": {"at": [12]} | {"range": {"start", "end"}},
                    "lifetime": {"iterations": N} | {"until": "campaign_end"},
                    "retrigger": "once" | "every_attempt",
                    "faults": [{"fault_id": ..., "type": "tensor_corruption",
                                "target": {"surface": ..., "module_path": ..., "operation": ...,
                                           "rank": ..., "metadata": {"model": ..., "mpu": ...}},
                                "parameters": {"operation": ..., "magnitude": ..., "scope": ...,
                                               "value" | "factor" | "std", "parameter",
                                               "state_key"}}]}]}

The keys and values are the kit's; what this module reads of them is a strict subset (one
fault per incident, tensor corruption only), and anything outside it is refused by name. Two
surfaces the kit has no local executor for are spelled with its own target fields: the input
batch is surface "data" (target.path: the batch key), the loss is surface "output" with
target.operation "loss". A GEMM computing wrongly is surface "compute" on a linear.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SURFACES = ("compute", "input", "output", "weight", "gradient", "optimizer_state", "data")
OPS = ("single_bitflip", "multi_bitflip", "set_value", "scale", "noise", "sign_flip")
MAGNITUDES = ("catastrophic", "large", "medium", "subtle", "near_invisible")
SCOPES = ("single", "row", "1%", "10%", "100%")
# the kit's magnitude tables (fault_injection.md): a scale's factor, a noise's standard
# deviation, the lowest bit a flip touches in a float32 (23..30 are the exponent)
SCALE = {"catastrophic": 1e6, "large": 100.0, "medium": 10.0, "subtle": 2.0, "near_invisible": 1.0001}
NOISE = {"catastrophic": 1e6, "large": 1e2, "medium": 1.0, "subtle": 1e-3, "near_invisible": 1e-7}
FLIP_BIT = {"catastrophic": 30, "large": 24, "medium": 16, "subtle": 8, "near_invisible": 0}
_CAMPAIGN = {"schema_version", "name", "seed", "clock", "incidents", "metadata"}
_INCIDENT = {"incident_id", "id", "trigger", "lifetime", "faults", "retrigger", "max_occurrences"}
_FAULT = {"fault_id", "id", "type", "target", "parameters"}
_TARGET = {"surface", "rank", "model_part", "component", "index", "module_path", "operation", "path", "metadata"}
_PARAMS = {"operation", "magnitude", "scope", "value", "factor", "std", "parameter", "state_key", "bits"}


class CampaignError(ValueError):
    """A campaign file this runner cannot read, naming the incident and the field."""


@dataclass(frozen=True)
class Fault:
    """One incident of a campaign, as the runner injects it."""

    fault_id: str
    surface: str  # SURFACES, or "loss" (surface output, operation loss)
    op: str
    magnitude: str  # MAGNITUDES, or "nan"/"inf" for set_value
    scope: str
    start: int  # the first training iteration it is active in
    iterations: int | None  # None: until the campaign ends
    follows: bool  # retrigger every_attempt: fires again in a step re-run after a rollback
    model: str
    module_path: str = ""
    parameter: str = ""
    state_key: str = ""
    batch_key: str = "pixel_values"
    rank: int = 0
    value: float | None = None
    factor: float | None = None
    std: float | None = None
    bits: int = 1
    labels: dict[str, str] = field(default_factory=dict)  # target.metadata, for the tables

    @property
    def timing(self) -> str:
        if self.follows:
            return "follows"
        if self.iterations is None:
            return "persistent"
        return "transient" if self.iterations == 1 else "bounded"

    def active(self, step: int) -> bool:
        return step >= self.start and (self.iterations is None or step < self.start + self.iterations)


def _unknown(where: str, got: dict, allowed: set[str]) -> None:
    extra = set(got) - allowed
    if extra:
        raise CampaignError(f"{where}: unknown keys {sorted(extra)} (allowed: {sorted(allowed)})")


def _choice(where: str, name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise CampaignError(f"{where}: {name} {value!r} is not one of {list(allowed)}")
    return str(value)


def _timing(where: str, inc: dict) -> tuple[int, int | None]:
    trig, life = inc.get("trigger") or {}, inc.get("lifetime") or {}
    if "at" in trig:
        if len(trig["at"]) != 1:
            raise CampaignError(f"{where}: trigger.at must name one iteration (got {trig['at']})")
        start = trig["at"][0]
    elif "range" in trig:
        start = trig["range"]["start"]
    else:
        raise CampaignError(f"{where}: trigger needs 'at' or 'range'")
    if not isinstance(start, int) or isinstance(start, bool) or start <= 0:
        raise CampaignError(f"{where}: the trigger iteration must be a positive integer, got {start!r}")
    if "iterations" in life:
        return start, int(life["iterations"])
    if life.get("until") in ("campaign_end", "replacement"):
        return start, None
    raise CampaignError(f"{where}: lifetime must be {{'iterations': N}} or {{'until': 'campaign_end'}}, got {life}")


def _fault(where: str, inc: dict) -> Fault:
    _unknown(where, inc, _INCIDENT)
    faults = inc.get("faults") or []
    if len(faults) != 1:
        raise CampaignError(f"{where}: exactly one fault per incident is supported, got {len(faults)}")
    f = faults[0]
    _unknown(where, f, _FAULT)
    if f.get("type") != "tensor_corruption":
        raise CampaignError(f"{where}: fault type {f.get('type')!r} is not supported (tensor_corruption only)")
    tgt, p = f.get("target") or {}, f.get("parameters") or {}
    _unknown(f"{where}.target", tgt, _TARGET)
    _unknown(f"{where}.parameters", p, _PARAMS)
    surface = _choice(where, "target.surface", tgt.get("surface"), SURFACES)
    if surface == "output" and tgt.get("operation") == "loss":
        surface = "loss"
    op = _choice(where, "parameters.operation", p.get("operation"), OPS)
    value = None
    if op == "set_value":
        value = float(p["value"]) if "value" in p else math.nan
        magnitude = "nan" if math.isnan(value) else "inf"
    else:
        magnitude = _choice(where, "parameters.magnitude", p.get("magnitude", "medium"), MAGNITUDES)
    meta = dict(tgt.get("metadata") or {})
    if "model" not in meta:
        raise CampaignError(f"{where}: target.metadata.model (llava or qwen2vl) is required")
    start, iterations = _timing(where, inc)
    return Fault(
        fault_id=str(f.get("fault_id") or inc.get("incident_id")),
        surface=surface,
        op=op,
        magnitude=magnitude,
        scope=_choice(where, "parameters.scope", p.get("scope", "single"), SCOPES),
        start=start,
        iterations=iterations,
        follows=inc.get("retrigger", "once") == "every_attempt",
        model=str(meta["model"]),
        module_path=str(tgt.get("module_path") or ""),
        parameter=str(p.get("parameter") or ""),
        state_key=str(p.get("state_key") or ""),
        batch_key=str(tgt.get("path") or "pixel_values"),
        rank=int(tgt.get("rank") or 0),
        value=value,
        factor=p.get("factor"),
        std=p.get("std"),
        bits=int(p.get("bits", 2 if op == "multi_bitflip" else 1)),
        labels={k: str(v) for k, v in meta.items()},
    )


def load(path: str | Path) -> tuple[dict, list[Fault]]:
    """The campaign's header (name, seed, metadata) and its faults; CampaignError names what is wrong."""
    raw = json.loads(Path(path).read_text())
    _unknown(str(path), raw, _CAMPAIGN)
    if raw.get("schema_version") != 1:
        raise CampaignError(f"{path}: schema_version {raw.get('schema_version')!r} (this runner reads 1)")
    if (raw.get("clock") or {}).get("type", "training_iteration") != "training_iteration":
        raise CampaignError(f"{path}: clock.type must be training_iteration")
    faults = [_fault(f"{path}: incident {i}", inc) for i, inc in enumerate(raw.get("incidents") or [])]
    ids = [f.fault_id for f in faults]
    if len(set(ids)) != len(ids):
        raise CampaignError(f"{path}: duplicate fault ids")
    head = {k: raw.get(k) for k in ("name", "seed", "metadata")}
    return head, faults
