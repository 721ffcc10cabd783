"""Ground truth and the table of a fault campaign, from its runs (benchmarks/_campaign_run.py).

Per fault: the run left alone tells whether it mattered (final held-out loss more than 2%
worse than the fault-free run's, NaN, or diverged weights: non-finite, or their largest
magnitude 10x the fault-free run's); the guarded run tells whether it was detected (a
warning or critical finding at or after the fault's first step that the guarded clean run
did not raise at that step; heal actions, rollbacks and snapshots are consequences, not
detections), after how many steps, blamed on the right MPU (an `mpu_id` label of the
fault's MPU) and layer (a `tensor` or `layer` label naming the fault's layer or a module or
tensor inside it: `blamed`), healed (final loss
within 2% of the fault-free run), escaped (it mattered and was not healed and did not stop
cleanly), a loop (the optimizer-call cap reached before the target step), a crash (an
exception not raised by mscale).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from typing import Any

from benchmarks._campaign_schema import Fault

TOLERANCE = 0.02
CONSEQUENCES = {"rollback", "heal_action", "fuse_state", "snapshot_written", "snapshot_failed", "snapshot_resumed"}
ALARMS = ("warning", "critical")
LAYER = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)(\.|$)")


def _bad(r: dict, clean: dict) -> bool:
    loss, ref = r.get("held_out"), clean["held_out"]
    if loss is None or not math.isfinite(loss) or not r["finite"]:
        return True
    return loss > ref * (1 + TOLERANCE) or r["max_abs"] > 10 * clean["max_abs"]


def fault_mpu(f: Fault, mpus: dict) -> str | None:
    """The id of the MPU holding the fault's module (the longest path that prefixes it)."""
    if not f.module_path:
        return None
    best, length = None, -1
    for mid, m in mpus.items():
        p = m["path"].removeprefix("module.")  # under DDP the guard sees the wrapper's paths
        if (p == "" or f.module_path == p or f.module_path.startswith(p + ".")) and len(p) > length:
            best, length = mid, len(p)
    return best


def fault_layer(f: Fault) -> str:
    m = LAYER.match(f.module_path)
    return m.group(1) if m else f.module_path


def blamed(labels: dict, layer: str) -> bool:
    """Whether a finding's labels name `layer` or a tensor or module inside it (the DDP
    wrapper's `module.` prefix aside; replicas' findings name several tensors)."""
    named = [*labels.get("tensor", "").split(","), labels.get("layer", "")]
    return any((n := x.removeprefix("module.")) == layer or n.startswith(layer + ".") for x in named if x)


def _detections(f: Fault, guarded: dict, clean_guarded: dict) -> list[dict]:
    seen = {(x["reason"], x["step"]) for x in clean_guarded["findings"]}
    return [
        x
        for x in guarded["findings"]
        if x["severity"] in ALARMS
        and x["reason"] not in CONSEQUENCES
        and x["step"] >= f.start
        and (x["reason"], x["step"]) not in seen
    ]


def score(f: Fault, bare: dict, guarded: dict, clean: dict, clean_guarded: dict, ranked: bool = False) -> dict:
    """One fault's ground truth and the guard's result (`ranked`: several ranks, blame one)."""
    hits = _detections(f, guarded, clean_guarded)
    first = min((x["step"] for x in hits), default=None)
    at_first = [x for x in hits if x["step"] == first]
    mpu = fault_mpu(f, guarded.get("mpus") or clean_guarded.get("mpus") or {})
    layer = fault_layer(f) if f.module_path else None
    err = guarded.get("error")
    stopped = bool(err) and err["type"].startswith("mscale.")
    mattered = _bad(bare, clean)
    healed = not _bad(guarded, clean) and not err
    row: dict[str, Any] = {
        "fault": f.fault_id,
        "model": f.model,
        "surface": f.surface,
        "op": f.op,
        "magnitude": f.magnitude,
        "timing": f.timing,
        "mpu": f.labels.get("mpu", "-"),
        "module": f.module_path,
        "mattered": mattered,
        "detected": first is not None,
        "steps_to_detection": None if first is None else first - f.start,
        "right_mpu": None if mpu is None or first is None else any(x["labels"].get("mpu_id") == mpu for x in at_first),
        "right_rank": None
        if not ranked or first is None
        else any(str(x["labels"].get("rank", x.get("rank"))) == str(f.rank) for x in at_first),
        "right_layer": None if layer is None or first is None else any(blamed(x["labels"], layer) for x in hits),
        "healed": healed,
        "stopped": stopped,
        "escaped": mattered and not healed and not stopped,
        "loop": bool(guarded.get("capped")),
        "crash": bool(err) and not stopped,
        "reasons": sorted({x["reason"] for x in hits}),
        "bare_loss": bare.get("held_out"),
        "guarded_loss": guarded.get("held_out"),
        "calls": guarded.get("calls"),
        "error": err,
    }
    return row


def _frac(n: int, d: int) -> str:
    return f"{n}/{d}" if d else "-"


def summarize(rows: list[dict]) -> dict:
    det = [r for r in rows if r["detected"]]
    lat = [r["steps_to_detection"] for r in det]
    mattered = [r for r in rows if r["mattered"]]
    mpu_known = [r for r in det if r["right_mpu"] is not None]
    layer_known = [r for r in det if r["right_layer"] is not None]
    rank_known = [r for r in det if r.get("right_rank") is not None]
    return {
        "faults": len(rows),
        "mattered": len(mattered),
        "detected": len(det),
        "detected_of_mattered": sum(r["detected"] for r in mattered),
        "detected_or_harmless": sum(r["detected"] or not r["mattered"] for r in rows),
        "median_steps": statistics.median(lat) if lat else None,
        "max_steps": max(lat) if lat else None,
        "right_mpu": sum(bool(r["right_mpu"]) for r in mpu_known),
        "mpu_known": len(mpu_known),
        "right_rank": sum(bool(r["right_rank"]) for r in rank_known),
        "rank_known": len(rank_known),
        "right_layer": sum(bool(r["right_layer"]) for r in layer_known),
        "layer_known": len(layer_known),
        "healed": sum(r["healed"] for r in rows),
        "healed_of_mattered": sum(r["healed"] or r["stopped"] for r in mattered),
        "escaped": sum(r["escaped"] for r in rows),
        "loops": sum(r["loop"] for r in rows),
        "crashes": sum(r["crash"] for r in rows),
    }


def by(rows: list[dict], key: str) -> dict[str, dict]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[str(r[key])].append(r)
    return {k: summarize(v) for k, v in sorted(groups.items())}


def false_alarms(clean_runs: list[dict]) -> dict:
    """Warning and critical findings per 1,000 clean steps, by severity (every finding counts,
    heal actions included: in a clean run each is a false alarm)."""
    steps = sum(r["calls"] for r in clean_runs)
    out: dict[str, Any] = {"clean_steps": steps}
    for sev in ALARMS:
        n = sum(1 for r in clean_runs for x in r["findings"] if x["severity"] == sev)
        out[sev] = n
        out[f"{sev}_per_1000"] = round(1000 * n / steps, 2) if steps else None
    out["reasons"] = sorted({x["reason"] for r in clean_runs for x in r["findings"] if x["severity"] in ALARMS})
    return out


HEAD = (
    "| {} | faults | mattered | detected (of mattered) | median / max steps | right rank | right MPU | right layer"
    " | healed | escaped | loops | crashes |"
)


def markdown(rows: list[dict], alarms: dict) -> str:
    lines = []
    for key in ("surface", "magnitude", "timing", "mpu", "model"):
        lines += ["", HEAD.format(key), "|" + "---|" * 12]
        for name, s in [*by(rows, key).items(), ("**all**", summarize(rows))]:
            steps = "-" if s["median_steps"] is None else f"{s['median_steps']:g} / {s['max_steps']}"
            lines.append(
                f"| {name} | {s['faults']} | {s['mattered']} | {s['detected']} ({_frac(s['detected_of_mattered'], s['mattered'])})"
                f" | {steps} | {_frac(s['right_rank'], s['rank_known'])} | {_frac(s['right_mpu'], s['mpu_known'])} | {_frac(s['right_layer'], s['layer_known'])}"
                f" | {s['healed']} | {s['escaped']} | {s['loops']} | {s['crashes']} |"
            )
    lines += [
        "",
        f"False alarms in {alarms['clean_steps']} clean steps: {alarms['warning']} warning "
        f"({alarms['warning_per_1000']} per 1,000), {alarms['critical']} critical ({alarms['critical_per_1000']} per 1,000)"
        + (f"; reasons: {', '.join(alarms['reasons'])}" if alarms["reasons"] else ""),
    ]
    return "\n".join(lines).strip() + "\n"
