"""The training job the snapshot tests run as a real subprocess (no tests in this file).

Deterministic CPU training of TinyMultimodal with AdamW, a cosine LR schedule, a grad scaler
whose scale changes during the run, and randomness drawn from torch, python and numpy every
step, so a restore that missed any part of the state would show in the final parameters.

    python tests/support/snapshot_job.py --dir D --steps 200 --out final.safetensors --seen seen.log
        [--fault-at 130]           a parameter turns NaN before step 130's forward (once);
                                   the NaN loss makes every rank roll back
        [--fault-rank R]           only rank R corrupts its batch (with --fault-at)
        [--durable-at 120]         after step 120, write a snapshot and wait until it is on
                                   disk, print "DURABLE 120", then go on (slowly) to be killed
        [--world N --rank R --port P]  gloo job on 127.0.0.1 (DDP)

Each batch drawn is logged to --seen as "step i,j,k..." (appended, flushed), so the sequence
of samples a run used is the last line for each step across all its incarnations.

    python tests/support/snapshot_job.py --zygote

imports torch once, then reads commands on stdin: "run ARGS..." forks a child running the job
with ARGS and prints "PID n"; "wait n" reaps it and prints "EXIT n CODE" (-9: SIGKILL). The
tests start many short-lived jobs this way without paying for the torch import each time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal
from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.data import ResumableLoader
from mscale.snapshot.engine import SnapshotEngine

CFG = TinyConfig()


def build(*, cfg: TinyConfig = CFG, rank: int = 0, world: int = 1, dataset_size: int = 512, steps: int = 200):
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    model = TinyMultimodal(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=25)
    loader = ResumableLoader(
        SyntheticCaptions(cfg, size=dataset_size, seed=7), batch_size=8, seed=11, rank=rank, world_size=world
    )
    mpus = {
        "vision": ("001", model.vision_tower),
        "aligner": ("002", model.multi_modal_projector),
        "text": ("003", model.language_model),
    }
    return model, optimizer, scheduler, scaler, loader, mpus


def train_step(model, batch, step: int, *, fault: bool, nan_batch: bool):
    images, tokens = batch["images"], batch["tokens"].clone()
    images = images + 0.01 * torch.randn_like(images)  # torch RNG
    if random.random() < 0.5:  # python RNG
        images = images.flip(-1)
    mask = np.random.rand(*tokens.shape) < 0.05  # numpy RNG
    tokens[torch.from_numpy(mask)] = 0
    if nan_batch:
        images = images * float("nan")
    if fault:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
    return model(images, tokens)["loss"]


def guarded(args, model, net, optimizer, scheduler, scaler, loader, engine) -> tuple[int | None, list[list[int]]]:
    """The same training through the Guard (steps counted from 0 there): the NaN loss is the
    guard's LOSS_NONFINITE finding, and the SnapshotPlugin rolls every rank back at step end."""
    from mscale.findings import Reason
    from mscale.hook import attach
    from mscale.snapshot.plugin import SnapshotPlugin

    plugin = SnapshotPlugin(engine, rollback_on={Reason.LOSS_NONFINITE})
    guard = attach(
        model,
        optimizer,
        job_id=f"snapshot-test-{args.rank}",
        rank=args.rank,
        connect=False,
        cmsa=False,
        plugins=[plugin],
    )
    resumed = plugin.resume()
    print(f"STARTED {resumed} {os.getpid()}", flush=True)
    faulted = False
    while guard.current_step < args.steps:
        step = guard.current_step
        batch = loader.next_batch()
        inject = args.fault_at == step and not faulted and args.fault_rank in (-1, args.rank)
        faulted = faulted or args.fault_at == step
        loss = train_step(
            net, batch, step, fault=inject and args.fault_rank == -1, nan_batch=inject and args.fault_rank != -1
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # no grad scaler here (test_snapshot.py runs the guard with one)
        optimizer.step()  # the guard's step hooks: findings, then on_step_end (the rollback)
        scheduler.step()  # after a rollback this steps the restored schedule, as the first run did
    guard.detach()
    return resumed, [[r["step"], r["to"]] for r in plugin.rollbacks]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="")
    ap.add_argument("--seen", default="")
    ap.add_argument("--result", default="")
    ap.add_argument("--memory-every", type=int, default=10)
    ap.add_argument("--disk-every", type=int, default=100)
    ap.add_argument("--disk-keep", type=int, default=3)
    # the disk tier's tests: the node tier (mscale.snapshot.node_tier) only where one asks
    ap.add_argument("--node-every", type=int, default=0)
    ap.add_argument("--fault-at", type=int, default=0)
    ap.add_argument("--fault-rank", type=int, default=-1)
    ap.add_argument("--durable-at", type=int, default=0)
    ap.add_argument("--skip-batch", action="store_true")
    ap.add_argument("--hidden", type=int, default=0, help="bigger model (kill -9 test): vision/text hidden size")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log-level", default="info")
    ap.add_argument(
        "--guard", action="store_true", help="drive the engine through the hook library's Guard and SnapshotPlugin"
    )
    args = ap.parse_args(argv)

    from mscale import logs

    logs.configure(args.log_level, json=True, stream=sys.stderr)

    torch.set_num_threads(1)  # bitwise identity across processes: one fixed reduction order
    if args.world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world
        )
    cfg = TinyConfig(vision_hidden=args.hidden, text_hidden=args.hidden) if args.hidden else CFG
    model, optimizer, scheduler, scaler, loader, mpus = build(
        cfg=cfg, rank=args.rank, world=args.world, steps=args.steps
    )
    net = model
    if args.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    engine = SnapshotEngine(
        model,
        optimizer,
        mpus=mpus,
        scaler=scaler,
        scheduler=scheduler,
        data=loader,
        config=SnapshotConfig(
            directory=args.dir,
            memory_every=args.memory_every,
            disk_every=args.disk_every,
            disk_keep=args.disk_keep,
            node_every=args.node_every,
        ),
        job_id="snapshot-test",
    )
    if args.guard:
        resumed, rollbacks = guarded(args, model, net, optimizer, scheduler, scaler, loader, engine)
        step = args.steps + 1
    else:
        resumed = engine.resume()
        print(f"STARTED {resumed} {os.getpid()}", flush=True)
        rollbacks = []
        step = (resumed or 0) + 1
    seen = open(args.seen, "a") if args.seen else None
    faulted = False
    while step <= args.steps:
        batch = loader.next_batch()
        if seen:
            seen.write(f"{step} {','.join(str(int(i)) for i in batch['index'])}\n")
            seen.flush()
        inject = args.fault_at == step and not faulted and args.fault_rank in (-1, args.rank)
        loss = train_step(
            net, batch, step, fault=inject and args.fault_rank == -1, nan_batch=inject and args.fault_rank != -1
        )
        faulted = faulted or args.fault_at == step
        restored = engine.agree_rollback(not bool(torch.isfinite(loss)), skip_batch=args.skip_batch)
        if restored is not None:
            rollbacks.append([step, restored])
            step = restored + 1
            continue
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        engine.step_end(step)
        if step == args.durable_at:
            engine.save(wait=True)
            print(f"DURABLE {step} {os.getpid()}", flush=True)
        if args.durable_at and step > args.durable_at:
            time.sleep(0.02)  # widen the window in which the parent's SIGKILL lands mid-training
        step += 1
    engine.flush()
    engine.close()
    if args.out:
        from safetensors.torch import save_file

        state = {f"model/{k}": v.contiguous() for k, v in model.state_dict().items()}
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in optimizer.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    state[f"optim/{names[id(p)]}/{k}"] = v.contiguous()
        save_file(state, args.out)
    if args.result:
        Path(args.result).write_text(
            json.dumps(
                {
                    "rank": args.rank,
                    "resumed": resumed,
                    "rollbacks": rollbacks,
                    "final_step": engine.step,
                    "scale": scaler.get_scale(),
                    "lr": scheduler.get_last_lr(),
                    "findings": [f.to_dict() for f in engine.findings],
                }
            )
        )
    if args.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def zygote() -> int:
    """Forks jobs on command (see the module docstring). Single-threaded until each fork: it
    runs no torch operation itself, so the children start clean."""
    import shlex

    import torch._dynamo  # noqa: F401  (imported by the first optimizer: ~1 s each child otherwise)

    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "run":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = main(shlex.split(rest))
                finally:
                    sys.stdout.flush()
                    os._exit(code)
            print(f"PID {pid}", flush=True)
        elif cmd == "wait":
            pid = int(rest)
            _, status = os.waitpid(pid, 0)
            print(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(zygote() if sys.argv[1:] == ["--zygote"] else main())
