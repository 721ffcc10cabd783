"""A job of several gloo ranks training the tiny model under DDP with the guard (no tests here).

    python tests/support/ddp_job.py --world 2 --port P --out DIR --scenario nan|checksum|corrupt|plain
        [--socket S] [--snapshots] [--steps 8] [--fault-rank 1] [--fault-at 3] [--replica-every K]
        [--verdicts in_step|commit]
        [--wrap ddp|fsdp] [--sockets A,B --snapdir D --hold-at N --go FILE]

imports torch once, then forks one child per rank (no threads before the fork), each joining a
gloo process group on 127.0.0.1:P (60 s collective timeout) and training TinyMultimodal wrapped
in DistributedDataParallel (--wrap fsdp: sharded with FSDP2 `fully_shard`, each MPU and then
the model), attached with `mscale.attach` (the agreement is added by attach;
--snapshots: in-memory snapshots every step and the fuse). Each rank's batch at step s is its
own (seed = rank). Faults, once, on --fault-rank before the forward of step --fault-at:
nan: one NaN pixel in its batch; checksum: a mantissa flip in the vision MPU's first GEMM;
corrupt: one element of the vision MPU's first weight scaled by 1.5 (a corrupted weight);
gradient: one element of GRAD_TENSOR's gradient on that rank raised by 1e6 times its norm (a
tensor hook, before the accumulation and the reduction), once, from --fault-at on, in the
first step whose gradient check covers it (--grad-groups: healing.gradient_groups);
rollback_cmd: a heal rollback command handed to that rank's fuse alone;
nan_output: NaN written into the vision MPU's output on that rank by this script's own forward
hook, on every training forward from the --fault-at-th loop on (it follows the MPU, so no fuse
level cures it: the progress bound's clean stop, mscale.ProgressBoundExceeded, on every rank);
commit: checksum verdicts read at the commit point (every layer checked), the batches drawn from a
ResumableLoader given as `data=` (each step's sample ids recorded), and one element of the vision
MPU's first GEMM output raised by 100 by this script's own forward hook, once, at --fault-at;
every tensor read-back (item, tolist, float, bool) is counted by phase: forward and backward,
and the commit point (from the optimizer step pre-hook to the end of the step agreement).
Several nodes on one machine (--sockets A,B: ranks split evenly over the agents' sockets in
order, LOCAL_RANK = rank within its node, every MPU of a rank on simulated GPU LOCAL_RANK;
--snapdir: disk snapshots there; --hold-at N --go FILE: every rank waits before step N until
FILE exists, 120 s at most). Each rank writes DIR/rank_R.json: the steps it skipped and why, its rollbacks, the findings
it made, a hash of its parameters after each step, the agreements, the final hash.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from forked import fork_ranks  # tests/support/, the script's own folder

from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

MAX_LOOPS = 64  # steps run, rollbacks included: a bound on the loop whatever happens
GRAD_TENSOR = "vision_tower.layers.0.linear1.weight"  # the gradient scenario's weight


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor; a plain one as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def param_hash(model: torch.nn.Module) -> str:
    """A hash of this rank's parameters (its shards, when sharded)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local(p.detach()).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def full_norm(m) -> float:
    """The MPU's gradient norm over the whole gradient (all shards gathered when sharded)."""
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in m.parameters()]
    grads = [g for g in grads if g is not None]  # (a moved MPU's gradient, dropped)
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def batch(data: SyntheticCaptions, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    items = [data[(2 * step + i) % len(data)] for i in range(2)]
    return torch.stack([b["images"] for b in items]), torch.stack([b["tokens"] for b in items])


READS = ("item", "tolist", "__float__", "__bool__")


class Reads:
    """Counts the training thread's tensor read-backs (READS) by phase, for the commit scenario
    (the snapshot copier's verification reads its host copies on a thread of its own: no wait
    of the training's stream, so not counted)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.phase = ""
        self.now: dict[str, int] = {}
        self.steps: list[dict] = []  # per optimizer step: {"step", "forward", "commit"}
        self._originals = {n: getattr(torch.Tensor, n) for n in READS}

    def install(self) -> None:
        for name, original in self._originals.items():

            def read(t, *a, _original=original, **k):
                if self.phase and threading.get_ident() == self.thread:
                    self.now[self.phase] = self.now.get(self.phase, 0) + 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, read)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def on_step_decide(self, step: int) -> None:  # added last: after the agreement's
        self.steps.append({"step": step, "forward": self.now.get("forward", 0), "commit": self.now.get("commit", 0)})
        self.phase, self.now = "", {}


class Recorder:
    """A guard plugin noting, at each step end, whether the update was dropped and the weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.guard = model, None
        self.ends: list[dict] = []

    def on_attach(self, guard) -> None:
        self.guard = guard

    def on_step_end(self, step: int, loss) -> None:
        self.ends.append({"step": step, "skip": self.guard.step_state.skip_reason, "hash": param_hash(self.model)})


def rank_main(args: argparse.Namespace, rank: int) -> int:
    import mscale
    from mscale.hook.core.protect import SnapshotConfig
    from mscale.sim.inject import inject

    torch.set_num_threads(1)
    sockets = [s for s in args.sockets.split(",") if s] or ([args.socket] if args.socket else [])
    per_node = max(1, args.world // max(1, len(sockets)))
    local_rank = rank % per_node if sockets else rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_RANK=str(local_rank))
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    if args.wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for sub in (model.vision_tower, model.multi_modal_projector, model.language_model):
            fully_shard(sub)
        ddp = fully_shard(model)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rec = Recorder(model)
    kw: dict = {"socket_path": sockets[rank // per_node]} if sockets else {"connect": False}
    if args.sockets:
        kw["gpus"] = {"vision": local_rank, "aligner": local_rank, "text": local_rank}
    snaps = (
        SnapshotConfig(directory=args.snapdir or None, memory_every=1, memory_keep=2, disk_every=args.disk_every)
        if args.snapshots
        else None
    )
    if args.grad_groups >= 0:
        from mscale.healing.settings import HealingSection

        kw["healing"] = HealingSection(gradient_groups=args.grad_groups)
    if args.scenario == "checksum":  # a one-step fault in one layer: every layer checked every step
        kw["checksum"] = mscale.ChecksumConfig(full=True)
    if args.verdicts:
        kw["checksum"] = mscale.ChecksumConfig(verdicts=args.verdicts)
    reads = Reads()
    loader = None
    if args.scenario == "commit":
        kw["checksum"] = mscale.ChecksumConfig(full=True, verdicts="commit")
        loader = mscale.ResumableLoader(
            SyntheticCaptions(cfg, size=64, seed=0), batch_size=2, seed=0, rank=rank, world_size=args.world
        )
        kw["data"] = loader

        def commit_begins(opt, a, k) -> None:  # registered before attach's: runs first
            reads.phase = "commit"

        opt.register_step_pre_hook(commit_begins)
    guard = mscale.attach(ddp, opt, job_id="ddp-job", snapshots=snaps, plugins=[rec], **kw)
    consumed: list[list] = []  # (step, sample ids) of every batch drawn
    output_hit: list[int] = []
    if args.scenario == "commit":
        guard.add_plugin(reads)

        def corrupt_output(mod, inputs, out):
            if rank != args.fault_rank or output_hit or guard.current_step != args.fault_at:
                return None
            output_hit.append(guard.current_step)
            out = out.clone()
            out.view(-1)[0] += 100.0
            return out

        # in front of the guard's checksum hook, as a faulty GEMM's output would be
        model.vision_tower.layers[0].linear1.register_forward_hook(corrupt_output, prepend=True)
        batches = iter(loader)
    grad_hit: list[int] = []  # the step whose gradient the gradient scenario corrupted
    if args.scenario == "gradient" and rank == args.fault_rank:
        weight = dict(model.named_parameters())[GRAD_TENSOR]
        index = next(i for i, (_, _, p) in enumerate(guard.gradients.params) if p is weight)

        def corrupt_gradient(g: torch.Tensor) -> torch.Tensor:
            # once, from --fault-at on, in the first step whose gradient check covers the weight
            step = guard.current_step
            if grad_hit or step < args.fault_at or index not in guard.gradients.due:
                return g
            grad_hit.append(step)
            g = g.clone()
            g.view(-1)[7] += 1e6 * (float(g.norm()) + 1.0)
            return g

        weight.register_hook(corrupt_gradient)
    if guard.replicas is not None:
        guard.replicas.every = args.replica_every
    data = SyntheticCaptions(cfg, size=64, seed=rank)
    faulted = False
    norms: list[dict] = []
    loops = {"n": 0}
    if args.scenario == "nan_output" and rank == args.fault_rank:

        def nan_output(mod, inputs, out):
            return out + torch.full_like(out, float("nan")) if loops["n"] >= args.fault_at else None

        model.vision_tower.register_forward_hook(nan_output, prepend=True)
    stopped: dict = {}
    for loops["n"] in range(MAX_LOOPS):
        step = guard.current_step
        if step >= args.steps:
            break
        if step == args.hold_at and args.go:
            deadline = time.monotonic() + 120
            while not os.path.exists(args.go) and time.monotonic() < deadline:
                time.sleep(0.05)
        if loader is not None:
            b = next(batches)
            images, tokens = b["images"], b["tokens"]
            consumed.append([step, b["index"].tolist()])
            reads.install()
            reads.phase = "forward"
        else:
            images, tokens = batch(data, step)
        fault = rank == args.fault_rank and step == args.fault_at and not faulted
        injector = None
        if fault:
            faulted = True
            if args.scenario == "nan":
                images[0, 0, 0, 0] = float("nan")
            elif args.scenario == "checksum":
                injector = inject(guard, kind="mantissa_flip", mpu="vision", element="max")
            elif args.scenario == "rollback_cmd":  # the agent's rollback reaches this rank only
                from mscale import link

                guard.fuse.on_command(link.Heal("rollback", rule="test", level="none", reason="gpu_xid").to_wire())
            elif args.scenario == "corrupt":
                with torch.no_grad():
                    guard.mpu("vision").parameters()[0].view(-1)[7] *= 1.5
        loss = ddp(images, tokens)["loss"]
        loss.backward()
        reads.phase = ""  # the next read this script's own
        norms.append({m.name: [None, full_norm(m)] for m in guard.mpus})
        try:
            opt.step()
        except mscale.ProgressBoundExceeded as e:  # the clean stop: every rank at the same step
            stopped = {
                "step": e.step,
                "culprit": e.culprit,
                "lost": e.lost,
                "snapshot": e.snapshot,
                "loops": loops["n"],
            }
            reads.uninstall()
            break
        reads.uninstall()
        for m in guard.mpus:
            norms[-1][m.name][0] = m.grad_norm
        opt.zero_grad()
        if injector is not None:
            injector.remove()
    fuse = getattr(guard, "fuse", None)
    agreement = next((p for p in guard.plugins if type(p).__name__ == "Agreement"), None)
    out = {
        "rank": rank,
        "world": guard.world_size,
        "guard_rank": guard.rank,
        "final_step": guard.current_step,
        "stopped": stopped,
        "ends": rec.ends,
        "rollbacks": fuse.states["rollback"].rollbacks if fuse is not None else [],
        "findings": [[f.source, f.reason.value] for f in guard.findings],
        "agreements": len(agreement.history) if agreement is not None else 0,
        "repairs": guard.replicas.repairs if guard.replicas is not None else [],
        "replica_checks": guard.replicas.checks if guard.replicas is not None else 0,
        "grad_hit": grad_hit,
        "output_hit": output_hit,
        "consumed": consumed,
        "reads": reads.steps,
        "commit_reads": guard.checksum.readbacks,
        "grad_findings": [f.labels for f in guard.findings if f.reason.value == "gradient_corruption"],
        "replica_findings": [[f.reason.value, f.labels] for f in guard.findings if f.source == "replicas"],
        "replicas": guard.replicas is not None,
        "finite": all(bool(torch.isfinite(local(p)).all()) for p in model.parameters()),
        "hash": param_hash(model),
        "norms": norms,
        "sharded": any(hasattr(p, "to_local") for p in model.parameters()),
        "node": guard.link.node if guard.link is not None else "",
        "gpus": {m.mpu_id: m.gpu for m in guard.mpus},
        "fuse_levels": {m.mpu_id: m.fuse_level for m in guard.mpus},
        "heal": [
            [f.labels.get("action", ""), f.labels.get("result", "")]
            for f in guard.findings
            if f.reason.value == "heal_action"
        ],
        "emergency": [str(w.result(timeout=60)) for w in fuse.states["emergency_snapshot"].writes]
        if fuse is not None
        else [],
    }
    if args.socket:  # the last report goes out before the link closes
        deadline = time.monotonic() + 10
        while guard.link is not None and (guard.link.queue or not guard.link.connected) and time.monotonic() < deadline:
            time.sleep(0.02)
    guard.detach()
    dist.barrier()
    dist.destroy_process_group()
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--scenario",
        choices=("nan", "checksum", "corrupt", "gradient", "rollback_cmd", "commit", "nan_output", "plain"),
        default="plain",
    )
    ap.add_argument("--grad-groups", type=int, default=-1, help="healing.gradient_groups (-1: the default)")
    ap.add_argument("--replica-every", type=int, default=100)
    ap.add_argument("--verdicts", default="", help="ChecksumConfig.verdicts (empty: the scenario's)")
    ap.add_argument("--wrap", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--sockets", default="")
    ap.add_argument("--snapdir", default="")
    ap.add_argument("--disk-every", type=int, default=0)
    ap.add_argument("--hold-at", type=int, default=-1)
    ap.add_argument("--go", default="")
    ap.add_argument("--socket", default="")
    ap.add_argument("--snapshots", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-at", type=int, default=3)
    args = ap.parse_args()
    return fork_ranks(args.world, lambda rank: rank_main(args, rank))


if __name__ == "__main__":
    raise SystemExit(main())
