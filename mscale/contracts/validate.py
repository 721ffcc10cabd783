"""Checking a contract against a host, before the first step: a Plan, or every problem at once.

`validate(contract, host)` returns the execution plan, or raises ContractRefused listing each
mismatch with its code and what to change. It changes nothing on the host, except, when
`allow_hugepage_allocation` is set (config `contract.allow_hugepage_allocation`), raising a
short pool's nr_hugepages under `sys_root` by the shortfall; the pool is read again and still
refused if the kernel did not provide the pages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mscale.contracts.hardware import HostView, format_cpulist, normalize_bdf, read_host
from mscale.contracts.plan import GpuPlan, NvmePlan, Plan, PoolPlan, RdmaPlan, ThreadPlan, thread_tag
from mscale.contracts.spec import MAIN, POOLS, Code, Contract, ContractRefused, Entry, Problem


def _cpus(cpus: frozenset[int] | set[int]) -> str:
    return format_cpulist(cpus) or "none"


class _Check:
    def __init__(self, host: HostView, allowed_cpus: frozenset[int] | None) -> None:
        self.host, self.allowed_cpus = host, allowed_cpus
        self.problems: list[Problem] = []
        self.owner: dict[int, str] = {}  # CPU -> the entry that holds it

    def thread(self, e: Entry, index: int, where: str) -> ThreadPlan:
        """The thread of an entry with CPU cores: its cores checked, each held by one entry."""
        self.cores(e, where)
        for c in e.cpu_cores:
            if c in self.owner:
                self.bad(Code.CORE_SHARED, where, f"CPU {c} is also {self.owner[c]}'s; give each its own")
            self.owner.setdefault(c, e.name)
        tag = "" if e.name == MAIN else thread_tag(index, e.name)
        return ThreadPlan(e.name, tuple(sorted(e.cpu_cores)), tag, e.numa_node)

    def bad(self, code: Code, where: str, message: str) -> None:
        self.problems.append(Problem(code, where, message))

    def cores(self, e: Entry, where: str) -> None:
        host = self.host
        usable = frozenset(host.cpus) - host.isolated
        for c in e.cpu_cores:
            if c not in host.cpus:
                self.bad(Code.CORE_UNKNOWN, where, f"CPU {c} is not online here; online: {_cpus(frozenset(host.cpus))}")
            elif c in host.isolated:
                self.bad(
                    Code.CORE_ISOLATED,
                    where,
                    f"CPU {c} is isolated (isolcpus={_cpus(host.isolated)}): the scheduler will not balance onto it; "
                    f"pick from {_cpus(usable)} or remove it from isolcpus= on the kernel command line",
                )
            elif self.allowed_cpus is not None and c not in self.allowed_cpus:
                self.bad(
                    Code.CORE_NOT_ALLOWED,
                    where,
                    f"CPU {c} is outside this process's CPU set ({_cpus(self.allowed_cpus)}: its cgroup cpuset or "
                    "taskset); pick from those, or give the job that CPU",
                )
            elif e.numa_node is not None and host.cpus[c].numa_node != e.numa_node:
                local = host.numa_nodes.get(e.numa_node, frozenset()) - host.isolated
                self.bad(
                    Code.CORE_NUMA,
                    where,
                    f"CPU {c} is on NUMA node {host.cpus[c].numa_node}, not {e.numa_node}; "
                    f"use CPUs of node {e.numa_node} ({_cpus(local)}) or set numa_node {host.cpus[c].numa_node}",
                )

    def gpu(self, e: Entry, where: str) -> GpuPlan | None:
        assert e.gpu_id is not None
        g = self.host.gpu(e.gpu_id)
        if g is None:
            have = ", ".join(f"{x.index}={x.bdf}" for x in self.host.gpus) or "none"
            self.bad(Code.GPU_UNKNOWN, f"{where}.gpu_id", f"no GPU {e.gpu_id} here; GPUs: {have}")
            return None
        if e.pcie_domain is not None:
            self._bus(e, g.bdf, f"{where}.pcie_domain")
        if e.numa_node is not None and g.numa_node is not None and g.numa_node != e.numa_node:
            local = [x for x in self.host.gpus if x.numa_node == e.numa_node]
            hint = f"GPUs {', '.join(str(x.index) for x in local)} are on node {e.numa_node}" if local else "none is"
            self.bad(
                Code.GPU_NUMA,
                f"{where}.gpu_id",
                f"GPU {g.index} ({g.bdf}) is on NUMA node {g.numa_node}, not {e.numa_node}: {hint}; "
                f"change gpu_id or set numa_node {g.numa_node}",
            )
        return GpuPlan(e.name, g.index, g.bdf, g.numa_node)

    def _bus(self, e: Entry, bdf: str, where: str) -> None:
        text = (e.pcie_domain or "").strip().lower()
        parts = text.split(":")
        full = normalize_bdf(text)
        if full is None and not (len(parts) == 2 and len(parts[0]) in (4, 8) and len(parts[1]) == 2):
            self.bad(
                Code.BDF_NO_DOMAIN,
                where,
                f"{e.pcie_domain!r} has no PCI domain; write the domain too: {bdf[:7]!r} (domain:bus) or {bdf!r}",
            )
            return
        try:
            domain, bus = int(parts[0], 16), int(parts[1], 16)
        except ValueError:
            self.bad(Code.BDF_NO_DOMAIN, where, f"{e.pcie_domain!r} is not a PCI address; write it as {bdf[:7]!r}")
            return
        want = full or f"{domain:04x}:{bus:02x}"
        if not bdf.startswith(want):
            there = [x for x in self.host.gpus if x.bdf.startswith(want)]
            hint = f"; GPU {there[0].index} is at {there[0].bdf}" if there else ""
            self.bad(Code.GPU_BUS, where, f"GPU {e.gpu_id} is at {bdf}, not under {want}{hint}; write {bdf[:7]!r}")

    def pool(self, e: Entry, where: str) -> PoolPlan | None:
        assert e.memory_pool is not None
        size = POOLS[e.memory_pool]
        pages = self.host.hugepages.get(size)
        if pages is None:
            offered = ", ".join(f"{k}kB" for k in sorted(self.host.hugepages)) or "none"
            self.bad(Code.HUGEPAGE_SIZE, where, f"this kernel offers no {size}kB hugepages (sizes: {offered})")
            return None
        if pages.free < e.hugepages:
            short = e.hugepages - pages.free
            self.bad(
                Code.HUGEPAGES_SHORT,
                where,
                f"{e.hugepages} free {size}kB hugepages needed, {pages.free} free of {pages.total}; raise the pool: "
                f"echo {pages.total + short} > /sys/kernel/mm/hugepages/hugepages-{size}kB/nr_hugepages "
                "(or set contract.allow_hugepage_allocation = true)",
            )
        return PoolPlan(e.name, size, e.hugepages, pages.free)

    def rdma(self, e: Entry, where: str) -> RdmaPlan | None:
        assert e.rdma_port is not None
        dev, sep, port_text = e.rdma_port.replace(":", "/").partition("/")
        port = int(port_text) if port_text.isdigit() and len(port_text) <= 3 else (1 if not sep else -1)
        d = self.host.rdma.get(dev)
        known = ", ".join(f"{n}/{p}" for n, x in sorted(self.host.rdma.items()) for p in sorted(x.ports)) or "none"
        if d is None or port not in d.ports:
            self.bad(Code.RDMA_PORT_UNKNOWN, where, f"no RDMA port {e.rdma_port!r} here; ports: {known}")
            return None
        if e.numa_node is not None and d.numa_node is not None and d.numa_node != e.numa_node:
            self.bad(
                Code.RDMA_NUMA,
                where,
                f"{dev} is on NUMA node {d.numa_node}, not {e.numa_node}; pick a device of node {e.numa_node} "
                f"or set numa_node {d.numa_node}",
            )
        return RdmaPlan(e.name, dev, port)

    def nvme(self, e: Entry, where: str) -> NvmePlan | None:
        assert e.nvme is not None
        name = e.nvme.removeprefix("/dev/")
        dev = self.host.nvme.get(name)
        if dev is None:
            have = ", ".join(n for n, d in sorted(self.host.nvme.items()) if d.kind == "namespace") or "none"
            self.bad(Code.NVME_UNKNOWN, where, f"no NVMe namespace {e.nvme!r} here; namespaces: {have}")
            return None
        if dev.kind == "partition":
            self.bad(
                Code.NVME_PARTITION,
                where,
                f"{name} is a partition of namespace {dev.parent}; name the namespace ({dev.parent!r}): "
                "direct I/O and queue placement are per namespace",
            )
            return None
        return NvmePlan(e.name, name)


def validate(
    contract: Contract,
    host: HostView | None = None,
    *,
    allow_hugepage_allocation: bool = False,
    sys_root: str | os.PathLike = "/sys",
    proc_root: str | os.PathLike = "/proc",
    allowed_cpus: frozenset[int] | set[int] | None = None,
) -> Plan:
    """The plan for `contract` on `host` (read from the roots when None); ContractRefused
    with every problem otherwise. allowed_cpus: the CPUs the process may run on
    (os.sched_getaffinity(0)), None not to check (a fixture host)."""
    if host is None:
        host = read_host(sys_root, proc_root)
    check = _Check(host, frozenset(allowed_cpus) if allowed_cpus is not None else None)
    threads, gpus, pools, rdma, nvme = [], [], [], [], []
    for i, e in enumerate(contract.io_topology):
        where = f"io_topology.{e.name}"
        if e.numa_node is not None and e.numa_node not in host.numa_nodes:
            nodes = ", ".join(map(str, sorted(host.numa_nodes)))
            check.bad(Code.NUMA_UNKNOWN, f"{where}.numa_node", f"no NUMA node {e.numa_node} here; nodes: {nodes}")
            e = _without_numa(e)
        if e.cpu_cores:
            threads.append(check.thread(e, i, f"{where}.cpu_cores"))
        if e.gpu_id is not None and (g := check.gpu(e, where)) is not None:
            gpus.append(g)
        if e.memory_pool is not None and (p := check.pool(e, f"{where}.memory_pool")) is not None:
            pools.append(p)
        if e.rdma_port is not None and (r := check.rdma(e, f"{where}.rdma_port")) is not None:
            rdma.append(r)
        if e.nvme is not None and (n := check.nvme(e, f"{where}.nvme")) is not None:
            nvme.append(n)
    notes: list[str] = []
    short = [p for p in check.problems if p.code is Code.HUGEPAGES_SHORT]
    if short and allow_hugepage_allocation and len(short) == len(check.problems):
        # only when the pool is all that is wrong: nothing changes for a contract refused anyway
        notes = _allocate(contract, host, sys_root)
        host = read_host(sys_root, proc_root)
        return _revalidated(contract, host, notes, allowed_cpus)
    if check.problems:
        raise ContractRefused(check.problems)
    return Plan(
        contract_id=contract.contract_id,
        compute_profile=contract.compute_profile,
        threads=tuple(threads),
        gpus=tuple(gpus),
        pools=tuple(pools),
        rdma=tuple(rdma),
        nvme=tuple(nvme),
        recovery_point=contract.recovery_point,
        stateful_io=contract.stateful_io,
        notes=tuple(notes),
    )


def _without_numa(e: Entry) -> Entry:
    from dataclasses import replace

    return replace(e, numa_node=None)


def _allocate(contract: Contract, host: HostView, sys_root: str | os.PathLike) -> list[str]:
    """Raise each short pool's nr_hugepages by what the contract needs beyond its free pages."""
    need: dict[int, int] = {}
    for e in contract.io_topology:
        if e.memory_pool is not None:
            size = POOLS[e.memory_pool]
            need[size] = need.get(size, 0) + e.hugepages
    notes = []
    for size, pages in sorted(need.items()):
        pool = host.hugepages[size]
        if pool.free >= pages:
            continue
        target = pool.total + pages - pool.free
        path = Path(sys_root) / f"kernel/mm/hugepages/hugepages-{size}kB/nr_hugepages"
        try:
            path.write_text(f"{target}\n")
            notes.append(f"nr_hugepages of {size}kB raised {pool.total} -> {target}")
        except OSError as e:
            notes.append(f"nr_hugepages of {size}kB: cannot raise to {target}: {e.strerror or e}")
    return notes


def _revalidated(contract: Contract, host: HostView, notes: list[str], allowed_cpus: Any) -> Plan:
    try:
        plan = validate(contract, host, allowed_cpus=allowed_cpus)
    except ContractRefused as e:
        problems = [
            Problem(p.code, p.where, f"{p.message} [allocation: {'; '.join(notes)}]")
            if p.code is Code.HUGEPAGES_SHORT
            else p
            for p in e.problems
        ]
        raise ContractRefused(problems) from None
    from dataclasses import replace

    return replace(plan, notes=tuple(notes))
