"""The host as a contract sees it, read from /sys and /proc under injectable roots.

`read_host(sys_root="/sys", proc_root="/proc", pci=None)` returns a `HostView`: online CPUs
with their package, core and SMT siblings; the cores `isolcpus=` isolates (kernel command line,
and /sys/devices/system/cpu/isolated); NUMA nodes and their CPUs (one node 0 holding every
online CPU when the kernel shows none); free and total hugepages per size; GPUs by PCI BDF
(from NVML where it answers, else PCI class 0x0300/0x0302 with vendor 0x10de under
/sys/bus/pci); NVMe namespaces and their partitions; RDMA devices and their ports.

Reading never changes anything and never raises on what a host lacks: a missing directory is
an empty table, an unreadable file is noted in `HostView.notes`. Every table is bounded
(MAX_ENTRIES), so a hostile or broken tree cannot make the view unbounded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

MAX_CPUS = 8192
MAX_ENTRIES = 4096  # PCI devices, block devices, RDMA ports read at most
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0302", "0x0300")  # 3D controller, VGA controller (class code's top 16 bits)
BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class PciSource(Protocol):
    """What the view asks NVML: the GPUs in NVML's order and each one's PCI bus id."""

    def device_count(self) -> int: ...
    def pci_bus_id(self, gpu: int) -> str: ...


@dataclass(frozen=True)
class Cpu:
    cpu: int
    package: int
    core: int
    siblings: tuple[int, ...]  # SMT siblings, itself included
    numa_node: int


@dataclass(frozen=True)
class HugePages:
    size_kb: int
    total: int
    free: int


@dataclass(frozen=True)
class Gpu:
    index: int
    bdf: str  # 0000:81:00.0, domain always 4 hex digits, lower case
    numa_node: int | None  # None: the kernel does not say


@dataclass(frozen=True)
class BlockDevice:
    name: str
    kind: str  # "namespace" or "partition"
    parent: str  # the namespace of a partition, "" for a namespace


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    ports: dict[int, str]  # port -> state ("ACTIVE", "DOWN", ...)
    numa_node: int | None


@dataclass(frozen=True)
class HostView:
    cpus: dict[int, Cpu]
    isolated: frozenset[int]
    numa_nodes: dict[int, frozenset[int]]
    hugepages: dict[int, HugePages]  # size in kB -> pages
    gpus: tuple[Gpu, ...]
    nvme: dict[str, BlockDevice]
    rdma: dict[str, RdmaDevice]
    gpu_source: str = "sysfs"  # "nvml" or "sysfs"
    notes: tuple[str, ...] = field(default=())

    def gpu(self, index: int) -> Gpu | None:
        return next((g for g in self.gpus if g.index == index), None)

    def node_of_cpu(self, cpu: int) -> int | None:
        c = self.cpus.get(cpu)
        return c.numa_node if c is not None else None


def parse_cpulist(text: str, *, limit: int = MAX_CPUS) -> frozenset[int]:
    """'0-3,8,10-11' -> {0,1,2,3,8,10,11}; ValueError on anything else or a CPU >= limit."""
    out: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text[:80]!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if a > b or b >= limit:
            raise ValueError(f"CPU range {part!r} out of 0..{limit - 1}")
        out.update(range(a, b + 1))
    return frozenset(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """{0,1,2,5} -> '0-2,5' (the kernel's spelling)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def normalize_bdf(text: str) -> str | None:
    """A PCI address with its domain as 4 hex digits, lower case ('00000000:81:00.0' from NVML
    -> '0000:81:00.0'); None when `text` is not a full BDF (domain included)."""
    m = BDF.match(text.strip())
    if m is None:
        return None
    domain = int(m.group(1), 16)
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


class _Reader:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.notes: list[str] = []

    def text(self, rel: str) -> str | None:
        try:
            with open(self.root / rel, encoding="utf-8", errors="replace") as f:
                return f.read(65536)
        except FileNotFoundError:
            return None
        except OSError as e:
            self.notes.append(f"{rel}: {e.strerror or e}")
            return None

    def integer(self, rel: str) -> int | None:
        t = self.text(rel)
        if t is None:
            return None
        try:
            return int(t.strip(), 0)
        except ValueError:
            self.notes.append(f"{rel}: not an integer: {t.strip()[:40]!r}")
            return None

    def cpulist(self, rel: str) -> frozenset[int] | None:
        t = self.text(rel)
        if t is None:
            return None
        try:
            return parse_cpulist(t)
        except ValueError as e:
            self.notes.append(f"{rel}: {e}")
            return None

    def listdir(self, rel: str) -> list[str]:
        try:
            names = sorted(os.listdir(self.root / rel))
        except FileNotFoundError:
            return []
        except OSError as e:
            self.notes.append(f"{rel}: {e.strerror or e}")
            return []
        if len(names) > MAX_ENTRIES:
            self.notes.append(f"{rel}: {len(names)} entries, read the first {MAX_ENTRIES}")
        return names[:MAX_ENTRIES]


_NODE = re.compile(r"^node([0-9]{1,4})$")
_CPU = re.compile(r"^cpu([0-9]{1,5})$")
_HUGE = re.compile(r"^hugepages-([0-9]{1,9})kB$")
_NVME_NS = re.compile(r"^nvme[0-9]{1,4}n[0-9]{1,4}$")
_NVME_PART = re.compile(r"^(nvme[0-9]{1,4}n[0-9]{1,4})p[0-9]{1,4}$")


def isolcpus_from_cmdline(cmdline: str) -> frozenset[int]:
    """The CPUs `isolcpus=` names: 'isolcpus=domain,managed_irq,2-3' -> {2, 3} (flags skipped)."""
    out: set[int] = set()
    for word in cmdline.split():
        if not word.startswith("isolcpus="):
            continue
        spec = [p for p in word.removeprefix("isolcpus=").split(",") if p and (p[0].isdigit())]
        out |= parse_cpulist(",".join(spec))
    return frozenset(out)


def _numa(r: _Reader, online: frozenset[int]) -> dict[int, frozenset[int]]:
    nodes: dict[int, frozenset[int]] = {}
    for name in r.listdir("devices/system/node"):
        m = _NODE.match(name)
        if m:
            cpus = r.cpulist(f"devices/system/node/{name}/cpulist")
            nodes[int(m.group(1))] = (cpus or frozenset()) & online
    return nodes or {0: online}


def _cpus(r: _Reader) -> tuple[dict[int, Cpu], dict[int, frozenset[int]]]:
    online = r.cpulist("devices/system/cpu/online")
    if online is None:
        online = frozenset(int(m.group(1)) for n in r.listdir("devices/system/cpu") if (m := _CPU.match(n)))
    nodes = _numa(r, online)
    node_of = {c: n for n, cs in nodes.items() for c in cs}
    cpus = {}
    for c in sorted(online):
        base = f"devices/system/cpu/cpu{c}/topology"
        siblings = r.cpulist(f"{base}/thread_siblings_list") or frozenset({c})
        cpus[c] = Cpu(
            cpu=c,
            package=r.integer(f"{base}/physical_package_id") or 0,
            core=r.integer(f"{base}/core_id") or 0,
            siblings=tuple(sorted(siblings)),
            numa_node=node_of.get(c, 0),
        )
    return cpus, nodes


def _hugepages(r: _Reader) -> dict[int, HugePages]:
    out = {}
    for name in r.listdir("kernel/mm/hugepages"):
        m = _HUGE.match(name)
        if m:
            base = f"kernel/mm/hugepages/{name}"
            size = int(m.group(1))
            out[size] = HugePages(
                size, r.integer(f"{base}/nr_hugepages") or 0, r.integer(f"{base}/free_hugepages") or 0
            )
    return out


def _numa_node(r: _Reader, rel: str) -> int | None:
    n = r.integer(rel)
    return n if n is not None and n >= 0 else None


def _gpus_sysfs(r: _Reader) -> list[tuple[str, int | None]]:
    found = []
    for name in r.listdir("bus/pci/devices"):
        bdf = normalize_bdf(name)
        if bdf is None:
            continue
        base = f"bus/pci/devices/{name}"
        if (r.text(f"{base}/vendor") or "").strip().lower() != NVIDIA_VENDOR:
            continue  # most of the bus: one read each
        if (r.text(f"{base}/class") or "").strip().lower()[:6] in GPU_CLASSES:
            found.append((bdf, _numa_node(r, f"{base}/numa_node")))
    return found


def _gpus(r: _Reader, pci: PciSource | None) -> tuple[tuple[Gpu, ...], str]:
    sysfs = _gpus_sysfs(r)
    node_of = dict(sysfs)
    if pci is not None:
        try:
            bdfs = [normalize_bdf(pci.pci_bus_id(i)) for i in range(min(pci.device_count(), MAX_ENTRIES))]
        except Exception as e:  # NVML's errors are its own types: the sysfs view stands
            r.notes.append(f"nvml: {type(e).__name__}: {e}"[:200])
        else:
            gpus = tuple(Gpu(i, b, node_of.get(b)) for i, b in enumerate(bdfs) if b is not None)
            return gpus, "nvml"
    # without NVML: the PCI bus order, which is NVML's and CUDA_DEVICE_ORDER=PCI_BUS_ID's
    return tuple(Gpu(i, b, n) for i, (b, n) in enumerate(sorted(sysfs))), "sysfs"


def _nvme(r: _Reader) -> dict[str, BlockDevice]:
    out: dict[str, BlockDevice] = {}
    for name in r.listdir("block"):
        if not _NVME_NS.match(name):
            continue
        out[name] = BlockDevice(name, "namespace", "")
        for sub in r.listdir(f"block/{name}"):
            m = _NVME_PART.match(sub)
            if m and m.group(1) == name:
                out[sub] = BlockDevice(sub, "partition", name)
    return out


def _rdma(r: _Reader) -> dict[str, RdmaDevice]:
    out = {}
    for dev in r.listdir("class/infiniband"):
        ports = {}
        for p in r.listdir(f"class/infiniband/{dev}/ports"):
            if p.isdigit() and len(p) <= 3:
                state = (r.text(f"class/infiniband/{dev}/ports/{p}/state") or "").strip()
                ports[int(p)] = state.partition(":")[2].strip() or state or "UNKNOWN"  # "4: ACTIVE"
        out[dev] = RdmaDevice(dev, ports, _numa_node(r, f"class/infiniband/{dev}/device/numa_node"))
    return out


def read_host(
    sys_root: str | os.PathLike = "/sys", proc_root: str | os.PathLike = "/proc", pci: PciSource | None = None
) -> HostView:
    """The host under `sys_root` and `proc_root`; `pci` answers for NVML where it is there."""
    r = _Reader(Path(sys_root))
    cpus, nodes = _cpus(r)
    cmdline = _Reader(Path(proc_root)).text("cmdline") or ""
    try:
        isolated = isolcpus_from_cmdline(cmdline)
    except ValueError as e:
        r.notes.append(f"cmdline isolcpus: {e}")
        isolated = frozenset()
    isolated |= r.cpulist("devices/system/cpu/isolated") or frozenset()
    gpus, source = _gpus(r, pci)
    return HostView(
        cpus=cpus,
        isolated=isolated,
        numa_nodes=nodes,
        hugepages=_hugepages(r),
        gpus=gpus,
        nvme=_nvme(r),
        rdma=_rdma(r),
        gpu_source=source,
        notes=tuple(r.notes),
    )


class NvmlPci:
    """PciSource over nvidia-ml-py, for a process that has NVML (the job on a GPU node)."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def pci_bus_id(self, gpu: int) -> str:
        info = self._nvml.nvmlDeviceGetPciInfo(self._nvml.nvmlDeviceGetHandleByIndex(gpu))
        bus = info.busId
        return bus.decode() if isinstance(bus, bytes) else str(bus)


if TYPE_CHECKING:  # the real adapter speaks the protocol the view (and its tests) use
    _REAL: type[PciSource] = NvmlPci


def nvml_pci(opener: Callable[[], PciSource] = NvmlPci) -> PciSource | None:
    """NVML's PCI view, or None where there is no NVML (no library, no driver, no GPU)."""
    try:
        return opener()
    except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded...
        return None
