"""One fault's run in the DDP set-up of the fault campaign: 2 gloo ranks forked from this
process (before any thread starts), DistributedDataParallel, the fault on rank 1.

    python benchmarks/_campaign_ddp.py CAMPAIGN FAULT_ID|clean --out R.json --steps 40
        --max-calls 120 [--guarded] [--port P]

R.json: {"ranks": [each rank's result of benchmarks/_campaign_run.run]}. fault_campaign.py
runs this once per fault and set-up (a fresh process each: a forked rank must not inherit a
guard's threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._campaign_schema import Fault  # noqa: E402

FAULTY_RANK = 1
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ddp_run(campaign: str, fault: Fault | None, model: str, *, guarded: bool, steps: int, max_calls: int) -> dict:
    """The run in a fresh process; a rank that wrote nothing is an error in its place."""
    out = Path(f"/tmp/mscale-campaign-{os.getpid()}-{free_port()}.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), campaign, fault.fault_id if fault else "clean"]
    cmd += ["--model", model, "--out", str(out), "--steps", str(steps), "--max-calls", str(max_calls)]
    cmd += ["--port", str(free_port())] + (["--guarded"] if guarded else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"ranks": [], "error": {"type": "timeout", "message": "the DDP run took over 600 s", "where": []}}
    if not out.exists():
        msg = f"exit {proc.returncode}: {proc.stderr[-600:]}"
        return {"ranks": [], "error": {"type": "exit", "message": msg, "where": []}}
    res = json.loads(out.read_text())
    out.unlink()
    return res


def _rank(args: argparse.Namespace, fault: Fault | None, rank: int) -> int:
    import torch
    import torch.distributed as dist

    from benchmarks._campaign_run import run

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    res = run(
        args.model, fault, guarded=args.guarded, steps=args.steps, max_calls=args.max_calls, rank=rank, world=WORLD
    )
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(res, default=str))
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("campaign")
    ap.add_argument("fault")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--max-calls", type=int, required=True)
    ap.add_argument("--guarded", action="store_true")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    import torch  # noqa: F401  (imported once, before the fork)

    from benchmarks._campaign_schema import load

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.forked import fork_ranks

    fault = None
    if args.fault != "clean":
        fault = next(f for f in load(args.campaign)[1] if f.fault_id == args.fault)
        fault = dataclasses.replace(fault, rank=FAULTY_RANK)
    fork_ranks(WORLD, lambda rank: _rank(args, fault, rank))
    ranks = []
    for r in range(WORLD):
        part = Path(f"{args.out}.rank{r}")
        ranks.append(
            json.loads(part.read_text())
            if part.exists()
            else {"error": {"type": "exit", "message": f"rank {r} wrote nothing", "where": []}}
        )
        part.unlink(missing_ok=True)
    Path(args.out).write_text(json.dumps({"ranks": ranks}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
