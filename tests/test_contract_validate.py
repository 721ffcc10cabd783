"""Resource contracts against fixture hosts and the real one: the hardware view, every refusal
code with its advice, the plan, nothing changed on the host, and `mscale contract check`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mscale.contracts.hardware import format_cpulist, parse_cpulist, read_host
from mscale.contracts.spec import Code, ContractRefused, load_file, parse
from mscale.contracts.validate import validate
from mscale.link import BadMessage, Contract
from support import REPO, hosts

EXAMPLE = {  # the issue's example, on the two-socket host
    "compute_profile": "mlvm-heavy",
    "io_topology": {
        "image_loader": {"cpu_cores": [2, 3], "numa_node": 0},
        "patch_embed": {"gpu_id": 4, "pcie_domain": "0000:81", "numa_node": 1},
        "rdma_cache": {"rdma_port": "mlx5_0", "memory_pool": "hugepage_2MB", "hugepages": 512},
    },
    "fault_tolerance": {"recovery_point": "step_128", "stateful_io": True},
}


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def check(root: Path, io_topology: dict, profile: str = "balanced", **kw):
    sys_root, proc_root = root / "sys", root / "proc"
    contract = parse(profile, io_topology, kw.pop("fault_tolerance", None))
    return validate(contract, read_host(sys_root, proc_root), sys_root=sys_root, proc_root=proc_root, **kw)


def refused(root: Path, io_topology: dict, profile: str = "balanced", **kw) -> ContractRefused:
    with pytest.raises(ContractRefused) as e:
        check(root, io_topology, profile, **kw)
    return e.value


@pytest.fixture
def smt(tmp_path: Path) -> Path:
    hosts.two_socket_smt(tmp_path)
    return tmp_path


@pytest.fixture
def isolated(tmp_path: Path) -> Path:
    hosts.isolcpus(tmp_path)
    return tmp_path


@pytest.fixture
def short(tmp_path: Path) -> Path:
    hosts.short_hugepages(tmp_path)
    return tmp_path


# --- the hardware view -------------------------------------------------------------------


def test_two_socket_smt_host_is_read_as_the_kernel_shows_it(smt: Path) -> None:
    host = read_host(smt / "sys", smt / "proc")
    assert sorted(host.cpus) == list(range(16)) and not host.notes
    assert host.cpus[0].siblings == (0, 8) and host.cpus[13].siblings == (5, 13)
    assert host.cpus[5].package == 1 and host.cpus[5].core == 1 and host.cpus[5].numa_node == 1
    assert host.numa_nodes == {0: parse_cpulist("0-3,8-11"), 1: parse_cpulist("4-7,12-15")}
    assert host.isolated == frozenset()
    assert [(g.index, g.bdf, g.numa_node) for g in host.gpus] == [
        (i, bdf, 0 if i < 4 else 1) for i, bdf in enumerate(hosts.NODE0_GPUS + hosts.NODE1_GPUS)
    ]  # the BMC's VGA and the GPU's audio function are not GPUs
    assert host.gpu_source == "sysfs"
    assert {s: (p.total, p.free) for s, p in host.hugepages.items()} == {2048: (1024, 1024), 1048576: (4, 4)}
    assert {n: (d.kind, d.parent) for n, d in host.nvme.items()} == {
        "nvme0n1": ("namespace", ""),
        "nvme0n1p1": ("partition", "nvme0n1"),
        "nvme0n1p2": ("partition", "nvme0n1"),
        "nvme1n1": ("namespace", ""),
    }
    assert {n: (d.ports, d.numa_node) for n, d in host.rdma.items()} == {
        "mlx5_0": ({1: "ACTIVE"}, 0),
        "mlx5_1": ({1: "ACTIVE"}, 1),
    }


def test_isolcpus_on_the_kernel_command_line_isolates_those_cores(isolated: Path) -> None:
    host = read_host(isolated / "sys", isolated / "proc")
    assert host.isolated == frozenset({2, 3, 10, 11})  # flags (domain, managed_irq) skipped


def test_gpus_come_from_nvml_where_it_answers_in_its_order(smt: Path) -> None:
    class Pci:  # the two calls the view makes of NVML, as NVML spells bus ids
        def device_count(self) -> int:
            return 2

        def pci_bus_id(self, gpu: int) -> str:
            return ["00000000:82:00.0", "00000000:1B:00.0"][gpu]

    host = read_host(smt / "sys", smt / "proc", Pci())
    assert host.gpu_source == "nvml"
    assert [(g.index, g.bdf, g.numa_node) for g in host.gpus] == [(0, "0000:82:00.0", 1), (1, "0000:1b:00.0", 0)]


def test_the_real_tree_of_this_machine_parses() -> None:
    host = read_host("/sys", "/proc")
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert set(host.cpus) == online and online
    assert set().union(*host.numa_nodes.values()) == online
    assert all(c.cpu in c.siblings for c in host.cpus.values())
    assert host.notes == ()  # every file it read parsed, none was unreadable


def test_cpulists_round_trip_and_bad_ones_are_refused() -> None:
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    for bad in ("0-", "a", "3-1", "99999"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


# --- the plan ------------------------------------------------------------------------------


def test_the_issues_example_becomes_a_plan(smt: Path) -> None:
    before = tree_digest(smt)
    plan = check(smt, EXAMPLE["io_topology"], EXAMPLE["compute_profile"], fault_tolerance=EXAMPLE["fault_tolerance"])
    (loader,) = plan.threads
    assert (loader.name, loader.cpus, loader.tag) == ("image_loader", (2, 3), "msc0:image_load")
    assert [(g.name, g.gpu_id, g.bdf, g.numa_node) for g in plan.gpus] == [("patch_embed", 4, "0000:81:00.0", 1)]
    assert [(p.size_kb, p.pages, p.free) for p in plan.pools] == [(2048, 512, 1024)]
    assert [(r.device, r.port) for r in plan.rdma] == [("mlx5_0", 1)]
    assert (plan.recovery_point, plan.stateful_io) == ("step_128", True)
    assert tree_digest(smt) == before  # reading and planning change nothing
    Contract.from_wire({"type": "contract", "job_id": "j", "rank": 0, "plan": plan.to_dict()})
    same = parse(**EXAMPLE)
    assert plan.contract_id == same.contract_id and len(plan.contract_id) == 12


# --- every refusal code -------------------------------------------------------------------

CASES = {
    Code.MALFORMED: ("smt", {"l": {"cpu_cores": "2"}}, "expected a list of 1..1024 CPU numbers"),
    Code.PROFILE_UNKNOWN: ("smt", {}, "use one of"),
    Code.CORE_UNKNOWN: ("smt", {"l": {"cpu_cores": [64]}}, "online: 0-15"),
    Code.CORE_ISOLATED: ("isolated", {"l": {"cpu_cores": [1, 2]}}, "pick from 0-1,4-9,12-15"),
    Code.CORE_NOT_ALLOWED: ("smt", {"l": {"cpu_cores": [0, 5]}}, "CPU 5 is outside this process's CPU set (0-3:"),
    Code.CORE_NUMA: ("smt", {"l": {"cpu_cores": [4], "numa_node": 0}}, "use CPUs of node 0 (0-3,8-11)"),
    Code.CORE_SHARED: ("smt", {"a": {"cpu_cores": [1]}, "b": {"cpu_cores": [1]}}, "also a's"),
    Code.NUMA_UNKNOWN: ("smt", {"l": {"cpu_cores": [1], "numa_node": 5}}, "nodes: 0, 1"),
    Code.GPU_UNKNOWN: ("smt", {"g": {"gpu_id": 9}}, "7=0000:84:00.0"),
    Code.BDF_NO_DOMAIN: ("smt", {"g": {"gpu_id": 4, "pcie_domain": "81:00.0"}}, "'0000:81'"),
    Code.GPU_BUS: ("smt", {"g": {"gpu_id": 0, "pcie_domain": "0000:81"}}, "GPU 4 is at 0000:81:00.0"),
    Code.GPU_NUMA: ("smt", {"g": {"gpu_id": 4, "numa_node": 0}}, "GPUs 0, 1, 2, 3 are on node 0"),
    Code.HUGEPAGE_SIZE: ("short", {"p": {"memory_pool": "hugepage_1GB"}}, "sizes: 2048kB"),
    Code.HUGEPAGES_SHORT: ("short", {"p": {"memory_pool": "hugepage_2MB", "hugepages": 8}}, "echo 22 >"),
    Code.NVME_UNKNOWN: ("smt", {"d": {"nvme": "nvme7n1"}}, "namespaces: nvme0n1, nvme1n1"),
    Code.NVME_PARTITION: ("smt", {"d": {"nvme": "/dev/nvme0n1p2"}}, "name the namespace ('nvme0n1')"),
    Code.RDMA_PORT_UNKNOWN: ("smt", {"r": {"rdma_port": "mlx5_0/2"}}, "ports: mlx5_0/1, mlx5_1/1"),
    Code.RDMA_NUMA: ("smt", {"r": {"rdma_port": "mlx5_1", "numa_node": 0}}, "mlx5_1 is on NUMA node 1"),
}


def test_every_code_has_a_case() -> None:
    assert set(CASES) == set(Code)


@pytest.mark.parametrize("code", list(CASES), ids=str)
def test_refusal_code_and_what_to_change(code: Code, request: pytest.FixtureRequest) -> None:
    fixture, topo, advice = CASES[code]
    root = request.getfixturevalue(fixture)
    before = tree_digest(root)
    profile = "no-such-profile" if code is Code.PROFILE_UNKNOWN else "balanced"
    # a job confined to CPUs 0-3 (a cgroup cpuset); None for the others: no such check
    allowed = {0, 1, 2, 3} if code is Code.CORE_NOT_ALLOWED else None
    e = refused(root, topo, profile, allowed_cpus=allowed)
    assert e.codes == [code], str(e)
    assert advice in e.problems[0].message, e.problems[0].message
    assert tree_digest(root) == before


def test_every_problem_is_reported_at_once(smt: Path) -> None:
    e = refused(
        smt,
        {
            "a": {"cpu_cores": [4], "numa_node": 0},
            "g": {"gpu_id": 4, "pcie_domain": "81"},
            "d": {"nvme": "nvme0n1p1"},
            "r": {"rdma_port": "ib9"},
        },
    )
    assert e.codes == [Code.CORE_NUMA, Code.BDF_NO_DOMAIN, Code.NVME_PARTITION, Code.RDMA_PORT_UNKNOWN]
    assert [p.where for p in e.problems] == [
        "io_topology.a.cpu_cores",
        "io_topology.g.pcie_domain",
        "io_topology.d.nvme",
        "io_topology.r.rdma_port",
    ]


def test_malformed_contracts_name_each_field() -> None:
    with pytest.raises(ContractRefused) as e:
        parse(
            "balanced",
            {"bad name!": {}, "x": {"cpu_cores": [1, 1]}, "y": {"hugepages": 4}, "z": {"color": "red"}},
            {"recovery_point": "yesterday", "stateful_io": "yes"},
        )
    assert set(e.value.codes) == {Code.MALFORMED}
    wheres = [p.where for p in e.value.problems]
    assert wheres == [
        "io_topology.bad name!",
        "io_topology.x.cpu_cores",
        "io_topology.y.hugepages",
        "io_topology.z",
        "fault_tolerance.recovery_point",
        "fault_tolerance.stateful_io",
    ]


def test_hugepages_are_allocated_only_when_the_config_allows(short: Path) -> None:
    nr = short / "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"
    topo = {"p": {"memory_pool": "hugepage_2MB", "hugepages": 8}}
    refused(short, topo)
    assert nr.read_text() == "16\n"  # not allowed: untouched
    # allowed, but the contract is wrong elsewhere too: still nothing changes
    refused(short, {**topo, "l": {"cpu_cores": [99]}}, allow_hugepage_allocation=True)
    assert nr.read_text() == "16\n"
    # allowed: the pool is raised by the shortfall; a fixture's "kernel" gives no pages, so the
    # pool is read again and the contract is still refused, saying what was tried
    e = refused(short, topo, allow_hugepage_allocation=True)
    assert nr.read_text() == "22\n"
    assert e.codes == [Code.HUGEPAGES_SHORT] and "raised 16 -> 22" in e.problems[0].message
    (short / "sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").write_text("8\n")  # as a kernel would
    plan = check(short, topo, allow_hugepage_allocation=True)
    assert [(p.pages, p.free) for p in plan.pools] == [(8, 8)] and nr.read_text() == "22\n"


# --- the plan on the link ------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.update(extra=1),
        lambda p: p["threads"][0].update(cpus=[9000]),
        lambda p: p["threads"][0].update(cpus=list(range(2000))),
        lambda p: p["threads"][0].update(tag="x" * 40),
        lambda p: p.update(contract_id="../../etc"),
        lambda p: p["gpus"][0].update(bdf="81:00.0"),
        lambda p: p.update(threads=[p["threads"][0]] * 65),
    ],
)
def test_the_link_refuses_a_plan_out_of_shape(smt: Path, change) -> None:
    plan = check(smt, EXAMPLE["io_topology"], EXAMPLE["compute_profile"]).to_dict()
    change(plan)
    with pytest.raises(BadMessage):
        Contract.from_wire({"type": "contract", "job_id": "j", "rank": 0, "plan": plan})


def test_the_link_takes_a_plan_for_any_job_id_the_link_takes(smt: Path) -> None:
    plan = check(smt, EXAMPLE["io_topology"], EXAMPLE["compute_profile"]).to_dict()
    job_id = "team-a/run-42:attempt@node+1." + "x" * 90  # 120 characters of the job-id set
    Contract.from_wire({"type": "contract", "job_id": job_id, "rank": 7, "plan": plan})
    with pytest.raises(BadMessage, match="plan.threads\\[0\\].cpus is missing"):
        broken = {**plan, "threads": [{k: v for k, v in plan["threads"][0].items() if k != "cpus"}]}
        Contract.from_wire({"type": "contract", "job_id": job_id, "rank": 7, "plan": broken})


# --- the CLI ---------------------------------------------------------------------------------


def mscale(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "mscale", "contract", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_cli_check_prints_the_plan_or_every_problem(smt: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(json.dumps(EXAMPLE))  # JSON is YAML
    roots = ["--sys-root", str(smt / "sys"), "--proc-root", str(smt / "proc")]
    r = mscale("check", str(good), *roots)
    assert r.returncode == 0, r.stderr
    assert "thread image_loader: CPUs 2-3 as msc0:image_load" in r.stdout
    assert "GPU 4 at 0000:81:00.0, NUMA node 1" in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('compute_profile = "balanced"\n[io_topology.g]\ngpu_id = 4\npcie_domain = "81"\n')
    r = mscale("check", str(bad), *roots, "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["problems"][0]["code"] == "bdf_no_domain"
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    r = mscale("check", str(broken), *roots)
    assert r.returncode == 1 and "[malformed]" in r.stderr and "Traceback" not in r.stderr
    assert load_file(good).contract_id == parse(**EXAMPLE).contract_id


def test_the_job_takes_the_allocation_switch_from_the_agents_config(short: Path, tmp_path: Path) -> None:
    import mscale
    from mscale.daemon.config import ConfigError

    nr = short / "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"
    topo = {"p": {"memory_pool": "hugepage_2MB", "hugepages": 8}}
    roots = {"sys_root": short / "sys", "proc_root": short / "proc", "use_nvml": False}
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nlisten = "127.0.0.1:0"\n\n[contract]\nallow_hugepage_allocation = false\n')
    with pytest.raises(ContractRefused):
        mscale.contract("balanced", topo, config=str(cfg), **roots).apply()
    assert nr.read_text() == "16\n"
    cfg.write_text("[contract]\nallow_hugepage_allocation = true\nmsrp_interval_s = 60\n")
    decl = mscale.contract("balanced", topo, config=str(cfg), **roots)
    assert decl.msrp == {"interval_s": 60.0, "report_s": 10.0}
    with pytest.raises(ContractRefused, match="raised 16 -> 22"):
        decl.apply()
    assert nr.read_text() == "22\n"
    cfg.write_text("[contract]\n\nallow_hugepage_allocation = 1\n")
    with pytest.raises(ConfigError, match=r"contract.allow_hugepage_allocation \(line 3\): expected a boolean"):
        mscale.contract("balanced", topo, config=str(cfg), **roots)
