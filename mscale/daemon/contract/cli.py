"""`mscale contract check FILE | status [ID] | host`: resource contracts from the command line.

check   validate a contract file (JSON, YAML or TOML) against this host (or the trees under
        --sys-root/--proc-root): the execution plan, or every problem with its code; exit 1
        when refused. Changes nothing on the host unless the config's
        contract.allow_hugepage_allocation is set.
status  the running agent's contracts (all, or the one whose contract id or job id is ID):
        compliance per named thread; exit 1 when the agent cannot be asked or ID is unknown.
host    the hardware view a contract is checked against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from mscale.contracts.hardware import HostView, format_cpulist, nvml_pci, read_host
from mscale.contracts.spec import ContractRefused, load_file
from mscale.contracts.validate import validate
from mscale.link import DEFAULT_URL, printable

HELP = "check a resource contract against this host, or show the agent's contracts and their compliance"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = sub.add_parser("check", help="validate a contract file against this host; print the plan or the problems")
    c.add_argument("file", metavar="FILE")
    h = sub.add_parser("host", help="the hardware view contracts are checked against")
    for q in (c, h):
        q.add_argument("--sys-root", default="/sys", metavar="DIR", help="read /sys from here (default /sys)")
        q.add_argument("--proc-root", default="/proc", metavar="DIR", help="read /proc from here (default /proc)")
        q.add_argument("--json", action="store_true")
    c.add_argument("--config", default=None, help="agent TOML config (its [contract] section)")
    s = sub.add_parser("status", help="the running agent's contracts and their compliance")
    s.add_argument("id", nargs="?", default=None, metavar="ID", help="a contract id or a job id")
    s.add_argument("--agent", default=DEFAULT_URL, metavar="URL", help=f"the agent (default {DEFAULT_URL})")
    s.add_argument("--timeout", type=float, default=5.0, metavar="S")
    s.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    return {"check": _check, "status": _status, "host": _host}[args.action](args)


def _host_view(args: argparse.Namespace) -> HostView:
    pci = nvml_pci() if args.sys_root == "/sys" else None  # NVML answers for this host only
    return read_host(args.sys_root, args.proc_root, pci)


def _check(args: argparse.Namespace) -> int:
    from mscale.daemon import config as configmod

    try:
        section = configmod.load(args.config).contract
    except configmod.ConfigError as e:
        print(f"mscale contract: config error: {e}", file=sys.stderr)
        return 2
    try:
        contract = load_file(args.file)
        plan = validate(
            contract,
            _host_view(args),
            allow_hugepage_allocation=section.allow_hugepage_allocation,
            sys_root=args.sys_root,
            proc_root=args.proc_root,
            allowed_cpus=os.sched_getaffinity(0) if args.sys_root == "/sys" else None,
        )
    except ContractRefused as e:
        if args.json:
            print(json.dumps({"ok": False, "problems": [p.to_dict() for p in e.problems]}, indent=2))
        else:
            print(f"{printable(args.file)}: refused", file=sys.stderr)
            for p in e.problems:
                print(f"  {printable(p)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, "plan": plan.to_dict()}, indent=2))
        return 0
    print(f"{printable(args.file)}: ok, contract {plan.contract_id} ({plan.compute_profile})")
    for t in plan.threads:
        print(f"  thread {t.name}: CPUs {format_cpulist(t.cpus)}" + (" (main thread)" if t.main else f" as {t.tag}"))
    for g in plan.gpus:
        print(f"  gpu {g.name}: GPU {g.gpu_id} at {g.bdf}, NUMA node {g.numa_node}")
    for pool in plan.pools:
        print(f"  pool {pool.name}: {pool.pages} x {pool.size_kb}kB hugepages ({pool.free} free)")
    for r in plan.rdma:
        print(f"  rdma {r.name}: {r.device} port {r.port}")
    for n in plan.nvme:
        print(f"  nvme {n.name}: {n.namespace}")
    print(f"  recovery point {plan.recovery_point}, stateful I/O {'yes' if plan.stateful_io else 'no'}")
    for note in plan.notes:
        print(f"  note: {note}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    from mscale.agent_client import AgentClient, AgentError

    path = "/api/v1/contracts" + (f"/{quote(args.id, safe='')}" if args.id else "")
    try:
        view = AgentClient(args.agent, timeout=args.timeout).get_json(path)
    except (AgentError, ValueError) as e:
        print(f"mscale contract: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    records = view.get("contracts", [])
    if not records:
        print("no contracts")
    for r in records:
        state = {True: "compliant", False: "VIOLATED", None: "pending"}[r.get("compliant")]
        print(
            f"contract {printable(r['contract_id'])} job {printable(r['job_id'])} rank {r['rank']} "
            f"pid {r['pid']} ({printable(r['compute_profile'])}): {state}"
        )
        for t in r.get("threads", []):
            bad = ", ".join(f"task {v['tid']} on {v['cpus']}" for v in t["violations"][:4])
            print(
                f"  {printable(t['name'])}: {t['state']}, {t['tasks']} task(s) on CPUs {t['expected']}"
                + (f"; {bad}" if bad else "")
            )
        for m in r.get("density", []):
            rec = f", recommended {printable(m['recommended'])} ({m['direction']})" if m.get("recommended") else ""
            print(
                f"  MPU {printable(m['mpu_id'])}: density {m['density']:.4g} TFLOP/s per GB, "
                f"{m['deviation']:+.0%} against {printable(m['profile'])} ({m['expected']:g}){rec}"
            )
    return 0


def _host(args: argparse.Namespace) -> int:
    host = _host_view(args)
    if args.json:
        d = asdict(host)
        d["isolated"] = sorted(host.isolated)
        d["numa_nodes"] = {n: sorted(c) for n, c in host.numa_nodes.items()}
        print(json.dumps(d, indent=2, default=sorted))
        return 0
    print(f"CPUs {format_cpulist(set(host.cpus))}, isolated {format_cpulist(host.isolated) or 'none'}")
    for n, cpus in sorted(host.numa_nodes.items()):
        print(f"NUMA node {n}: CPUs {format_cpulist(cpus)}")
    for size, pool in sorted(host.hugepages.items()):
        print(f"hugepages {size}kB: {pool.free} free of {pool.total}")
    for g in host.gpus:
        print(f"GPU {g.index}: {g.bdf} NUMA node {g.numa_node} ({host.gpu_source})")
    for name, dev in sorted(host.nvme.items()):
        print(f"NVMe {name}: {dev.kind}" + (f" of {dev.parent}" if dev.parent else ""))
    for name, r in sorted(host.rdma.items()):
        print(f"RDMA {name}: ports " + ", ".join(f"{p} {s}" for p, s in sorted(r.ports.items())))
    for note in host.notes:
        print(f"note: {printable(note)}")
    return 0
