"""A guarded tiny LLaVA (CMSA on, the default) with a step-wise LR scheduler, trained in its own
process: the kill-and-restart test of CMSA's fitted state and the scheduler's position.

    python guarded_llava_job.py --dir SNAPS --steps 24 --result R.json [--kill-at 17]
        [--every 4] [--disk-every N] [--node-every N]

Each step's batch is a function of the step (no loader to rewind). --kill-at K: once the disk
snapshots of the steps before K are written the process SIGKILLs itself at the start of step K. A run on a
directory holding snapshots resumes from the newest. R.json: the LR each step trained with, the
alpha CMSA clipped with, the step and tier (node, disk) each start resumed from, and the final
weights' and optimizer state's SHA-256. --every: in-memory (and, by default, disk) snapshots;
--node-every: the node tier's (mscale.snapshot.node_tier; left out: its default).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mscale  # noqa: E402
from support.tiny_hf import tiny_llava  # noqa: E402


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    def raw(t: torch.Tensor) -> bytes:
        return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()

    h = hashlib.sha256()
    for k, t in sorted(model.state_dict().items()):
        h.update(k.encode() + raw(t))
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{i}/{k}".encode() + (raw(v) if torch.is_tensor(v) else repr(v).encode()))
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--every", type=int, default=4)  # in-memory and disk snapshots
    parser.add_argument("--disk-every", type=int, default=None)  # (default: --every)
    parser.add_argument("--node-every", type=int, default=None)  # the node tier's (None: the default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model, make_batch = tiny_llava(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    snapshots = mscale.SnapshotConfig(
        directory=args.dir,
        memory_every=args.every,
        disk_every=args.disk_every or args.every,
        node_every=args.node_every,
    )
    guard = mscale.attach(model, opt, job_id="llava-cmsa", snapshots=snapshots, scheduler=sched, connect=False)
    result = Path(args.result)
    done = json.loads(result.read_text()) if result.exists() else {"lr": {}, "alpha": {}, "resumed": []}
    done["resumed"].append(guard.current_step - 1 if guard.current_step else None)
    done.setdefault("tiers", []).append(sorted(guard.snapshots.recovery_seconds))  # the tier resumed from
    while guard.current_step < args.steps:
        step = guard.current_step
        if step == args.kill_at:
            guard.snapshots.flush(timeout=120)  # the disk snapshots before it are complete
            result.write_text(json.dumps(done))
            os.kill(os.getpid(), signal.SIGKILL)
        done["lr"][str(step)] = opt.param_groups[0]["lr"]
        model(**make_batch(step, torch.Generator().manual_seed(step))).loss.backward()
        opt.step()  # the guard's step: its checks, CMSA's clipping and its snapshots
        sched.step()
        opt.zero_grad()
        done["alpha"][str(step)] = guard.cmsa.alpha
    guard.detach()
    done["digest"] = digest(model, opt)
    result.write_text(json.dumps(done))


if __name__ == "__main__":
    main()
