"""`mscale demo --nodes N --ranks R`: several nodes on this machine, one DDP job across them.

N real agents (`mscale agent` subprocesses, each with its own node name, port, socket and
R+1 simulated GPUs: one per rank and a standby) and a job of N x R ranks (forked processes, a
gloo group over loopback, the tiny model under DistributedDataParallel, `mscale.attach` with
snapshots in memory and on disk). Once every rank is training, an Xid 79 is injected through
the last node's chaos API on its last rank's GPU; that node's agent sends an emergency snapshot
to its ranks (the Xid asks for the node to be drained) and the quarantine and the L1 swap to
that rank only, which takes them at its next step and moves its MPUs to the standby the agent
grants, while every rank goes on in step. The
summary (printed, and DIR/summary.json) says per rank where it ran, what it did, and whether
the replicas ended bitwise equal; the exit status is 0 only when they did, only the faulty
node's ranks acted and only the faulty rank moved.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mscale.agent_client import AgentClient, AgentError
from mscale.healing.words import Result

CHAOS_TOKEN = "mscale-demo-nodes-chaos"
HOLD_AT, STEPS = 4, 10
DEADLINE_S = 240.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(port: int) -> AgentClient:
    return AgentClient(f"http://127.0.0.1:{port}", timeout=5, chaos_token=CHAOS_TOKEN)


def _until(what: str, fn, timeout_s: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except (OSError, AgentError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def _reap(pid: int, deadline: float) -> int:
    """A rank's exit code, waiting until `deadline` (time.monotonic()); past it killed (-9)."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)  # reaped at once: SIGKILL cannot be caught
    return -9


def _rank(rank: int, world: int, ranks: int, port: int, socket: str, tmp: Path) -> None:
    import logging

    import structlog
    import torch
    import torch.distributed as dist

    import mscale
    from mscale.hook.core.protect import SnapshotConfig
    from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))  # the summary speaks
    torch.set_num_threads(1)
    local = rank % ranks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(local))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    snaps = SnapshotConfig(directory=tmp / "snapshots", memory_every=1, memory_keep=2, disk_every=0)
    gpus = {"vision": local, "aligner": local, "text": local}
    guard = mscale.attach(ddp, opt, job_id="demo-nodes", socket_path=socket, snapshots=snaps, gpus=gpus)
    data = SyntheticCaptions(cfg, size=64, seed=rank)
    while guard.current_step < STEPS:
        step = guard.current_step
        if step == HOLD_AT:  # every rank waits here until the fault is injected and acted on
            _until("the go file", lambda: (tmp / "go").exists())
        b = torch.utils.data.default_collate([data[(2 * step + i) % len(data)] for i in range(2)])
        ddp(b["images"], b["tokens"])["loss"].backward()
        opt.step()
        opt.zero_grad()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    heal = [
        f"{f.labels.get('action')}:{f.labels.get('result')}" for f in guard.findings if f.reason.value == "heal_action"
    ]
    out = {
        "rank": rank,
        "local_rank": local,
        "node": guard.link.node if guard.link is not None else "",
        "steps": guard.current_step,
        "gpus": {m.name: m.gpu for m in guard.mpus},
        "fuse": sorted({m.fuse_level for m in guard.mpus}),
        "actions": heal,
        "weights": h.hexdigest(),
    }
    guard.detach()
    dist.barrier()
    dist.destroy_process_group()
    (tmp / f"rank_{rank}.json").write_text(json.dumps(out))


Agents = list[tuple[str, int, Path, subprocess.Popen]]  # (node name, port, folder, process)


def main(*, nodes: int, ranks: int, out: str) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="mscale-demo-nodes-"))
    names = [f"node-{chr(ord('a') + i)}" for i in range(nodes)]
    agents: Agents = []
    children: list[int] = []
    try:
        _start_agents(tmp, names, ranks, agents)
        print(f"{nodes} agents up ({', '.join(names)}); starting {nodes} x {ranks} ranks (gloo, DDP)", flush=True)
        world, port = nodes * ranks, _free_port()
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    _rank(rank, world, ranks, port, str(agents[rank // ranks][2] / "agent.sock"), tmp)
                    code = 0
                finally:
                    os._exit(code)
            children.append(pid)
        name_b, gpu = _inject_xid(agents, ranks)
        (tmp / "go").touch()
        codes = [_reap(pid, time.monotonic() + DEADLINE_S) for pid in children]
        children.clear()
        results = [json.loads((tmp / f"rank_{r}.json").read_text()) for r in range(world) if codes[r] == 0]
        ok = _replicas_ok(results, world, name_b)
        summary = {
            "nodes": names,
            "ranks_per_node": ranks,
            "xid": {"node": name_b, "gpu": gpu, "code": 79},
            "ranks": results,
            "replicas_equal": ok,
        }
        _print_ranks(results, name_b, gpu, world)
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"summary: {Path(out) / 'summary.json'}")
        return 0 if ok else 1
    finally:
        _stop(children, agents)


def node_config(d: Path, name: str, port: int, gpus: int, chaos_token: str) -> Path:
    """A node's agent config in `d`: HTTP on 127.0.0.1:`port`, its socket in `d`, `gpus`
    simulated GPUs with no scheduled events, eBPF off, the chaos API behind `chaos_token`.
    Returns the config's path."""
    (d / "timeline.yaml").write_text(f"gpus: {gpus}\nevents: []\n")
    (d / "agent.toml").write_text(
        f'[agent]\nlisten = "127.0.0.1:{port}"\nsocket_path = "{d / "agent.sock"}"\nnode = "{name}"\n'
        f'simulate = "{d / "timeline.yaml"}"\n[probes.ebpf]\nenabled = false\n'
        f'[chaos]\ntoken = "{chaos_token}"\n'
    )
    return d / "agent.toml"


def _start_agents(tmp: Path, names: list[str], ranks: int, agents: Agents) -> None:
    """One `mscale agent` per node, each with its own port, socket and ranks + 1 simulated GPUs,
    added to `agents` as it starts (so the caller stops what did); back once every socket is up."""
    for name in names:
        d = tmp / name
        d.mkdir()
        port = _free_port()
        config = node_config(d, name, port, ranks + 1, CHAOS_TOKEN)
        log = open(d / "agent.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "mscale", "agent", "--config", str(config)], stdout=log, stderr=log
        )
        agents.append((name, port, d, proc))
    for name, _, d, _ in agents:
        _until(f"{name}'s socket", lambda d=d: (d / "agent.sock").exists(), 60)


def _inject_xid(agents: Agents, ranks: int) -> tuple[str, int]:
    """Once every node's ranks wait at the hold step, an Xid 79 on the last node's last rank's
    GPU, through its chaos API; back when that node's agent has sent its decisions (the node and
    the GPU)."""

    def held(port: int) -> bool:
        jobs = [j for j in _agent(port).status(events=1)["jobs"] if j["job_id"] == "demo-nodes"]
        return bool(jobs) and len(jobs[0]["ranks"]) == ranks and all(r["step"] == HOLD_AT - 1 for r in jobs[0]["ranks"])

    for name, p, _, _ in agents:
        _until(f"{name}'s ranks at step {HOLD_AT - 1}", lambda p=p: held(p))
    name_b, port_b, _, _ = agents[-1]
    gpu = ranks - 1
    code, reply = _agent(port_b).chaos({"kind": "xid", "gpu": gpu, "code": 79, "corrupt": "none"})
    if code != 200:
        raise RuntimeError(f"{name_b} refused the Xid injection: {reply}")
    print(f"injected Xid 79 on {name_b} GPU {gpu}", flush=True)

    def sent() -> set[str]:
        evs = _agent(port_b).events()
        return {
            e["labels"].get("action", "")
            for e in evs
            if e["reason"] == "heal_action" and e["labels"].get("result") == Result.SENT
        }

    _until(f"{name_b}'s decisions", lambda: {"emergency_snapshot", "l1_swap"} <= sent(), 60)
    return name_b, gpu


def _replicas_ok(results: list[dict], world: int, name_b: str) -> bool:
    """Every rank finished with the same weights, only node B's ranks acted (the drain's
    snapshot) and only the faulty rank (the last) moved."""
    faulty = world - 1
    return (
        len(results) == world
        and len({r["weights"] for r in results}) == 1
        and all(r["steps"] == STEPS for r in results)
        and all(bool(r["actions"]) == (r["node"] == name_b) for r in results)
        and all(r["fuse"] == ["healthy"] for r in results if r["rank"] != faulty)
    )


def _print_ranks(results: list[dict], name_b: str, gpu: int, world: int) -> None:
    print(f"\n{'RANK':<5}{'NODE':<8}{'LOCAL':<6}{'STEPS':<6}{'GPUS (vision aligner text)':<28}{'FUSE':<14}ACTIONS")
    for r in results:
        gpus = " ".join(str(r["gpus"][k]) for k in ("vision", "aligner", "text"))
        print(
            f"{r['rank']:<5}{r['node']:<8}{r['local_rank']:<6}{r['steps']:<6}{gpus:<28}{','.join(r['fuse']):<14}{', '.join(sorted(set(r['actions']))) or '-'}"
        )
    print(
        f"\nXid 79 on {name_b} GPU {gpu}: {name_b}'s ranks took an emergency snapshot (Xid 79 asks for the "
        f"node to be drained), only rank {world - 1} moved its MPUs; all {world} ranks ran {STEPS} steps in one "
        f"process each (no restart); replicas bitwise equal: {'yes' if len({r['weights'] for r in results}) == 1 else 'NO'}"
    )


def _stop(children: list[int], agents: Agents) -> None:
    """Ranks not reaped killed; agents terminated (killed past 15 s)."""
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except ProcessLookupError:
            pass
    for _, _, _, proc in agents:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
