"""Two gloo ranks (forked) train the tiny LLaVA under DDP with the README's line (snapshots, the
resumable loader); from --fault-from on, rank 1's vision tower output carries noise of --mult x
its standard deviation: the test's own forward hook on the tower's last encoder layer (after its
last linear and the residual add, outside every ABFT check), drawn from the hook's own generator.
Each rank writes out/rank_R.json: its findings (reason, mpu_id, step, source) and the steps run."""

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


def add_noise(layer: torch.nn.Module, mult: float, active: dict, seed: int = 1234) -> None:
    """The fault: `mult` x the output's std of Gaussian noise on `layer`'s output while
    `active["on"]`, from a generator of its own (not the training RNG a replay restores)."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, inputs, out):
        if not active["on"]:
            return None
        t = out[0] if isinstance(out, tuple) else out
        noisy = t + torch.randn(t.shape, generator=gen).to(t.device, t.dtype) * t.detach().std() * mult
        return (noisy, *out[1:]) if isinstance(out, tuple) else noisy

    layer.register_forward_hook(hook)


def rank_main(args: argparse.Namespace, rank: int) -> int:
    import mscale

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    model, make_batch = tiny_llava(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    loader = mscale.ResumableLoader(Samples(make_batch, 512), batch_size=4, seed=0, rank=rank, world_size=2)
    guard = mscale.attach(ddp, opt, job_id="noise-job", snapshots=True, data=loader, connect=False)
    active = {"on": False}
    if rank == 1:
        add_noise(model.model.vision_tower.encoder.layers[-1], args.mult, active)
    calls = 0
    while guard.current_step < args.steps and calls < 3 * args.steps:
        active["on"] = guard.current_step >= args.fault_from
        ddp(**loader.next_batch()).loss.backward()
        opt.step()
        opt.zero_grad()
        calls += 1
    findings = [[f.reason.value, f.labels.get("mpu_id"), int(f.labels["step"]), f.source] for f in guard.findings]
    out = {"rank": rank, "findings": findings, "vision": guard.mpu("vision").mpu_id, "step": guard.current_step}
    guard.detach()
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--fault-from", type=int, default=30)
    ap.add_argument("--mult", type=float, default=1.0)
    args = ap.parse_args()
    return fork_ranks(2, lambda rank: rank_main(args, rank))


if __name__ == "__main__":
    raise SystemExit(main())
