"""What a contract says, its error codes, and the catalogue of compute profiles.

A contract (the arguments of `mscale.contract(...)`, or a JSON/YAML/TOML file for
`mscale contract check FILE`):

    compute_profile  a profile of the catalogue (profiles.yaml): the compute density the
                     job's MPUs are expected to reach
    io_topology      {name: entry}; an entry may hold
                       cpu_cores     [int]   the CPUs its thread (or data-loader workers) run on
                       numa_node     int     the node those cores, its GPU, RDMA device are on
                       gpu_id        int     a GPU index (NVML's order)
                       pcie_domain   str     the GPU's PCI domain:bus ("0000:81"), or its BDF
                       rdma_port     str     "mlx5_0" (port 1) or "mlx5_0/2"
                       memory_pool   str     "hugepage_2MB" or "hugepage_1GB"
                       hugepages     int     pages the pool needs free (default 1)
                       nvme          str     an NVMe namespace ("nvme0n1")
                     The entry named "main" is the training process's main thread; no other
                     entry touches it.
    fault_tolerance  {"recovery_point": "step_128" | "latest", "stateful_io": bool}

Every refusal carries a `Code`, stable across releases (scripts and runbooks key on them).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any

MAX_ENTRIES = 64  # named entries in io_topology
MAX_CORES = 1024  # cores one entry may name
MAX_CPU = 8191
MAX_GPU = 4095
MAX_HUGEPAGES = 1 << 24
NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
MAIN = "main"
ENTRY_KEYS = frozenset(
    {"cpu_cores", "numa_node", "gpu_id", "pcie_domain", "rdma_port", "memory_pool", "hugepages", "nvme"}
)
FAULT_KEYS = frozenset({"recovery_point", "stateful_io"})
POOLS = {"hugepage_2MB": 2048, "hugepage_1GB": 1048576}
RECOVERY_POINT = re.compile(r"latest|step_[0-9]{1,18}")


class Code(StrEnum):
    """Why a contract is refused. The values are stable: scripts and runbooks key on them."""

    MALFORMED = "malformed"  # a field of the wrong type or range, an unknown key
    PROFILE_UNKNOWN = "profile_unknown"  # compute_profile not in the catalogue
    CORE_UNKNOWN = "core_unknown"  # a CPU that is not online here
    CORE_ISOLATED = "core_isolated"  # a CPU isolcpus= takes away from the scheduler
    CORE_NOT_ALLOWED = "core_not_allowed"  # online, but outside the process's CPU set (cgroup cpuset, taskset)
    CORE_NUMA = "core_numa"  # a CPU on another NUMA node than the entry's
    CORE_SHARED = "core_shared"  # two entries pinned to the same CPU
    NUMA_UNKNOWN = "numa_unknown"  # a NUMA node the host does not have
    GPU_UNKNOWN = "gpu_unknown"  # a GPU index the host does not have
    BDF_NO_DOMAIN = "bdf_no_domain"  # pcie_domain written without its PCI domain ("81:00.0")
    GPU_BUS = "gpu_bus"  # the GPU is not at the PCI address the entry names
    GPU_NUMA = "gpu_numa"  # the GPU sits on another NUMA node than the entry's
    HUGEPAGE_SIZE = "hugepage_size"  # a pool size the kernel does not offer
    HUGEPAGES_SHORT = "hugepages_short"  # fewer free hugepages than the pool needs
    NVME_UNKNOWN = "nvme_unknown"  # no such NVMe namespace
    NVME_PARTITION = "nvme_partition"  # a partition where a namespace is meant
    RDMA_PORT_UNKNOWN = "rdma_port_unknown"  # no such RDMA device or port
    RDMA_NUMA = "rdma_numa"  # the RDMA device sits on another NUMA node than the entry's


@dataclass(frozen=True)
class Problem:
    code: Code
    where: str  # "io_topology.image_loader.cpu_cores"
    message: str  # what is wrong and what to change

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.where}: {self.message}"

    def to_dict(self) -> dict:
        return {"code": self.code.value, "where": self.where, "message": self.message}


class ContractRefused(ValueError):
    """The contract cannot run on this host (or is malformed): every problem, each with its code."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        lines = "\n  ".join(map(str, self.problems))
        super().__init__(f"contract refused ({len(self.problems)} problem(s)):\n  {lines}")

    @property
    def codes(self) -> list[Code]:
        return [p.code for p in self.problems]


@dataclass(frozen=True)
class Profile:
    name: str
    density_tflops_per_gb: float  # achieved TFLOP/s per GB of the MPU's memory, expected
    description: str


@functools.cache
def profiles() -> dict[str, Profile]:
    """The catalogue (mscale/contracts/profiles.yaml), validated: a bad line stops here."""
    import yaml

    text = resources.files("mscale.contracts").joinpath("profiles.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or not data:
        raise ValueError("profiles.yaml: expected a mapping of profile name -> {density_tflops_per_gb, description}")
    out = {}
    for name, d in data.items():
        ok = (
            isinstance(name, str)
            and NAME.fullmatch(name)
            and isinstance(d, dict)
            and set(d) == {"density_tflops_per_gb", "description"}
            and isinstance(d["density_tflops_per_gb"], (int, float))
            and math.isfinite(d["density_tflops_per_gb"])
            and d["density_tflops_per_gb"] > 0
        )
        if not ok:
            raise ValueError(f"profiles.yaml: profile {name!r}: expected density_tflops_per_gb > 0 and a description")
        out[name] = Profile(name, float(d["density_tflops_per_gb"]), str(d["description"]))
    return out


@dataclass(frozen=True)
class Entry:
    name: str
    cpu_cores: tuple[int, ...] = ()
    numa_node: int | None = None
    gpu_id: int | None = None
    pcie_domain: str | None = None
    rdma_port: str | None = None
    memory_pool: str | None = None
    hugepages: int = 1
    nvme: str | None = None


@dataclass(frozen=True)
class Contract:
    compute_profile: str
    io_topology: tuple[Entry, ...] = ()
    recovery_point: str = "latest"
    stateful_io: bool = False
    source: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def contract_id(self) -> str:
        """12 hex digits of the canonical JSON: the same contract has the same id anywhere."""
        blob = json.dumps(self.source, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def entry(self, name: str) -> Entry | None:
        return next((e for e in self.io_topology if e.name == name), None)


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def parse(compute_profile: Any, io_topology: Any = None, fault_tolerance: Any = None) -> Contract:
    """A Contract from the decorator's arguments; ContractRefused (MALFORMED, PROFILE_UNKNOWN)
    naming every field at fault."""
    problems: list[Problem] = []

    def bad(where: str, message: str, code: Code = Code.MALFORMED) -> None:
        problems.append(Problem(code, where, message))

    if not isinstance(compute_profile, str) or not NAME.fullmatch(compute_profile):
        bad("compute_profile", f"expected a profile name, got {str(compute_profile)[:40]!r}")
    elif compute_profile not in profiles():
        bad(
            "compute_profile",
            f"{compute_profile!r} is not a known profile; use one of {', '.join(sorted(profiles()))}",
            Code.PROFILE_UNKNOWN,
        )
    topo = {} if io_topology is None else io_topology
    entries: list[Entry] = []
    if not isinstance(topo, dict) or len(topo) > MAX_ENTRIES:
        bad("io_topology", f"expected a mapping of at most {MAX_ENTRIES} named entries")
        topo = {}
    for name, spec in topo.items():
        where = f"io_topology.{str(name)[:32]}"
        if not isinstance(name, str) or not NAME.fullmatch(name):
            bad(where, "an entry name is 1-32 of [A-Za-z0-9_.-]")
            continue
        if not isinstance(spec, dict):
            bad(where, "expected a mapping of settings")
            continue
        unknown = sorted(str(k)[:32] for k in spec if k not in ENTRY_KEYS)
        if unknown:
            bad(where, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(ENTRY_KEYS))}")
            continue
        entry = _entry(name, spec, where, bad)
        if entry is not None:
            entries.append(entry)
    ft = {} if fault_tolerance is None else fault_tolerance
    if not isinstance(ft, dict):
        bad("fault_tolerance", "expected a mapping")
        ft = {}
    unknown = sorted(str(k)[:32] for k in ft if k not in FAULT_KEYS)
    if unknown:
        bad("fault_tolerance", f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(FAULT_KEYS))}")
    rp = ft.get("recovery_point", "latest")
    if not isinstance(rp, str) or not RECOVERY_POINT.fullmatch(rp):
        bad("fault_tolerance.recovery_point", f"expected 'latest' or 'step_N', got {str(rp)[:40]!r}")
    sio = ft.get("stateful_io", False)
    if not isinstance(sio, bool):
        bad("fault_tolerance.stateful_io", f"expected true or false, got {str(sio)[:40]!r}")
    if problems:
        raise ContractRefused(problems)
    source = {"compute_profile": compute_profile, "io_topology": topo, "fault_tolerance": ft}
    return Contract(compute_profile, tuple(entries), rp, sio, json.loads(json.dumps(source)))


def _entry(name: str, spec: dict, where: str, bad: Any) -> Entry | None:
    ok = True

    def check(cond: bool, key: str, message: str) -> None:
        nonlocal ok
        if not cond:
            ok = False
            bad(f"{where}.{key}", message)

    cores = spec.get("cpu_cores", [])
    check(
        isinstance(cores, list) and 0 < len(cores) <= MAX_CORES and all(_is_int(c, 0, MAX_CPU) for c in cores)
        if "cpu_cores" in spec
        else True,
        "cpu_cores",
        f"expected a list of 1..{MAX_CORES} CPU numbers in 0..{MAX_CPU}",
    )
    if ok and len(set(cores)) != len(cores):
        check(False, "cpu_cores", "a CPU is listed twice")
    for key, hi in (("numa_node", 1023), ("gpu_id", MAX_GPU)):
        if key in spec:
            check(_is_int(spec[key], 0, hi), key, f"expected an integer in 0..{hi}")
    for key in ("pcie_domain", "rdma_port", "nvme"):
        if key in spec:
            check(
                isinstance(spec[key], str) and 0 < len(spec[key]) <= 64 and spec[key].isprintable(),
                key,
                "expected a string",
            )
    if "memory_pool" in spec:
        check(spec["memory_pool"] in POOLS, "memory_pool", f"expected one of {', '.join(POOLS)}")
    if "hugepages" in spec:
        check(_is_int(spec["hugepages"], 1, MAX_HUGEPAGES), "hugepages", f"expected an integer in 1..{MAX_HUGEPAGES}")
        if "memory_pool" not in spec:
            check(False, "hugepages", "give memory_pool too (the page size)")
    if "pcie_domain" in spec and "gpu_id" not in spec:
        check(False, "pcie_domain", "give gpu_id too (the GPU that sits at that address)")
    if name == MAIN and "cpu_cores" not in spec:
        check(False, "cpu_cores", "the main entry pins the main thread: name its cpu_cores")
    if not ok:
        return None
    return Entry(
        name=name,
        cpu_cores=tuple(cores),
        numa_node=spec.get("numa_node"),
        gpu_id=spec.get("gpu_id"),
        pcie_domain=spec.get("pcie_domain"),
        rdma_port=spec.get("rdma_port"),
        memory_pool=spec.get("memory_pool"),
        hugepages=spec.get("hugepages", 1),
        nvme=spec.get("nvme"),
    )


def load_file(path: str | Path) -> Contract:
    """A contract file (.json, .yaml/.yml, .toml) holding compute_profile, io_topology and
    fault_tolerance; ContractRefused (MALFORMED) when it cannot be read or parsed."""
    from mscale.textfile import read_text

    p = Path(path)

    def refuse(message: str) -> ContractRefused:
        return ContractRefused([Problem(Code.MALFORMED, str(p), message)])

    class _Unreadable(ValueError):
        pass

    try:
        text = read_text(p, _Unreadable, "contract")
    except _Unreadable as e:
        raise refuse(str(e)) from None
    try:
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # each parser has its own error type; all mean "not readable"
        raise refuse(f"not valid {p.suffix.lstrip('.') or 'JSON'}: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise refuse("expected a mapping with compute_profile, io_topology, fault_tolerance")
    unknown = sorted(str(k)[:32] for k in data if k not in ("compute_profile", "io_topology", "fault_tolerance"))
    if unknown:
        raise refuse(f"unknown key(s) {', '.join(unknown)}")
    return parse(data.get("compute_profile"), data.get("io_topology"), data.get("fault_tolerance"))
