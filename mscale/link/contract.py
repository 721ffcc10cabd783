"""Resource contracts and MSRP on the link (job -> agent, taken by mscale.daemon.contract.service):

    {"type": "contract", job_id, rank, plan: Plan.to_dict()}  when a contract's plan is in force
    {"type": "msrp", job_id, rank, gpus: {index: {bandwidth_bytes_per_s, matmul_flops, dtype,
     measured_at}}, mpus: {mpu_id: {flops_per_step, achieved_flops, memory_bytes}}}

Each field below is checked by (test, what it must be); every field of a row is required.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mscale.link.wire import (
    JOB_ID,
    MAX_GPU_INDEX,
    MAX_INT,
    MAX_MPUS,
    MAX_RANK,
    MPU_ID,
    Wire,
    is_int,
    is_num,
    is_text,
    need,
    no_unknown,
    obj,
)

CONTRACT, MSRP = "contract", "msrp"
MAX_PLAN_ROWS, MAX_PLAN_CPUS, MAX_CPU_INDEX = 64, 1024, 8191
_PLAN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_Check = tuple[Callable[[Any], bool], str]
_NAME: _Check = (lambda v: is_text(v, 1, 32, _PLAN_NAME), "1-32 of [A-Za-z0-9_.-]")
_NODE: _Check = (lambda v: v is None or is_int(v, 0, 1023), "null or a NUMA node 0..1023")
_COUNT: _Check = (is_int, f"an integer in 0..{MAX_INT}")
_AMOUNT: _Check = (lambda v: not isinstance(v, str) and is_num(v) and v is not None and v >= 0, "a finite number >= 0")
PLAN_TABLES: dict[str, dict[str, _Check]] = {
    "threads": {
        "name": _NAME,
        "cpus": (
            lambda v: (
                isinstance(v, list) and 0 < len(v) <= MAX_PLAN_CPUS and all(is_int(c, 0, MAX_CPU_INDEX) for c in v)
            ),
            f"1..{MAX_PLAN_CPUS} CPUs in 0..{MAX_CPU_INDEX}",
        ),
        "tag": (lambda v: is_text(v, 0, 15), "up to 15 printable characters"),
        "numa_node": _NODE,
    },
    "gpus": {
        "name": _NAME,
        "gpu_id": (lambda v: is_int(v, 0, MAX_GPU_INDEX - 1), "a GPU index"),
        "bdf": (lambda v: is_text(v, 12, 12, re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")), "a BDF"),
        "numa_node": _NODE,
    },
    "pools": {"name": _NAME, "size_kb": _COUNT, "pages": _COUNT, "free": _COUNT},
    "rdma": {"name": _NAME, "device": _NAME, "port": (lambda v: is_int(v, 0, 255), "a port 0..255")},
    "nvme": {"name": _NAME, "namespace": _NAME},
}
_ROWS: _Check = (lambda v: isinstance(v, list) and len(v) <= MAX_PLAN_ROWS, f"a list of at most {MAX_PLAN_ROWS}")
PLAN_FIELDS: dict[str, _Check] = {
    "contract_id": (lambda v: is_text(v, 12, 12, re.compile(r"[0-9a-f]{12}")), "12 hex digits"),
    "compute_profile": _NAME,
    "recovery_point": (lambda v: is_text(v, 1, 32, re.compile(r"latest|step_[0-9]{1,18}")), "latest or step_N"),
    "stateful_io": (lambda v: isinstance(v, bool), "a boolean"),
    "notes": (lambda v: isinstance(v, list) and len(v) <= 16 and all(is_text(n, 0, 300) for n in v), "short notes"),
    **{table: _ROWS for table in PLAN_TABLES},
}
MSRP_TABLES: dict[str, dict[str, _Check]] = {
    "gpus": {
        "bandwidth_bytes_per_s": _AMOUNT,
        "matmul_flops": _AMOUNT,
        "dtype": (lambda v: is_text(v, 1, 16, re.compile(r"[a-z0-9]{1,16}")), "1-16 of [a-z0-9]"),
        "measured_at": _AMOUNT,
    },
    "mpus": {"flops_per_step": _AMOUNT, "achieved_flops": _AMOUNT, "memory_bytes": _AMOUNT},
}
_RANK: _Check = (lambda v: is_int(v, 0, MAX_RANK), f"a rank in 0..{MAX_RANK}")
_HEAD: dict[str, _Check] = {
    "type": (lambda v: isinstance(v, str), "a string"),
    "job_id": (lambda v: isinstance(v, str) and bool(JOB_ID.fullmatch(v)), "1-128 of [A-Za-z0-9._:@/+-]"),
    "rank": _RANK,
}


def _fields(d: object, checks: Mapping[str, _Check], where: str, required: Iterable[str]) -> Mapping[str, Any]:
    """`d` an object of only these fields, the required ones present, each passing its check."""
    m = obj(d, f"{where} must be an object")
    no_unknown(m, frozenset(checks), where)
    for k in required:
        need(k in m, f"{where}.{k} is missing")
    for k, v in m.items():
        test, what = checks[k]
        need(test(v), f"{where}.{k} must be {what}")
    return m


@dataclass(frozen=True, slots=True)
class Contract:
    """A contract's plan in force on one rank (the fields `Plan.to_dict` writes, strictly)."""

    job_id: str
    rank: int
    plan: Mapping[str, Any]

    def to_wire(self) -> Wire:
        return {"type": CONTRACT, "job_id": self.job_id, "rank": self.rank, "plan": dict(self.plan)}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Contract:
        m = _fields(msg, {**_HEAD, "plan": (lambda v: isinstance(v, dict), "an object")}, "contract", ("rank", "plan"))
        plan = _fields(m["plan"], PLAN_FIELDS, "contract: plan", ("contract_id", "compute_profile"))
        for table, checks in PLAN_TABLES.items():
            for i, row in enumerate(plan.get(table, [])):
                _fields(row, checks, f"contract: plan.{table}[{i}]", checks)
        return cls(str(m.get("job_id", "")), int(m["rank"]), dict(plan))


@dataclass(frozen=True, slots=True)
class Msrp:
    """A job's MSRP: per GPU index its micro-probe results, per MPU its FLOP counts."""

    job_id: str
    rank: int
    gpus: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    mpus: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def to_wire(self) -> Wire:
        return {
            "type": MSRP,
            "job_id": self.job_id,
            "rank": self.rank,
            "gpus": {k: dict(v) for k, v in self.gpus.items()},
            "mpus": {k: dict(v) for k, v in self.mpus.items()},
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Msrp:
        """Numbers finite >= 0, GPU keys indexes, MPU keys MPU ids."""
        rows: _Check = (lambda v: isinstance(v, dict) and len(v) <= MAX_MPUS, f"an object of at most {MAX_MPUS}")
        m = _fields(msg, {**_HEAD, "gpus": rows, "mpus": rows}, "msrp", ("rank",))
        tables: dict[str, dict[str, Mapping[str, Any]]] = {}
        for table, checks in MSRP_TABLES.items():
            tables[table] = {}
            for key, row in m.get(table, {}).items():
                where = f"msrp: {table}[{str(key)[:20]!r}]"
                if table == "gpus":
                    need(isinstance(key, str) and key.isdigit() and int(key) < MAX_GPU_INDEX, f"{where}: a GPU index")
                else:
                    need(is_text(key, 1, 16, MPU_ID), f"{where}: an MPU id is 1-16 of [A-Za-z0-9._-]")
                tables[table][key] = dict(_fields(row, checks, where, ()))
        return cls(str(m.get("job_id", "")), int(m["rank"]), tables["gpus"], tables["mpus"])
