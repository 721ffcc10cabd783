"""One DDP job of several gloo ranks reporting to an agent, one rank optionally slowed in its
vision tower (no tests here).

    python tests/support/straggler_job.py --world 4 --port P --socket S --out DIR --steps N
        [--slow-rank R --slow-from K --slow-s 0.03]

imports torch once, then forks one child per rank (LOCAL_RANK = rank, every MPU of rank r on
simulated GPU r), each training the tiny model under DistributedDataParallel, attached to the
agent at S. From step K on, rank R's vision tower sleeps --slow-s in every forward: a forward
pre-hook on its patch embedding, a layer inside the MPU, so the delay is the MPU's own time
as a fail-slow GPU's would be. Each rank writes DIR/rank_R.json: its steps and node.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from forked import fork_ranks  # tests/support/, the script's own folder

from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal


def rank_main(args: argparse.Namespace, rank: int) -> int:
    import mscale

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    cfg = TinyConfig(image_size=8, vision_hidden=16, vision_layers=1, text_hidden=16, text_layers=1, heads=2, seq_len=4)
    model = TinyMultimodal(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    guard = mscale.attach(
        ddp, opt, job_id=args.job, socket_path=args.socket, gpus={"vision": rank, "aligner": rank, "text": rank}
    )
    if rank == args.slow_rank:

        def slow(module, inputs):
            if guard.current_step >= args.slow_from:
                time.sleep(args.slow_s)

        model.vision_tower.patch_embed.register_forward_pre_hook(slow)
    data = SyntheticCaptions(cfg, size=32, seed=rank)
    for _ in range(args.steps):
        b = data[guard.current_step % len(data)]
        loss = ddp(b["images"][None], b["tokens"][None])["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
    deadline = time.monotonic() + 30  # the last reports go out before the link closes
    while guard.link is not None and (guard.link.queue or not guard.link.connected) and time.monotonic() < deadline:
        time.sleep(0.02)
    out = {"rank": rank, "steps": guard.current_step, "node": guard.link.node if guard.link is not None else ""}
    dist.barrier()  # every rank's last report is out before any rank leaves: the last step is whole
    guard.detach()
    dist.destroy_process_group()
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--job", default="straggler-job")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-from", type=int, default=0)
    ap.add_argument("--slow-s", type=float, default=0.03)
    args = ap.parse_args()
    return fork_ranks(args.world, lambda rank: rank_main(args, rank))


if __name__ == "__main__":
    raise SystemExit(main())
