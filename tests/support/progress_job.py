"""One training run of the progress matrix (tests/test_progress_matrix.py): the tiny Hugging Face
LLaVA under the README's protection line (snapshots in memory, the loader given as `data=`), in
one set-up, with one fault from tests/support/progress_faults.py, or with no guard at all.

    python tests/support/progress_job.py --setup inproc|commit|ddp|fsdp|compiled|lightning|accelerate
        --fault clean|noise|nan|flip|tower --out R.json [--bare] [--steps 80] [--start 20]
        [--stop 50] [--flip-at 44] [--seed 0] [--max-calls 200] [--port P]

Set-ups: inproc, commit: one process, checksum verdicts read in the step / at the commit point;
ddp, fsdp: 2 gloo ranks (forked), DistributedDataParallel / FSDP2 `fully_shard` on each CLIP and
Llama layer and the model; compiled: torch.compile (inductor) before attach; lightning: a
LightningModule under `lightning.Trainer` (bf16-mixed) with `mscale.lightning.MscaleCallback`;
accelerate: Accelerate's own loop (one CPU process, bf16, 2 micro-batches a step) with
`mscale.accelerate.attach`. The fault is on rank 1 where there are ranks. --bare: the same run
with no guard (the left-alone reference). The loop stops at --steps (the guard's step, which a
rollback moves back) or after --max-calls optimizer calls, whichever comes first: the run ends
whatever the healing does.

R.json: {"setup", "fault", "bare", "target", "max_calls", "ranks": [per rank: "calls" (optimizer
calls made), "steps" (the step reached), "error" (the exception that ended the run, if any),
"finite" and "hash" (the weights at the end), "held_out" (the task loss on batches never
trained on), "seconds", "fault" (forwards armed, the flip's step), "guard" (findings, heal
actions applied, rollbacks, re-runs, fuse levels)]}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository and tests/ importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import mscale  # noqa: E402
from support.forked import fork_ranks  # noqa: E402
from support.fuse_runs import held_out_loss  # noqa: E402
from support.progress_faults import FAULTS, Fault, Record, guard_report, weights_state  # noqa: E402
from support.tiny_hf import Samples, tiny_llava  # noqa: E402

SETUPS = ("inproc", "commit", "ddp", "fsdp", "compiled", "lightning", "accelerate")
RANKED = ("ddp", "fsdp")
LR = 3e-3
SAMPLES = 512


class Capped(Exception):
    """The run made --max-calls optimizer calls before reaching its target step."""


def checksum(setup: str):
    if setup == "inproc":
        return mscale.ChecksumConfig(verdicts="in_step")
    if setup == "commit":
        return mscale.ChecksumConfig(verdicts="commit")
    return None  # the defaults, as the README's line has them


class Run:
    """One rank's run: its model and fault, its counters, what it reports."""

    def __init__(self, args: argparse.Namespace, rank: int = 0, world: int = 1) -> None:
        self.args, self.rank, self.world = args, rank, world
        torch.manual_seed(args.seed)
        self.model, self.make_batch = tiny_llava(seed=args.seed)
        self.calls = 0
        self.guard = None
        self.record = Record()
        self.fault: Fault | None = None
        self.out: dict = {"rank": rank, "error": None}

    def loader(self, batch: int = 4) -> mscale.ResumableLoader:
        data = Samples(self.make_batch, SAMPLES)
        return mscale.ResumableLoader(
            data, batch_size=batch, seed=self.args.seed, rank=self.rank, world_size=self.world
        )

    def attach(self, wrapped, opt, loader, **kw) -> None:
        """The README's line (none with --bare), then the fault, in front of the guard's hooks."""
        if not self.args.bare:
            self.guard = mscale.attach(
                wrapped,
                opt,
                job_id=f"progress-{self.args.setup}",
                snapshots=True,
                data=loader,
                connect=False,
                plugins=[self.record],
                checksum=checksum(self.args.setup),
                **kw,
            )
        self.arm_fault()

    def arm_fault(self) -> None:
        a = self.args
        live = self.rank == self.world - 1
        self.fault = Fault(a.fault, self.model, start=a.start, stop=a.stop, flip_at=a.flip_at, live=live)

    def step(self) -> int:
        return self.guard.current_step if self.guard is not None else self.calls

    def begin(self) -> bool:
        """Before a step's forward: False once the target is reached; Capped past --max-calls."""
        step = self.step()
        if step == self.args.checkpoint and "checkpoint" not in self.out:
            self.out["checkpoint"] = {"step": step, **self.measure()}
        if step >= self.args.steps:
            return False
        if self.calls >= self.args.max_calls:
            raise Capped(f"{self.calls} optimizer calls reached step {step} of {self.args.steps}")
        self.fault.arm(step)
        return True

    def train(self, call, opt, loader) -> None:
        """The README's loop."""
        for batch in loader:
            if not self.begin():
                break
            loss = call(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            self.calls += 1

    def finish(self, t0: float) -> dict:
        out = self.out
        out.update(calls=self.calls, steps=self.step(), seconds=round(time.perf_counter() - t0, 2))
        if self.guard is not None:
            out["guard"] = guard_report(self.guard, self.record)
            self.guard.detach()
        out["fault"] = {"armed": self.fault.armed_steps, "flipped": self.fault.flipped} if self.fault else {}
        if self.fault is not None:
            self.fault.on.fill_(0.0)  # the held-out loss measures the weights, not the fault
        out.update(self.measure())
        return out

    def measure(self) -> dict:
        """The weights now: finite, their hash, the held-out loss of a plain copy of them."""
        out = weights_state(self.model)
        try:
            out["held_out"] = held_out_loss(self.fresh_copy(), self.make_batch)
        except Exception as e:  # another rank gone: its collectives time out
            out["held_out"] = None
            out["held_out_error"] = f"{type(e).__name__}: {e}"[:500]
        return out

    def fresh_copy(self) -> torch.nn.Module:
        """A plain model holding the trained weights: no fault hook, no guard, nothing compiled
        (shards gathered: a collective every rank makes at the same step)."""
        with torch.random.fork_rng(devices=[]):  # the run's own random numbers untouched
            fresh, _ = tiny_llava(seed=self.args.seed)
        state = self.model.state_dict()
        fresh.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()})
        return fresh

    def failed(self, e: BaseException) -> None:
        if isinstance(e, Capped):
            self.out["capped"] = str(e)
            return
        tb = traceback.extract_tb(e.__traceback__)
        self.out["error"] = {
            "type": f"{type(e).__module__}.{type(e).__name__}",
            "message": str(e)[:1500],
            "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb[-6:]],
        }


def one_process(args: argparse.Namespace) -> dict:
    run = Run(args)
    model, t0 = run.model, time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = run.loader()
    call = torch.compile(model) if args.setup == "compiled" else model
    try:
        run.attach(call, opt, loader)
        run.train(call, opt, loader)
    except Exception as e:
        run.failed(e)
    return run.finish(t0)


def rank_main(args: argparse.Namespace, rank: int) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    run = Run(args, rank, 2)
    model, t0 = run.model, time.perf_counter()
    if args.setup == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in [*model.model.vision_tower.encoder.layers, *model.model.language_model.layers]:
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    loader = run.loader(batch=2)
    try:
        run.attach(wrapped, opt, loader)
        run.train(wrapped, opt, loader)
    except Exception as e:
        run.failed(e)
    out = run.finish(t0)
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def ranked(args: argparse.Namespace) -> list[dict]:
    code = fork_ranks(2, lambda rank: rank_main(args, rank))
    ranks = []
    for r in range(2):
        part = Path(f"{args.out}.rank{r}")
        if part.exists():
            ranks.append(json.loads(part.read_text()))
            part.unlink()
        else:
            ranks.append({"rank": r, "error": {"type": "exit", "message": f"rank {r} wrote nothing (exit {code})"}})
    return ranks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setup", choices=SETUPS, required=True)
    ap.add_argument("--fault", choices=FAULTS, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bare", action="store_true", help="no guard: the left-alone reference")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--start", type=int, default=20)
    ap.add_argument("--stop", type=int, default=50)
    ap.add_argument("--flip-at", type=int, default=44)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-calls", type=int, default=200)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--checkpoint", type=int, default=-1, help="also measure the weights when this step begins")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.setup in RANKED:
        ranks = ranked(args)
    elif args.setup == "lightning":
        from support.progress_frameworks import lightning_run

        ranks = [lightning_run(Run(args), args)]
    elif args.setup == "accelerate":
        from support.progress_frameworks import accelerate_run

        ranks = [accelerate_run(Run(args), args)]
    else:
        ranks = [one_process(args)]
    head = {"setup": args.setup, "fault": args.fault, "bare": args.bare, "target": args.steps}
    head.update(max_calls=args.max_calls, seed=args.seed, window=[args.start, args.stop], flip_at=args.flip_at)
    Path(args.out).write_text(json.dumps({**head, "ranks": ranks}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
