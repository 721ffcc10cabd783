"""Fixture hosts for the contract tests: small /sys and /proc trees written under a directory,
shaped like the real kernel's (the files a HostView reads, with the kernel's spellings).

  two_socket_smt   2 sockets x 4 cores x 2 SMT threads (CPUs i and i+8 are siblings; node 0
                   holds 0-3,8-11, node 1 4-7,12-15), 8 NVIDIA GPUs on two PCIe roots (0000:1b..1e
                   on node 0, 0000:81..84 on node 1), a non-NVIDIA VGA and an NVIDIA audio
                   function (neither a GPU), hugepages 2MB 1024/1024 and 1GB 4/4, NVMe nvme0n1
                   (partitions p1, p2) and nvme1n1, RDMA mlx5_0 (node 0) and mlx5_1 (node 1)
  isolcpus         the same with `isolcpus=domain,managed_irq,2-3,10-11` on the kernel command line
  short_hugepages  the same with only 2MB hugepages, 16 total and 2 free
"""

from __future__ import annotations

from pathlib import Path

NODE0_GPUS = ("0000:1b:00.0", "0000:1c:00.0", "0000:1d:00.0", "0000:1e:00.0")
NODE1_GPUS = ("0000:81:00.0", "0000:82:00.0", "0000:83:00.0", "0000:84:00.0")
CMDLINE = "BOOT_IMAGE=/vmlinuz-6.1.0 root=/dev/nvme0n1p2 ro quiet"


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")


def _cpulist(cpus: list[int]) -> str:
    from mscale.contracts.hardware import format_cpulist

    return format_cpulist(cpus)


def build(
    root: Path,
    *,
    cmdline: str = CMDLINE,
    hugepages: dict[int, tuple[int, int]] | None = None,
    sockets: int = 2,
    cores: int = 4,
    smt: int = 2,
) -> tuple[Path, Path]:
    """Write a host under root/sys and root/proc; (sys_root, proc_root)."""
    sys_root, proc_root = root / "sys", root / "proc"
    n = sockets * cores * smt
    per_thread = sockets * cores  # CPU c and c + per_thread are SMT siblings
    _w(sys_root / "devices/system/cpu/online", f"0-{n - 1}")
    _w(sys_root / "devices/system/cpu/isolated", "")
    nodes: dict[int, list[int]] = {s: [] for s in range(sockets)}
    for c in range(n):
        phys = c % per_thread
        socket, core = phys // cores, phys % cores
        siblings = [phys + k * per_thread for k in range(smt)]
        topo = sys_root / f"devices/system/cpu/cpu{c}/topology"
        _w(topo / "physical_package_id", str(socket))
        _w(topo / "core_id", str(core))
        _w(topo / "thread_siblings_list", _cpulist(siblings))
        nodes[socket].append(c)
    for node, cpus in nodes.items():
        _w(sys_root / f"devices/system/node/node{node}/cpulist", _cpulist(cpus))
    _w(sys_root / "devices/system/node/online", f"0-{sockets - 1}")
    for size, (total, free) in (hugepages or {2048: (1024, 1024), 1048576: (4, 4)}).items():
        base = sys_root / f"kernel/mm/hugepages/hugepages-{size}kB"
        _w(base / "nr_hugepages", str(total))
        _w(base / "free_hugepages", str(free))
    pci = sys_root / "bus/pci/devices"
    for node, bdfs in ((0, NODE0_GPUS), (1, NODE1_GPUS)):
        for bdf in bdfs:
            _w(pci / bdf / "vendor", "0x10de")
            _w(pci / bdf / "class", "0x030200")
            _w(pci / bdf / "numa_node", str(node))
    _w(pci / "0000:03:00.0/vendor", "0x1a03")  # a BMC's VGA: not a GPU
    _w(pci / "0000:03:00.0/class", "0x030000")
    _w(pci / "0000:1b:00.1/vendor", "0x10de")  # the GPU's HDMI audio function: not a GPU
    _w(pci / "0000:1b:00.1/class", "0x040300")
    block = sys_root / "block"
    for ns, parts in (("nvme0n1", ("nvme0n1p1", "nvme0n1p2")), ("nvme1n1", ())):
        _w(block / ns / "size", "7501476528")
        for p in parts:
            _w(block / ns / p / "partition", p[-1])
    _w(block / "loop0/size", "0")
    ib = sys_root / "class/infiniband"
    for dev, node in (("mlx5_0", 0), ("mlx5_1", 1)):
        _w(ib / dev / "ports/1/state", "4: ACTIVE")
        _w(ib / dev / "device/numa_node", str(node))
    _w(proc_root / "cmdline", cmdline)
    return sys_root, proc_root


def two_socket_smt(root: Path) -> tuple[Path, Path]:
    return build(root)


def isolcpus(root: Path) -> tuple[Path, Path]:
    return build(root, cmdline=CMDLINE + " isolcpus=domain,managed_irq,2-3,10-11 nohz_full=2-3,10-11")


def short_hugepages(root: Path) -> tuple[Path, Path]:
    return build(root, hugepages={2048: (16, 2)})
