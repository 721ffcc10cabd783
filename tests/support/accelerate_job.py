"""A training script run by `accelerate launch` (no tests here): a tiny Hugging Face LLaVA trained
with Accelerate's own loop (`prepare`, `accumulate`, `backward`, mixed_precision="bf16") and
`mscale.accelerate.attach`.

    accelerate launch [--multi_gpu --num_processes 2] tests/support/accelerate_job.py \
        --out DIR --cases clean,fault,nan,ref,kill | --cases restart  [--steps 8] [--accum 2]

Each case trains a fresh model for --steps optimizer steps of --accum micro-batches, with
in-memory and disk snapshots every 2 steps (disk under DIR/snap-CASE, one directory per case):

- clean: no fault;
- fault: the test's own hook corrupts the first GEMM of the vision tower on rank 0 from step 2,
  as long as the vision MPU is on the simulated GPU it started on (a faulty GPU);
- nan: the test's own hook makes rank 0's loss NaN in the second micro-batch of step 3;
- ref: as clean, with CMSA off (the reference of the next two: CMSA's fitted state, its alpha
  and GVC estimates, is not in the snapshots, so a restarted run with CMSA clips afresh);
- kill: as ref, but the process dies (os._exit) in the first micro-batch of step --kill-at,
  once its queued disk writes are done, with its disk snapshots in DIR/snap-kill;
- restart: as ref, a new launch on DIR/snap-kill, resuming from it, to the last step.

Each rank writes DIR/CASE-rank_R.json: every finding (reason, labels), the guard's step ends
(step, accelerator.sync_gradients then), micro-batch forwards, the loader's position of each
micro-batch drawn with the guard's step then, the MPUs' GPUs at the end, a
hash of the weights at the end and whether they are all finite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repo and tests/ importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from accelerate import Accelerator, DistributedDataParallelKwargs  # noqa: E402

import mscale  # noqa: E402
from support.tiny_hf import tiny_llava  # noqa: E402

SAMPLES = 128
BATCH = 2  # per micro-batch and process


class Samples(torch.utils.data.Dataset):
    """The tiny LLaVA's captioning task, one sample per index (the same for every run)."""

    def __init__(self, make_batch) -> None:
        self.items = []
        for i in range(SAMPLES // 4):
            b = make_batch(i, torch.Generator().manual_seed(i))
            self.items += [{k: v[j] for k, v in b.items()} for j in range(4)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class Record:
    """A plugin: every finding, and each step's end with Accelerate's sync flag at that moment."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator, self.findings, self.ends = accelerator, [], []

    def on_finding(self, f) -> None:
        self.findings.append({"reason": f.reason.value, "labels": dict(f.labels)})

    def on_step_end(self, step, loss) -> None:
        self.ends.append([step, bool(self.accelerator.sync_gradients)])


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def run(accelerator: Accelerator, case: str, args: argparse.Namespace) -> dict:
    rank = accelerator.process_index
    model, make_batch = tiny_llava(seed=0)
    dataset = Samples(make_batch)
    torch.manual_seed(0)
    forwards = []

    def nan_loss(module, inputs, output):  # the test's own fault, registered before attach
        if module.training:
            forwards.append(1)
            if case == "nan" and rank == 0 and len(forwards) == 3 * args.accum + 2:
                output.loss = output.loss * float("nan")
        return output

    model.register_forward_hook(nan_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loader = mscale.ResumableLoader(dataset, batch_size=BATCH, seed=0, rank=rank, world_size=accelerator.num_processes)
    snapdir = Path(args.out) / ("snap-kill" if case in ("kill", "restart") else f"snap-{case}")
    rec = Record(accelerator)
    snapshots = mscale.SnapshotConfig(directory=snapdir, memory_every=2, disk_every=2)
    guard = mscale.accelerate.attach(
        accelerator,
        model,
        optimizer,
        job_id="acc-kill" if case == "restart" else f"acc-{case}",  # a restart is the same job
        snapshots=snapshots,
        data=loader,
        scheduler=scheduler,
        connect=False,
        plugins=[rec],
        # the fault case asserts it is caught in its first step: every layer every step (the budget's
        # rotation only bounds that, to 8 steps: tests/test_checksum_budget.py)
        checksum=mscale.ChecksumConfig(full=True) if case == "fault" else None,
    )
    vision = accelerator.unwrap_model(model).model.vision_tower
    first_gemm = next(m for m in vision.modules() if isinstance(m, torch.nn.Linear))
    start_gpu = guard.mpu("vision").gpu

    def faulty_gpu(module, inputs, out):  # ahead of the guard's checks: what the GEMM produced
        if case == "fault" and rank == 0 and guard.current_step >= 2 and guard.mpu("vision").gpu == start_gpu:
            out = out.clone()
            out.view(-1)[0] = out.view(-1)[0] * 2.0**20 + 1e3  # a high exponent bit flipped
            return out
        return None

    first_gemm.register_forward_hook(faulty_gpu, prepend=True)
    drawn: list[list] = []  # [the guard's step, the loader's position] per micro-batch drawn
    for batch in loader:
        if guard.current_step >= args.steps:
            break
        if case == "kill" and guard.current_step == args.kill_at:
            # the disk snapshots before it complete first (written in the background: on a loaded
            # machine none had finished by step 5, and the restart rightly began at step 0)
            guard.snapshots.flush(timeout=120)
            os._exit(17)  # killed mid-step: the next launch resumes from the newest disk snapshot
        drawn.append([guard.current_step, dict(loader.last_batch_position)])
        with accelerator.accumulate(model):
            out = model(**batch)
            accelerator.backward(out.loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    guard.detach()
    inner = accelerator.unwrap_model(model)
    return {
        "findings": rec.findings,
        "ends": rec.ends,
        "forwards": len(forwards),
        "drawn": drawn,
        "gpus": {m.name: m.gpu for m in guard.mpus},
        "start_gpu": start_gpu,
        "digest": digest(inner),
        "finite": all(bool(torch.isfinite(p).all()) for p in inner.parameters()),
        "world": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="clean,fault,nan,ref,kill")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=5)
    args = parser.parse_args()
    # CLIP's post-layernorm is not used by LLaVA (it takes the last hidden state): DDP must know
    unused = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = Accelerator(
        cpu=True, mixed_precision="bf16", gradient_accumulation_steps=args.accum, kwargs_handlers=[unused]
    )
    for case in args.cases.split(","):
        result = run(accelerator, case, args)
        path = Path(args.out) / f"{case}-rank_{accelerator.process_index}.json"
        path.write_text(json.dumps(result))
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
