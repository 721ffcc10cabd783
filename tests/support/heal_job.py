"""Two gloo ranks (forked) train the tiny LLaVA under DDP with the README's protection line; from
--fault-from on, a persistent fault follows rank 1's vision tower (the test's own forward hook on
its last linear adds 1.0 to every output element). Each rank writes out/rank_R.json: its loss,
weights hash and vision fuse level at each step end, and the fuse's applied heal actions."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.forked import fork_ranks  # noqa: E402
from support.tiny_hf import Samples, tiny_llava  # noqa: E402
from support.world_job import weights_hash  # noqa: E402


def rank_main(args: argparse.Namespace, rank: int) -> int:
    import mscale

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    model, make_batch = tiny_llava(seed=0)
    state = {"step": 0}
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    loader = mscale.ResumableLoader(Samples(make_batch, 256), batch_size=4, seed=0, rank=rank, world_size=2)
    # every layer every step (full=True): this job is about the fuse under DDP, caught from the
    # fault's first step; the budget's rotation and its bound are tests/test_checksum_budget.py's
    checks = mscale.ChecksumConfig(full=True)
    guard = mscale.attach(ddp, opt, job_id="heal-job", snapshots=True, data=loader, connect=False, checksum=checks)
    if rank == 1:
        fc2 = model.model.vision_tower.encoder.layers[-1].mlp.fc2

        def fault(module, inputs, out):  # prepended: the linear's checksum sees the corrupted output
            return out + 1.0 if state["step"] >= args.fault_from else None

        fc2.register_forward_hook(fault, prepend=True)
    vision = guard.mpu("vision")
    ends = []
    while guard.current_step < args.steps:
        state["step"] = guard.current_step
        loss = ddp(**loader.next_batch()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ends.append(
            {"step": state["step"], "loss": float(loss), "hash": weights_hash(model), "level": vision.fuse_level}
        )
    actions = [
        [f.labels.get("action"), f.labels.get("result"), f.labels.get("step")]
        for f in guard.findings
        if f.reason.value == "heal_action"
    ]
    dropped = [dict(f.labels) for f in guard.findings if f.reason.value == "mpu_gradient_dropped_agreed"]
    guard.detach()
    out = {"rank": rank, "ends": ends, "actions": actions, "dropped": dropped[:3], "n_dropped": len(dropped)}
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault-from", type=int, default=4)
    args = ap.parse_args()
    return fork_ranks(2, lambda rank: rank_main(args, rank))


if __name__ == "__main__":
    raise SystemExit(main())
