"""A tiny Hugging Face LLaVA trained clean under the README's one line (snapshots in memory, the
fuse), for a few seeds in turn, each seed a fresh model and guard: the findings each rank made.

    python tests/support/clean_job.py --out DIR --steps 300 --seeds 0,1,2
        [--world 2 --port P --wrap ddp|fsdp] [--verdicts in_step|commit]
        [--fault-mpu vision --fault-from 150 --fault-steps 1 --fault-scale 1000 --fault-rank 1]

--world 1 trains in this process (no process group); more ranks: torch is imported once, then
one child per rank is forked, joining a gloo process group on 127.0.0.1:P, the model wrapped in
DistributedDataParallel, or (--wrap fsdp) sharded with FSDP2: `fully_shard` on each CLIP and
Llama layer, then the model. Rank r's batch at step s is drawn from the seed 1000 * seed + s
+ 100000 * r. --fault-mpu: from the step --fault-from for --fault-steps steps, on --fault-rank,
every gradient of that MPU's parameters multiplied by --fault-scale by this script's own tensor
hook (before any reduction): a real gradient fault, each step once (a re-run after a rollback
is clean). Each rank writes DIR/rank_R.json: per seed, the findings (source, reason, severity,
step, labels, message), the final step, the steps the fault hit, the number of optimizer calls,
and for the steps CHECKED the global gradient norm the guard took and the whole model's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(HERE.parents[1]))
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CHECKED = range(14, 18)  # steps whose global gradient norm is also taken here (GVC_EVERY's 16 among them)
MAX_CALLS = 2  # optimizer calls per target step at most: a bound on the loop whatever happens


def full_norm(model: torch.nn.Module) -> float:
    """The gradient norm over the whole model (each sharded gradient gathered: a collective)."""
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads if g is not None])))


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 as a user shards a LLaVA: each vision and text decoder layer, then the whole."""
    from torch.distributed.fsdp import fully_shard

    for layer in (*model.model.vision_tower.encoder.layers, *model.model.language_model.layers):
        fully_shard(layer)
    return fully_shard(model)


def fault_hooks(guard, args: argparse.Namespace, rank: int, sharded: bool) -> dict:
    """The test's own gradient fault (see the module docstring): a switch the loop turns on for
    a step's backward, read by a tensor hook on each of the MPU's parameters. Under FSDP2 the
    parameters the backward sees are gathered ones: the loop scales this rank's shards of the
    reduced gradient itself instead (`scale_shards`)."""
    now = {"on": False, "mine": bool(args.fault_mpu) and rank == args.fault_rank}
    if now["mine"] and not sharded:
        for p in guard.mpu(args.fault_mpu).parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g * args.fault_scale if now["on"] else g)
    return now


def scale_shards(guard, args: argparse.Namespace) -> None:
    with torch.no_grad():
        for p in guard.mpu(args.fault_mpu).parameters():
            if p.grad is not None:
                p.grad.to_local().mul_(args.fault_scale)


def train(args: argparse.Namespace, seed: int, rank: int, world: int) -> dict:
    import mscale
    from support.tiny_hf import tiny_llava

    model, make_batch = tiny_llava(seed)
    wrapped: torch.nn.Module = model
    if world > 1:
        wrapped = (
            shard(model)
            if args.wrap == "fsdp"
            else torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        )
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    findings: list = []

    class Keep:
        def on_finding(self, f) -> None:
            findings.append(f)

    kw = {"checksum": mscale.ChecksumConfig(verdicts=args.verdicts)} if args.verdicts else {}
    guard = mscale.attach(wrapped, opt, job_id=f"clean-{seed}", connect=False, snapshots=True, plugins=[Keep()], **kw)
    sharded = world > 1 and args.wrap == "fsdp"
    fault, hit = fault_hooks(guard, args, rank, sharded), []
    calls = 0
    norms: list[list] = []
    series: list[list] = []  # [step, loss, global gradient norm, {mpu_id: gradient norm}] per call
    try:
        while guard.current_step < args.steps and calls < MAX_CALLS * args.steps:
            step = guard.current_step
            batch = make_batch(step, torch.Generator().manual_seed(1000 * seed + step + 100_000 * rank))
            fault["on"] = bool(fault["mine"]) and args.fault_from <= step < args.fault_from + args.fault_steps
            fault["on"] = fault["on"] and step not in hit  # each step once: its re-run is clean
            hit += [step] if fault["on"] else []
            opt.zero_grad()
            wrapped(**batch).loss.backward()
            if fault["on"] and sharded:
                scale_shards(guard, args)
            whole = full_norm(model) if step in CHECKED else None
            opt.step()
            calls += 1
            last = guard.summary()
            series.append([step, last["loss"], last["grad_norm"], {m.mpu_id: m.grad_norm for m in guard.mpus}])
            if whole is not None:
                norms.append([step, last["grad_norm"], whole])
    finally:
        guard.detach()
    return {
        "seed": seed,
        "final_step": guard.current_step,
        "calls": calls,
        "hit": hit,
        "norms": norms,
        "series": series,
        "findings": [
            {
                "source": f.source,
                "reason": f.reason.value,
                "severity": f.severity.value,
                "step": int(f.labels.get("step", -1)),
                "labels": dict(f.labels),
                "message": f.message,
            }
            for f in findings
        ],
    }


def rank_main(args: argparse.Namespace, rank: int) -> int:
    torch.set_num_threads(1)
    world = args.world
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    runs = [train(args, int(s), rank, world) for s in args.seeds.split(",")]
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(runs))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--wrap", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--verdicts", choices=("", "in_step", "commit"), default="")
    ap.add_argument("--fault-mpu", default="")
    ap.add_argument("--fault-from", type=int, default=0)
    ap.add_argument("--fault-steps", type=int, default=1)
    ap.add_argument("--fault-scale", type=float, default=1000.0)
    ap.add_argument("--fault-rank", type=int, default=0)
    args = ap.parse_args()
    if args.world <= 1:
        return rank_main(args, 0)
    from forked import fork_ranks

    return fork_ranks(args.world, lambda rank: rank_main(args, rank))


if __name__ == "__main__":
    raise SystemExit(main())
