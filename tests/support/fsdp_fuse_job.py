"""Two gloo ranks training the tiny Hugging Face LLaVA sharded with FSDP2 under the README's
line, with a persistent fault on one rank's vision tower (no tests here: tests/test_fsdp_fuse.py).

    python tests/support/fsdp_fuse_job.py --port P --out DIR [--steps 12] [--fault-from 3]
        [--fault-rank 1] [--verdicts in_step|commit] [--failures-l1 1] [--image 32]

imports torch once, then forks one child per rank (no threads before the fork), each joining a
gloo process group on 127.0.0.1:P (60 s collective timeout). The model is `fully_shard`ed on
each CLIP encoder layer and each Llama decoder layer, then as a whole; the guard is attached
as the README says, `mscale.attach(model, opt, job_id=..., snapshots=True, data=loader)`,
with every layer checked every step (ChecksumConfig(full=True)) and `healing.checksum_failures_l1`
failing steps per fuse level (1: one level a step) and L2's bf16 fallback on. From --fault-from on, --fault-rank's last
vision `fc2` output gets Gaussian noise of its own standard deviation, every forward (this
script's own forward hook, in front of the guard's checks). Every collective each rank issues
(FSDP2's all-gathers and reduce-scatters, the step agreement's all-reduce, the snapshot
engine's) is counted by name. Each rank writes DIR/rank_R.json: the final step, the optimizer
calls, the fuse levels and actions, the counts, whether every weight is finite.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from forked import fork_ranks  # tests/support/, the script's own folder

from support.tiny_hf import Samples, tiny_llava

MAX_CALLS = 80  # optimizer calls, re-runs included: a bound on the loop whatever happens
COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "broadcast",
    "barrier",
    "gather",
    "scatter",
)


def count_collectives() -> collections.Counter:
    """Count every call of the collectives FSDP2 and the guard issue (looked up on
    torch.distributed at call time, so a wrapper there sees them)."""
    counts: collections.Counter = collections.Counter()
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*a, _original=original, _name=name, **k):
            counts[_name] += 1
            return _original(*a, **k)

        setattr(dist, name, counted)
    return counts


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def rank_main(args: argparse.Namespace, rank: int) -> int:
    import mscale
    from mscale.healing.settings import HealingSection

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    counts = count_collectives()
    from torch.distributed.fsdp import fully_shard

    model, make_batch = tiny_llava(seed=0, image=args.image)
    for layer in (*model.model.vision_tower.encoder.layers, *model.model.language_model.layers):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = mscale.ResumableLoader(Samples(make_batch, 256), batch_size=4, seed=0, rank=rank, world_size=2)
    guard = mscale.attach(
        model,
        opt,
        job_id="fsdp-fuse",
        snapshots=True,
        data=loader,
        connect=False,
        checksum=mscale.ChecksumConfig(full=True, verdicts=args.verdicts),
        healing=HealingSection(checksum_failures_l1=args.failures_l1, l2_precision_fallback=True),
    )
    hits: list[int] = []

    def noise(module, inputs, out):  # in front of the guard's checks, as a faulty GEMM's output
        if rank != args.fault_rank or guard.current_step < args.fault_from:
            return None
        hits.append(guard.current_step)
        return out + out.detach().std() * torch.randn_like(out)

    fc2 = model.model.vision_tower.encoder.layers[-1].mlp.fc2
    fc2.register_forward_hook(noise, prepend=True)
    batches = iter(loader)
    calls = 0
    while guard.current_step < args.steps and calls < MAX_CALLS:
        calls += 1
        model(**next(batches)).loss.backward()
        opt.step()
        opt.zero_grad()
    fuse = guard.fuse
    vision = guard.mpu("vision")
    out = {
        "rank": rank,
        "final_step": guard.current_step,
        "calls": calls,
        "hits": len(hits),
        "levels": sorted({f.labels.get("state", "") for f in guard.findings if f.reason.value == "fuse_state"}),
        "heal": [
            [f.labels.get("action", ""), f.labels.get("result", ""), f.message]
            for f in guard.findings
            if f.reason.value == "heal_action"
        ],
        "vision_level": vision.fuse_level,
        "reruns": len(fuse.reruns),
        "collectives": dict(counts),
        "finite": all(bool(torch.isfinite(local(p.detach())).all()) for p in model.parameters()),
    }
    guard.detach()
    dist.barrier()
    dist.destroy_process_group()
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--fault-from", type=int, default=3)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--verdicts", choices=("in_step", "commit"), default="in_step")
    ap.add_argument("--failures-l1", type=int, default=1)
    ap.add_argument("--image", type=int, default=32)
    args = ap.parse_args()
    return fork_ranks(2, lambda rank: rank_main(args, rank))


if __name__ == "__main__":
    raise SystemExit(main())
