"""A job of --world gloo ranks (forked) training the tiny LLaVA under DDP or FSDP2 (or, on one
rank, the plain model with no process group) with the README's protection line and a snapshot
directory, for restarts on another world size.

--kill-at K --kill-rank R: once every rank's snapshots before step K are written, rank R
SIGKILLs itself at step K's start (the others then lose their peer); --flag-rank R flags the
step before K on that rank first (as a later checksum finding would). --node-every: the node
tier's schedule (mscale.snapshot.node_tier); --peer-every: the peer tier's (peer_tier.py);
--nodes N: the ranks are N "nodes" of world/N ranks (LOCAL_WORLD_SIZE), node n's tier under
--node-base/node<n>. --torchrun: run under torchrun (one rank a process, its rank, world and
rendezvous from torchrun's environment, nothing forked; launch it with
support.ddp_run.torchrun_argv); the kill happens in the first attempt only
(TORCHELASTIC_RESTART_COUNT 0), so `--max-restarts` restarts the group, and --lose-node makes
the restarted kill rank's node a fresh one (its node root emptied before attach, as a node that
replaced a lost one). --peer-timeout: the peer tier's bound on every wait; --mute-peer-rank R:
that rank's sends on the peer tier's group (not the training group) go out under a tag nobody
receives, so its peers wait for it in vain (a peer that does not answer). Each rank writes
out/rank_R.json: the step it started at (after attach's resume), hashes of the weights and of
the optimizer state (whole tensors, shards gathered) then and at each step end, or the error
attach raised."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.forked import fork_ranks  # noqa: E402
from support.tiny_hf import Samples, tiny_llava  # noqa: E402


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(full(p).detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_hash(opt: torch.optim.Optimizer) -> str:
    """Every state tensor (whole, a shard's gathered) and scalar, by parameter index and key."""
    h = hashlib.sha256()
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{i}/{k}".encode())
            if isinstance(v, torch.Tensor):
                h.update(full(v).detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


class Hashes:
    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt, self.at, self.opt_at = model, opt, {}, {}

    def on_step_end(self, step: int, loss) -> None:
        self.at[step] = weights_hash(self.model)
        self.opt_at[step] = optimizer_hash(self.opt)


def mute_peer_sends() -> None:
    """This rank's point-to-point sends on any group but the training one carry a tag no rank
    receives: its peers on the peer tier's group wait for it until their bound. The fault is the
    transport's; nothing of the snapshot engine is touched."""
    real = dist.isend

    def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, **kw):
        muted = group is not None and group is not dist.group.WORLD
        return real(tensor, dst, group=group, tag=tag + 7919 if muted else tag, **kw)

    dist.isend = isend


def rank_main(args: argparse.Namespace, rank: int) -> int:
    import mscale

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not args.torchrun:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_RANK=str(rank))
    if args.nodes:
        per_node = args.world // args.nodes
        os.environ.update(LOCAL_WORLD_SIZE=str(per_node), LOCAL_RANK=str(rank % per_node))
        os.environ["MSCALE_SNAPSHOT_NODE_ROOT"] = str(Path(args.node_base, f"node{rank // per_node}"))
    if args.lose_node and attempt > 0 and rank == args.kill_rank:  # a fresh node's empty /dev/shm
        root = Path(os.environ["MSCALE_SNAPSHOT_NODE_ROOT"])
        shutil.rmtree(root)
        root.mkdir(mode=0o700)
    if args.mute_peer_rank == rank:
        mute_peer_sends()
    if args.wrap != "plain":
        dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=60))
    model, make_batch = tiny_llava(seed=0)
    if args.wrap == "plain":
        wrapped = model
    elif args.wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    loader = mscale.ResumableLoader(Samples(make_batch, 256), batch_size=2, seed=0, rank=rank, world_size=args.world)
    cfg = mscale.SnapshotConfig(
        directory=args.dir,
        memory_every=args.node_every or args.every,
        disk_every=args.every,
        disk_keep=2,
        node_every=args.node_every,
        peer_every=args.peer_every,
        peer_timeout_s=args.peer_timeout,
        node_cap_bytes=args.node_cap if rank == args.cap_rank else None,
    )
    out: dict = {"rank": rank, "world": args.world, "attempt": attempt}
    hashes = Hashes(model, opt)
    try:
        guard = mscale.attach(wrapped, opt, job_id="world-job", snapshots=cfg, data=loader, connect=False)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        Path(args.out, f"rank_{rank}.json").write_text(json.dumps(out))
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    guard.add_plugin(hashes)
    out["start"] = guard.current_step
    out["start_hash"] = weights_hash(model)
    out["start_optimizer_hash"] = optimizer_hash(opt)
    out["index"] = loader.index
    while guard.current_step < args.steps:
        if guard.current_step == args.kill_at:  # every rank's snapshots before it are written
            guard.snapshots.flush(timeout=120)
            dist.barrier()
            if rank == args.flag_rank:  # a finding about the step before, after its snapshots were taken
                guard.snapshots.flag_steps(args.kill_at - 1, args.kill_at - 1, "a checksum finding (test)")
            if rank == args.kill_rank and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        loss = wrapped(**loader.next_batch()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    out["resumed"] = [f.message for f in guard.findings if f.reason.value == "snapshot_resumed"]
    out["refused"] = [f.message for f in guard.findings if f.reason.value == "snapshot_refused"]
    out["tiers"] = [f.message for f in guard.findings if f.reason.value == "snapshot_tier"]
    out["failed"] = [f.message for f in guard.findings if f.reason.value == "snapshot_failed"]
    guard.detach()
    out["hashes"], out["optimizer_hashes"] = hashes.at, hashes.opt_at
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(out))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, default=0)  # the rendezvous port (torchrun: its own)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--wrap", choices=("ddp", "fsdp", "plain"), default="ddp")
    ap.add_argument("--node-every", type=int, default=None)  # the node tier's schedule (None: the default)
    ap.add_argument("--kill-at", type=int, default=None)  # --kill-rank SIGKILLs itself at this step's start
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--flag-rank", type=int, default=None)  # flags step kill-at - 1 before the kill
    ap.add_argument("--peer-every", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=0)  # 0: LOCAL_WORLD_SIZE unset, one node root
    ap.add_argument("--node-base", default="")
    ap.add_argument("--torchrun", action="store_true")
    ap.add_argument("--lose-node", action="store_true")  # --torchrun: the restarted kill rank's node root emptied
    ap.add_argument("--peer-timeout", type=float, default=60)
    ap.add_argument("--mute-peer-rank", type=int, default=None)
    ap.add_argument("--cap-rank", type=int, default=None)  # this rank's node tier capped at --node-cap bytes
    ap.add_argument("--node-cap", type=int, default=1)
    args = ap.parse_args()
    if args.nodes and (args.world % args.nodes or not args.node_base):
        ap.error("--nodes must divide --world, and needs --node-base")
    if args.lose_node and not (args.torchrun and args.kill_at is not None):
        ap.error("--lose-node needs --torchrun and --kill-at")
    if args.wrap == "plain" and args.world != 1:
        ap.error("--wrap plain runs on one rank (--world 1)")
    if args.torchrun:
        if int(os.environ.get("WORLD_SIZE", "0")) != args.world:
            ap.error("--torchrun: torchrun's WORLD_SIZE must equal --world")
        return rank_main(args, int(os.environ["RANK"]))
    if not args.port:
        ap.error("--port is needed unless --torchrun")
    return fork_ranks(args.world, lambda rank: rank_main(args, rank))


if __name__ == "__main__":
    raise SystemExit(main())
