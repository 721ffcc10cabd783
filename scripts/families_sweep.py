"""Every installed multimodal family under the README's protection line: discovery, 100 clean
steps with no critical finding, and a vision (or audio) fault healed. Too long for CI (a few
minutes of CPU a family); run by hand, its table committed as docs/families.md.

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python scripts/families_sweep.py [--families llava,git] [--jobs 2]

For each family the installed transformers maps as image-text-to-text or multimodal LM, in a
process of its own (a deadline each, one thread):

1. a tiny model from its default config (scripts/tiny_family.py; the tests' own builders for the
   families they train), and a batch whose captions depend on the image;
2. `mscale.attach(model, opt, job_id=family, snapshots=True, connect=False)` and the MPUs found;
3. 100 clean steps (AdamW 1e-3): the critical findings counted;
4. a persistent fault put in by this script's own forward hook on the last linear the encoder
   ran in the first step (its output + 1.0 on every forward, following the MPU through every move) for 12 steps, then
   60 steps without it. Recorded: the fuse's actions on that MPU, the highest level applied (and
   why L3 was not, where it was not), whether the fault's effect ended (no failed check of that
   MPU once the fault is gone, the MPU back to `recovered` or `healthy`), whether the loss stayed
   finite and fell. Healed: detected, the effect ended, training finite and learning.

It prints a table and writes it to docs/families.md (`--out`) with the command and the versions.
Families with no vision or audio tower (tests/support/family_scope.py OUT_OF_SCOPE) are listed
with why and not trained.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLEAN, FAULTY, AFTER = 100, 12, 60
LEVELS = {"l1_swap": "L1", "l2_degrade": "L2", "l3_distill": "L3"}


def run_one(family: str) -> dict[str, Any]:
    """The whole check of one family, in this process: its row."""
    import torch

    torch.set_num_threads(1)
    row: dict[str, Any] = {"family": family, "stage": "", "why": ""}
    t0 = time.perf_counter()
    try:
        _check(family, row)
        row["stage"] = row["stage"] or "done"
    except _Stop as e:
        row["stage"], row["why"] = e.stage, e.why
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


class _Stop(Exception):
    def __init__(self, stage: str, why: str) -> None:
        super().__init__(why)
        self.stage, self.why = stage, why


def _modality(family: str) -> str:
    """The encoder the fault goes into: vision where the family has a vision tower, else audio."""
    import warnings

    import torch
    import transformers as T
    from tiny_family import families

    from mscale.hook.core.mpu import MpuLayoutError, discover

    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            names = {m.name for m in discover(getattr(T, families()[family])(T.AutoConfig.for_model(family)))}
    except (MpuLayoutError, Exception):  # a default config that does not build: try vision
        return "vision"
    return "vision" if "vision" in names or "audio" not in names else "audio"


def _check(family: str, row: dict[str, Any]) -> None:
    import torch
    from tiny_family import families, tiny

    import mscale
    from mscale.findings import Reason, Severity

    row["class"] = families()[family]
    try:
        model, make_batch, how = tiny(family, _modality(family))
    except RuntimeError as e:
        stage, _, why = str(e).partition(": ")
        raise _Stop(stage, why) from None
    row["how"] = how
    row["params"] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id=family, snapshots=True, connect=False)
    row["mpus"] = [m.name for m in guard.mpus]
    encoder = next((m for m in guard.mpus if m.name in ("vision", "audio")), None)
    if encoder is None:
        guard.detach()
        raise _Stop("discovery", f"no vision or audio MPU found (MPUs: {', '.join(row['mpus']) or 'none'})")
    called: list[torch.nn.Module] = []  # the encoder's linears in the order the first step runs them
    hooks = [
        m.register_forward_hook(lambda mod, args, out: called.append(mod))
        for m in encoder.module.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        losses = _train(model, make_batch, opt, 0, 1)
        for h in hooks:
            h.remove()
        losses += _train(model, make_batch, opt, 1, CLEAN)
    except Exception as e:
        guard.detach()
        raise _Stop("train", f"{type(e).__name__}: {str(e)[:200]}") from None
    critical = [f for f in guard.findings if f.severity is Severity.CRITICAL]
    row["critical"] = len(critical)
    row["critical_first"] = critical[0].message[:160] if critical else ""
    row["loss_first"], row["loss_clean"] = losses[0], losses[-1]
    if not called:
        guard.detach()
        raise _Stop("fault", f"no nn.Linear of the {encoder.name} MPU ran on the batch")
    fault = {"on": False}
    called[-1].register_forward_hook(lambda mod, args, out: out + 1.0 if fault["on"] else None, prepend=True)
    try:
        fault["on"] = True
        losses += _train(model, make_batch, opt, CLEAN, CLEAN + FAULTY)
        fault["on"] = False
        losses += _train(model, make_batch, opt, CLEAN + FAULTY, CLEAN + FAULTY + AFTER)
    except Exception as e:
        guard.detach()
        raise _Stop("fault", f"{type(e).__name__}: {str(e)[:200]}") from None
    _judge(row, guard, encoder, losses, Reason)
    guard.detach()


def _train(model: Any, make_batch: Any, opt: Any, start: int, stop: int) -> list[float]:
    import torch

    losses = []
    for step in range(start, stop):
        out = model(**make_batch(step, torch.Generator().manual_seed(step)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.get("task_loss", out.loss)))
    return losses


def _judge(row: dict[str, Any], guard: Any, encoder: Any, losses: list[float], Reason: Any) -> None:
    mine = [f for f in guard.findings if f.labels.get("mpu_id") == encoder.mpu_id]
    heal = [f for f in mine if f.reason is Reason.HEAL_ACTION]
    applied = [f.labels["action"] for f in heal if f.labels.get("result") == "applied"]
    failed = [f for f in heal if f.labels.get("result") == "failed"]
    row["actions"] = list(dict.fromkeys(applied))
    levels = [LEVELS[a] for a in applied if a in LEVELS]
    row["level"] = max(levels) if levels else "-"
    row["not_applied"] = failed[0].message.split("(", 1)[-1].rstrip(")")[:200] if failed else ""
    ended = CLEAN + FAULTY + 1  # the step after the fault's last; its checks see a clean MPU
    late = [
        f
        for f in mine
        if f.reason in (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT) and int(f.labels.get("step", -1)) > ended
    ]
    row["detected"] = "mark_suspect" in applied
    row["effect_ended"] = not late and encoder.fuse_level in ("recovered", "healthy")
    row["fuse_end"] = encoder.fuse_level
    row["finite"] = all(math.isfinite(v) for v in losses)
    row["loss_last"] = min(losses[-10:])
    row["learning"] = row["loss_last"] < losses[0]
    row["healed"] = bool(row["detected"] and row["effect_ended"] and row["finite"] and row["learning"])


# -- the sweep ------------------------------------------------------------------------------


def _worker(family: str, timeout_s: int, logs: Path) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts")]))
    env["OMP_NUM_THREADS"] = "1"
    log = logs / f"{family}.log"
    cmd = [sys.executable, str(Path(__file__)), "--one", family]
    try:
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"family": family, "stage": "timeout", "why": f"over {timeout_s} s"}
    rows = [line[4:] for line in p.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        tail = log.read_text().strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        return {"family": family, "stage": "crash", "why": tail[0][:200]}
    return json.loads(rows[-1])


def _cell(row: dict[str, Any]) -> list[str]:
    f = row["family"]
    if row["stage"] == "out of scope":
        return [f, "-", "out of scope: " + row["why"], "", "", ""]
    if row["stage"] not in ("done",) and "critical" not in row:
        return [f, ", ".join(row.get("mpus", [])) or "-", f"not run ({row['stage']}): {row['why']}", "", "", ""]
    clean = f"{row['critical']} critical" + (f" ({row['critical_first']})" if row["critical_first"] else "")
    if row["stage"] != "done":
        return [f, ", ".join(row["mpus"]), clean, "-", "no", f"{row['stage']}: {row['why']}"]
    level = row["level"] + (
        f" (L3 not applied: {row['not_applied']})" if row["level"] != "L3" and row["not_applied"] else ""
    )
    healed = "yes" if row["healed"] else "no"
    note = (
        []
        if row["healed"]
        else [
            k
            for k, bad in (
                ("not detected", not row["detected"]),
                (f"effect not ended (fuse {row['fuse_end']})", not row["effect_ended"]),
                ("loss not finite", not row["finite"]),
                ("loss did not fall", not row["learning"]),
            )
            if bad
        ]
    )
    return [f, ", ".join(row["mpus"]), clean, level, healed, "; ".join(note)]


def table(rows: list[dict[str, Any]]) -> str:
    head = ["family", "MPUs found", "100 clean steps", "fault: highest level", "healed", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [" ".join(c.split()).replace("|", "/") for c in _cell(row)]  # one line each
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    done = [r for r in rows if r["stage"] == "done"]
    return {
        "families": len(rows),
        "out_of_scope": sum(r["stage"] == "out of scope" for r in rows),
        "not_run": sum(r["stage"] not in ("done", "out of scope") for r in rows),
        "trained": len(done),
        "clean_without_critical": sum(r.get("critical") == 0 for r in done),
        "healed": sum(bool(r.get("healed")) for r in done),
        "healed_at_l3": sum(bool(r.get("healed")) and r["level"] == "L3" for r in done),
    }


def write_doc(path: Path, rows: list[dict[str, Any]], command: str) -> None:
    import torch
    import transformers

    s = summary(rows)
    text = f"""# Every installed family under the guard

Generated by `{command}` (scripts/families_sweep.py; transformers {transformers.__version__},
torch {torch.__version__}, CPU, offline). For each family the installed transformers maps as
image-text-to-text or multimodal LM: a tiny model from its default config (hidden 32, 2 layers;
scripts/tiny_family.py, or the tests' own builders), trained under
`mscale.attach(model, opt, job_id=..., snapshots=True, connect=False)`: 100 clean steps, the
critical findings counted; then a fault put in by the script's own forward hook on the last linear
the encoder ran (+1.0 on its output, following the MPU through every move) for {FAULTY} steps, and
{AFTER} steps without it. "Highest level": the highest fuse level applied to that MPU (L3's
failure to apply, where it failed, says why). "Healed": the fault was detected, its effect ended
(no failed check of the MPU once the fault was gone, the MPU back to `recovered` or `healthy`),
the loss stayed finite and fell.

{s["families"]} families: {s["out_of_scope"]} out of scope (no vision or audio tower; why in
tests/support/family_scope.py), {s["not_run"]} not run to the end (the tiny config, the model or
a batch it takes could not be made offline, the encoder never ran on the batch, or the run was
past its deadline: the stage and the error in the table), {s["trained"]} trained through the
fault; of these, {s["clean_without_critical"]} with 0 critical findings in 100 clean steps and
{s["healed"]} healed ({s["healed_at_l3"]} through L3).

{table(rows)}
"""
    path.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--families", default="", help="comma-separated families (default: every installed one)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout-s", type=int, default=900)
    ap.add_argument("--out", default=str(ROOT / "docs" / "families.md"), help="'' writes nothing")
    ap.add_argument("--logs", default="/tmp/mscale-families", help="one log per family")
    ap.add_argument("--render", metavar="COMMAND", help="write --out from the last run's rows.json, naming COMMAND")
    ap.add_argument(
        "--update", action="store_true", help="re-run --families only, the other rows from the last run's rows.json"
    )
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]
    if args.one:
        print("ROW " + json.dumps(run_one(args.one)), flush=True)
        return 0
    from tiny_family import families

    if args.render:  # the table again, from the last run's rows (nothing re-run)
        ordered = json.loads((Path(args.logs) / "rows.json").read_text())
        write_doc(Path(args.out), ordered, args.render)
        print(table(ordered))
        return 0
    from support.family_scope import OUT_OF_SCOPE

    names = [f for f in args.families.split(",") if f] or list(families())
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    rows = {f: {"family": f, "stage": "out of scope", "why": OUT_OF_SCOPE[f]} for f in names if f in OUT_OF_SCOPE}
    todo = [f for f in names if f not in OUT_OF_SCOPE]
    with ThreadPoolExecutor(args.jobs) as pool:
        for row in pool.map(lambda f: _worker(f, args.timeout_s, logs), todo):
            rows[row["family"]] = row
            print(
                f"{row['family']:28s} {row['stage']:10s} {row.get('level', '')} healed={row.get('healed')} "
                f"{row.get('why', '')[:100]}",
                flush=True,
            )
    if args.update:  # the rows of the last whole run, these families re-run
        last = {r["family"]: r for r in json.loads((logs / "rows.json").read_text())}
        rows = {**last, **rows}
        names = list(last)
    ordered = [rows[f] for f in names]
    print(table(ordered))
    print(json.dumps(summary(ordered)))
    (logs / "rows.json").write_text(json.dumps(ordered, indent=1))
    if args.out:
        command = "HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python scripts/families_sweep.py"
        write_doc(
            Path(args.out),
            ordered,
            command + (f" --families {args.families}" if args.families and not args.update else ""),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
