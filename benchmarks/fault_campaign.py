"""A fault campaign with ground truth (issue 37): every fault of a campaign file run twice on a
tiny Hugging Face model, left alone and under the README's line, and scored; the table per
surface, magnitude, timing and MPU, and false alarms per 1,000 clean steps.

    python benchmarks/fault_campaign.py benchmarks/campaigns/ci.json [--steps 40] [--json OUT]
        [--markdown OUT.md] [--limit N] [--every K] [--setup one|ddp] [--clean-runs 1] [--clean-steps 40]
    python benchmarks/fault_campaign.py --combine A.json B.json     # runs split by --model, as one table

Set-ups: one process, or `--setup ddp`: 2 gloo ranks under DistributedDataParallel, the fault
on rank 1, each run in a fresh process (benchmarks/_campaign_ddp.py); FSDP2 is not run yet. The fault-free run, the guarded
clean runs and each fault's left-alone run are shared by every fault of a model. Faults are
injected by the campaign's own hooks (benchmarks/_campaign_inject.py), in lm-resiliency
0.2.0's incident schema (benchmarks/_campaign_schema.py). Prints the markdown table; the JSON
holds every fault's row, the aggregates and the seconds per fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._campaign_ddp import FAULTY_RANK, ddp_run  # noqa: E402
from benchmarks._campaign_run import run  # noqa: E402

_one = run
from benchmarks._campaign_schema import Fault, load  # noqa: E402
from benchmarks._campaign_score import by, false_alarms, markdown, score, summarize  # noqa: E402

MAX_CALLS_FACTOR = 3  # a run making 3x its target's optimizer calls is a loop (the progress bound)
SETUPS = ("one", "ddp")


def merged(res: dict) -> dict:
    """A DDP run's ranks as one run: every rank's findings, the faulty rank's weights and loss,
    the most optimizer calls, the first error."""
    ranks = res.get("ranks") or []
    if not ranks:
        return {
            "findings": [],
            "held_out": None,
            "finite": False,
            "max_abs": float("inf"),
            "calls": 0,
            "error": res["error"],
        }
    faulty = ranks[min(FAULTY_RANK, len(ranks) - 1)]
    out = {k: faulty.get(k) for k in ("held_out", "finite", "max_abs", "armed", "mpus")}
    out["findings"] = [x for r in ranks for x in r.get("findings", [])]
    out["calls"] = max(r.get("calls", 0) for r in ranks)
    out["capped"] = any(r.get("capped") for r in ranks)
    out["error"] = next((r["error"] for r in ranks if r.get("error")), None)
    out["finite"] = out["finite"] is True
    out["max_abs"] = out["max_abs"] if out["max_abs"] is not None else float("inf")
    return out


def runner(setup: str, campaign_file: str):
    """run(model, fault, guarded=, steps=, max_calls=, seed=) in the set-up."""
    if setup == "one":
        return run

    def ddp(model, fault, *, guarded, steps, max_calls, seed=0):
        return merged(ddp_run(campaign_file, fault, model, guarded=guarded, steps=steps, max_calls=max_calls))

    return ddp


def baselines(run, model: str, steps: int, clean_runs: int, clean_steps: int) -> dict:
    """The fault-free run (left alone) and the guarded clean runs of one model."""
    clean = run(model, None, guarded=False, steps=steps, max_calls=steps)
    if clean["error"] or clean["held_out"] is None:  # every fault is scored against it
        raise RuntimeError(f"{model}: the fault-free run failed: {clean['error'] or clean.get('held_out_error')}")
    guarded = [
        run(model, None, guarded=True, steps=clean_steps, max_calls=clean_steps * MAX_CALLS_FACTOR, seed=s)
        for s in range(clean_runs)
    ]
    return {"clean": clean, "clean_guarded": guarded}


def campaign(
    faults: list[Fault], steps: int, clean_runs: int = 1, clean_steps: int | None = None, log=print, run=run
) -> dict:
    """Every fault scored; the baselines of each model it touches are run once."""
    clean_steps = clean_steps or steps
    base: dict[str, dict] = {}
    rows, t_faults = [], 0.0
    for i, f in enumerate(faults):
        if f.start >= steps:
            raise ValueError(f"fault {f.fault_id}: starts at step {f.start}, past the run's {steps} steps")
        if f.model not in base:
            base[f.model] = baselines(run, f.model, steps, clean_runs, clean_steps)
        b = base[f.model]
        t0 = time.perf_counter()
        bare = run(f.model, f, guarded=False, steps=steps, max_calls=steps)
        guarded = run(f.model, f, guarded=True, steps=steps, max_calls=steps * MAX_CALLS_FACTOR)
        t_faults += time.perf_counter() - t0
        ranked = run is not _one
        truth = dataclasses.replace(f, rank=FAULTY_RANK) if ranked else f  # the set-up puts it on rank 1
        row = score(truth, bare, guarded, b["clean"], b["clean_guarded"][0], ranked=ranked)
        rows.append(row)
        log(
            f"[{i + 1}/{len(faults)}] {f.fault_id}: mattered={row['mattered']} detected={row['detected']} "
            f"healed={row['healed']} loop={row['loop']} crash={row['crash']} ({time.perf_counter() - t0:.1f} s)"
        )
    alarms = false_alarms([g for b in base.values() for g in b["clean_guarded"]])
    return {
        "steps": steps,
        "faults": rows,
        "all": summarize(rows),
        "by": {k: by(rows, k) for k in ("surface", "magnitude", "timing", "mpu", "model", "op")},
        "false_alarms": alarms,
        "seconds_per_fault": round(t_faults / len(rows), 2) if rows else None,
        "baselines": {m: {"clean_loss": b["clean"]["held_out"]} for m, b in base.items()},
    }


def combine(paths: list[Path]) -> dict:
    """Several runs' JSON (one campaign split by --model, run side by side) as one result:
    every fault's row, the aggregates again, the clean runs' alarms added up."""
    parts = [json.loads(p.read_text()) for p in paths]
    rows = [r for d in parts for r in d["faults"]]
    fa = [d["false_alarms"] for d in parts]
    steps = sum(a["clean_steps"] for a in fa)
    alarms: dict = {"clean_steps": steps, "reasons": sorted({x for a in fa for x in a["reasons"]})}
    for sev in ("warning", "critical"):
        alarms[sev] = sum(a[sev] for a in fa)
        alarms[f"{sev}_per_1000"] = round(1000 * alarms[sev] / steps, 2) if steps else None
    return {
        "faults": rows,
        "all": summarize(rows),
        "by": {k: by(rows, k) for k in ("surface", "magnitude", "timing", "mpu", "model", "op")},
        "false_alarms": alarms,
        "parts": [str(p) for p in paths],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("campaign", nargs="?", help="a campaign file (benchmarks/campaigns/*.json)")
    ap.add_argument("--combine", type=Path, nargs="+", default=None, help="print the table of these --json results")
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (the target)")
    ap.add_argument("--clean-runs", type=int, default=1, help="guarded clean runs per model (false alarms)")
    ap.add_argument("--clean-steps", type=int, default=None, help="steps of each clean run (default: --steps)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N faults")
    ap.add_argument("--every", type=int, default=1, help="only every K-th fault (a sample across the file)")
    ap.add_argument("--model", default=None, help="only the faults on this model (llava, qwen2vl)")
    ap.add_argument("--setup", choices=SETUPS, default="one", help="one process, or rank 1 of 2 DDP ranks")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.combine:
        res = combine(args.combine)
        table = markdown(res["faults"], res["false_alarms"])
        if args.json:
            args.json.write_text(json.dumps(res, indent=1, default=str))
        print(table)
        return 0
    if not args.campaign:
        ap.error("a campaign file, or --combine")
    torch.set_num_threads(1)
    head, faults = load(args.campaign)
    faults = [f for f in faults[:: args.every] if args.model in (None, f.model)][: args.limit]
    t0 = time.perf_counter()
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    res = campaign(faults, args.steps, args.clean_runs, args.clean_steps, log, runner(args.setup, args.campaign))
    res.update(campaign=str(args.campaign), name=head.get("name"), setup=args.setup)
    res["wall_seconds"] = round(time.perf_counter() - t0, 1)
    table = markdown(res["faults"], res["false_alarms"])
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    print(f"{len(faults)} faults in {res['wall_seconds']} s ({res['seconds_per_fault']} s a fault)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
