"""The execution plan a valid contract becomes: CPU masks per named I/O thread, GPU binding,
hugepage pools, RDMA ports, NVMe namespaces, the recovery point. Plain data: the job applies
it (mscale.contracts.pin), the link carries it (`to_dict`, mscale.link.Contract), the
agent checks the process against it (mscale.daemon.contract.service)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mscale.contracts.spec import MAIN

COMM_BYTES = 15  # a task's name (comm) is at most 15 bytes


def thread_tag(index: int, name: str) -> str:
    """The task name a pinned thread or worker takes, so the agent finds it in
    /proc/PID/task/*/status: 'msc<index>:<name>', cut to 15 bytes (the index keeps it unique)."""
    return f"msc{index}:{name}"[:COMM_BYTES]


@dataclass(frozen=True)
class ThreadPlan:
    name: str
    cpus: tuple[int, ...]
    tag: str  # task name of the pinned thread or worker ("" for the main thread: it keeps its own)
    numa_node: int | None = None

    @property
    def main(self) -> bool:
        return self.name == MAIN


@dataclass(frozen=True)
class GpuPlan:
    name: str
    gpu_id: int
    bdf: str
    numa_node: int | None


@dataclass(frozen=True)
class PoolPlan:
    name: str
    size_kb: int
    pages: int  # pages the contract needs
    free: int  # free when validated


@dataclass(frozen=True)
class RdmaPlan:
    name: str
    device: str
    port: int


@dataclass(frozen=True)
class NvmePlan:
    name: str
    namespace: str


@dataclass(frozen=True)
class Plan:
    contract_id: str
    compute_profile: str
    threads: tuple[ThreadPlan, ...] = ()
    gpus: tuple[GpuPlan, ...] = ()
    pools: tuple[PoolPlan, ...] = ()
    rdma: tuple[RdmaPlan, ...] = ()
    nvme: tuple[NvmePlan, ...] = ()
    recovery_point: str = "latest"
    stateful_io: bool = False
    notes: tuple[str, ...] = field(default=())  # what the validator did (a hugepage allocation)

    def thread(self, name: str) -> ThreadPlan | None:
        return next((t for t in self.threads if t.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["threads"] = [{**t, "cpus": list(t["cpus"])} for t in d["threads"]]
        for k in ("gpus", "pools", "rdma", "nvme", "notes"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Back from `to_dict` (a message the link's validator has checked)."""
        return cls(
            contract_id=d["contract_id"],
            compute_profile=d["compute_profile"],
            threads=tuple(ThreadPlan(t["name"], tuple(t["cpus"]), t["tag"], t.get("numa_node")) for t in d["threads"]),
            gpus=tuple(GpuPlan(**g) for g in d.get("gpus", ())),
            pools=tuple(PoolPlan(**p) for p in d.get("pools", ())),
            rdma=tuple(RdmaPlan(**r) for r in d.get("rdma", ())),
            nvme=tuple(NvmePlan(**n) for n in d.get("nvme", ())),
            recovery_point=d.get("recovery_point", "latest"),
            stateful_io=bool(d.get("stateful_io", False)),
            notes=tuple(d.get("notes", ())),
        )
