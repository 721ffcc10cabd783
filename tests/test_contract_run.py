"""A real training run with a contract: its data-loader workers run pinned (read back from
/proc/<worker pid>/status), the main thread is left alone, and the agent reports compliance,
then a violation when a worker is moved off its CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mscale
from mscale.contracts.hardware import format_cpulist, parse_cpulist
from mscale.contracts.settings import ContractSection
from mscale.contracts.spec import profiles
from mscale.findings import Reason
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal
from support import REPO, require
from support.link_agent import Agent, metric, wait_for

pytestmark = pytest.mark.slow  # an agent, a training run and two loader workers: about 6 s

FEATURES = ("mscale.daemon.api", "mscale.daemon.link", "mscale.daemon.status_api", "mscale.daemon.contract.service")


class PidCaptions(SyntheticCaptions):
    """Each sample says which process loaded it, so the test finds the workers."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "pid": torch.tensor(os.getpid())}


def allowed(pid: int) -> frozenset[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.partition(":")[2])
    raise AssertionError("no Cpus_allowed_list")


def test_a_contracted_run_pins_its_workers_and_the_agent_reports_compliance(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    require(len(cpus) >= 2, "needs two CPUs to tell a pinned worker from an unpinned one")
    loader_cpu = cpus[-1]
    sock = str(tmp_path / "agent.sock")
    agent = Agent(
        sock,
        features=FEATURES,
        sections={
            "contract": ContractSection(
                check_interval_s=0.5, check_timeout_s=0.5, density_interval_s=1, density_window_s=1
            )
        },
    )
    main_before = os.sched_getaffinity(0)
    cfg = TinyConfig()
    loader = torch.utils.data.DataLoader(
        PidCaptions(cfg, size=64), batch_size=4, num_workers=2, persistent_workers=True
    )
    seen: dict[str, object] = {}

    @mscale.contract(
        compute_profile="cpu-tiny",
        io_topology={"image_loader": {"cpu_cores": [loader_cpu], "numa_node": 0}},
        fault_tolerance={"recovery_point": "latest"},
        msrp_report_s=0.0,  # every step: the test need not wait out the default 10 s
    )
    def train(model, image_loader, steps: int) -> set[int]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = mscale.attach(model, opt, job_id="contract-run", socket_path=sock, cmsa=False)
        workers: set[int] = set()
        it = iter(image_loader)
        for _ in range(steps):
            b = next(it)
            workers.update(int(p) for p in b["pid"])
            model(b["images"], b["tokens"])["loss"].backward()
            opt.step()
            opt.zero_grad()
        seen["main_during"] = os.sched_getaffinity(0)
        # while the workers live: the agent sees both pinned (a check that ran while the second
        # was still starting counts one, so wait for one that ran since)
        record = wait_for(
            lambda: next((r for r in agent_records(agent) if r.compliant and r.msrp and loader_tasks(r) >= 2), None),
            60,
            what="a compliant check of both loader workers, and the MSRP",
        )
        seen["record"] = record
        # the density guard: the tiny MPUs' densities differ from one another by more than 2x,
        # so at least one is off its profile by more than 15% for the 1 s window
        seen["density"] = wait_for(
            lambda: [e for _, e in agent.state.events.since(0) if e.reason is Reason.DENSITY_DEVIATION],
            60,
            what="a density recommendation",
        )
        seen["metrics"] = agent.metrics()
        seen["status"] = status(agent, "contract-run")
        worker = sorted(workers)[0]
        os.sched_setaffinity(worker, cpus)  # an operator's taskset moves one worker off its CPUs
        seen["violation"] = wait_for(
            lambda: [e for _, e in agent.state.events.since(0) if e.reason is Reason.CONTRACT_VIOLATED],
            60,
            what="the violation",
        )
        seen["guard"] = guard
        return workers

    try:
        workers = train(TinyMultimodal(cfg), image_loader=loader, steps=6)
        assert len(workers) == 2 and os.getpid() not in workers
        for pid in workers:
            assert allowed(pid) == {loader_cpu} or pid == sorted(workers)[0]
        assert seen["main_during"] == main_before == os.sched_getaffinity(0)  # main thread left alone
        record = seen["record"]
        (thread,) = record.threads
        assert (thread.name, thread.state, thread.expected) == ("image_loader", "compliant", str(loader_cpu))
        assert thread.tasks >= 2  # both workers (and any thread they started)
        assert record.pid == os.getpid() and record.plan["compute_profile"] == "cpu-tiny"
        text = seen["metrics"]
        cid = record.contract_id
        assert metric(text, f'mscale_contract_compliant{{contract_id="{cid}",job_id="contract-run",rank="0"}}') == 1
        assert metric(text, 'mscale_contract_thread_present{job_id="contract-run",rank="0",thread="image_loader"}') == 1
        assert seen["status"]["contracts"][0]["threads"][0]["state"] == "compliant"
        # MSRP: the host's micro-probes for the three simulated GPUs, each MPU's achieved rate
        assert sorted(record.msrp["gpus"]) == ["0", "1", "2"] and sorted(record.msrp["mpus"]) == ["001", "002", "003"]
        for mpu_id in ("001", "002", "003"):
            labels = f'job_id="contract-run",mpu_id="{mpu_id}",rank="0"'
            assert metric(text, f"mscale_mpu_achieved_flops{{{labels}}}") > 0
            assert metric(text, f"mscale_mpu_compute_density{{{labels}}}") > 0
        assert metric(text, 'mscale_msrp_matmul_flops{dtype="float32",gpu="0",job_id="contract-run",rank="0"}') > 0
        f = seen["density"][0]
        assert f.labels["job_id"] == "contract-run" and f.labels["profile"] == "cpu-tiny"
        assert f.labels["direction"] in ("up", "down") and f.labels["recommended"] in profiles()
        assert "mscale_density_recommendation{" in text and "mscale_mpu_density_deviation_ratio{" in text
        (violation,) = seen["violation"][:1]
        assert f"should run on {loader_cpu}" in violation.message and violation.labels["job_id"] == "contract-run"
        assert f"runs on {format_cpulist(cpus)}" in violation.message
        shown = cli_status(agent)
        assert "contract-run" in shown and "image_loader: violated" in shown
        assert "TFLOP/s per GB" in shown and "against cpu-tiny (0.3), recommended" in shown
    finally:
        guard = seen.get("guard")
        if guard is not None:
            guard.detach()
        del loader
        agent.stop()


def loader_tasks(record) -> int:
    return sum(t.tasks for t in record.threads if t.name == "image_loader")


def agent_records(agent: Agent) -> list:
    snap = agent.state.snapshots.get("contract")
    return list(getattr(snap, "records", ()))


def status(agent: Agent, key: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/api/v1/contracts/{key}", timeout=10) as r:
        return json.loads(r.read())


def cli_status(agent: Agent) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "mscale", "contract", "status", "--agent", f"127.0.0.1:{agent.port}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout
