"""Applying a plan in the process, read back from /proc by the agent's compliance check; and
the agent refusing contract and MSRP messages out of shape, changing nothing."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

import mscale
from mscale.contracts.hardware import format_cpulist
from mscale.contracts.settings import ContractSection
from mscale.daemon import compliance
from support import require
from support.link_agent import Agent, RawLink, wait_for

FEATURES = ("mscale.daemon.api", "mscale.daemon.link", "mscale.daemon.contract.service")


def two_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    require(len(cpus) >= 2, "needs two CPUs to tell a pinned thread from an unpinned one")
    return cpus[0], cpus[-1]


def test_main_and_io_threads_are_pinned_found_by_tag_and_released() -> None:
    first, last = two_cpus()
    before = os.sched_getaffinity(0)
    contract = mscale.contract("balanced", {"main": {"cpu_cores": [first]}, "io": {"cpu_cores": [last]}})
    pinned, stop = threading.Event(), threading.Event()
    with contract as applied:
        assert os.sched_getaffinity(0) == {first}  # the contract names the main thread

        def io() -> None:
            applied.pin_thread("io")
            pinned.set()
            stop.wait(30)

        t = threading.Thread(target=io)
        t.start()
        try:
            assert pinned.wait(10)
            plan = applied.plan.to_dict()
            states = {c.name: (c.state, c.tasks) for c in compliance.check(plan, os.getpid())}
            assert states == {"main": ("compliant", 1), "io": ("compliant", 1)}
            assert (Path(f"/proc/{os.getpid()}/task/{t.native_id}/comm").read_text().strip()) == "msc1:io"
            os.sched_setaffinity(t.native_id, before)  # moved off its CPU from outside
            (io_state,) = [c for c in compliance.check(plan, os.getpid()) if c.name == "io"]
            assert io_state.state == "violated"
            assert io_state.violations == ((t.native_id, format_cpulist(before)),)
        finally:
            stop.set()
            t.join(10)
    assert os.sched_getaffinity(0) == before  # released: the main thread's mask is back


def test_a_loader_without_workers_is_refused_and_nothing_is_pinned() -> None:
    import torch

    first, _ = two_cpus()
    before = os.sched_getaffinity(0)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=0)
    contract = mscale.contract("balanced", {"image_loader": {"cpu_cores": [first]}})
    with pytest.raises(ValueError, match="num_workers=0"):
        contract.apply(loaders={"image_loader": loader})
    assert loader.worker_init_fn is None and os.sched_getaffinity(0) == before
    from mscale.contracts.declare import active

    assert active() is None  # a refused apply leaves no contract in force


def register(job: str = "job-c") -> str:
    mpu = {"mpu_id": "001", "name": "vision", "gpu": 0}
    return json.dumps({"type": "register", "job_id": job, "rank": 0, "pid": os.getpid(), "step": 0, "mpus": [mpu]})


PLAN = {
    "contract_id": "0123456789ab",
    "compute_profile": "balanced",
    "threads": [{"name": "io", "cpus": [0], "tag": "msc0:io", "numa_node": None}],
    "gpus": [],
    "pools": [],
    "rdma": [],
    "nvme": [],
    "recovery_point": "latest",
    "stateful_io": False,
    "notes": [],
}


@pytest.mark.parametrize(
    "message, why",
    [
        ({"type": "contract", "job_id": "job-c", "rank": 0, "plan": {**PLAN, "threads": [{"name": "x"}]}}, "malformed"),
        ({"type": "contract", "job_id": "other-job", "rank": 0, "plan": PLAN}, "malformed"),
        ({"type": "contract", "job_id": "job-c", "rank": -1, "plan": PLAN}, "malformed"),
        (
            {"type": "msrp", "job_id": "job-c", "rank": 0, "gpus": {"0": {"matmul_flops": -1.0}}, "mpus": {}},
            "malformed",
        ),
        ({"type": "msrp", "job_id": "job-c", "rank": 0, "gpus": {}, "mpus": {"../x": {}}}, "malformed"),
    ],
)
def test_the_agent_refuses_contract_messages_out_of_shape(tmp_path: Path, message: dict, why: str) -> None:
    sock = str(tmp_path / "agent.sock")
    agent = Agent(sock, features=FEATURES)
    raw = RawLink(sock)
    try:
        assert json.loads(raw.ask(register()))["type"] == "registered"
        got = json.loads(raw.ask(json.dumps(message)))
        assert got["type"] == "error"
        assert agent.state.refused[("socket", why)] == 1
        assert not agent.state.snapshots.get("contract") or not agent.state.snapshots["contract"].records
        # the connection goes on: a good plan is taken
        raw.send(json.dumps({"type": "contract", "job_id": "job-c", "rank": 0, "plan": PLAN}))
        wait_for(lambda: getattr(agent.state.snapshots.get("contract"), "records", ()), what="the good plan")
    finally:
        raw.close()
        agent.stop()


def test_plans_past_the_cap_are_refused(tmp_path: Path) -> None:
    sock = str(tmp_path / "agent.sock")
    agent = Agent(sock, features=FEATURES, sections={"contract": ContractSection(max_contracts=1)})
    raws = [RawLink(sock), RawLink(sock)]
    try:
        for i, raw in enumerate(raws):
            assert json.loads(raw.ask(register(f"job-{i}")))["type"] == "registered"
        raws[0].send(json.dumps({"type": "contract", "job_id": "job-0", "rank": 0, "plan": PLAN}))
        wait_for(lambda: getattr(agent.state.snapshots.get("contract"), "records", ()), what="the first plan")
        got = json.loads(raws[1].ask(json.dumps({"type": "contract", "job_id": "job-1", "rank": 0, "plan": PLAN})))
        assert got["type"] == "error" and "contract.max_contracts" in got["error"]
        assert agent.state.refused[("socket", "contract_limit")] == 1
        assert [r.job_id for r in agent.state.snapshots["contract"].records] == ["job-0"]
    finally:
        for raw in raws:
            raw.close()
        agent.stop()


@pytest.mark.slow  # two agents one after the other and a job reconnecting: about 6 s
def test_a_restarted_agent_gets_the_plan_again(tmp_path: Path) -> None:
    import torch

    from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

    first, _ = two_cpus()
    sock = str(tmp_path / "agent.sock")
    agent = Agent(sock, features=FEATURES)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = iter(torch.utils.data.DataLoader(SyntheticCaptions(cfg, size=10_000), batch_size=2))

    def step() -> None:
        b = next(data)
        model(b["images"], b["tokens"])["loss"].backward()
        opt.step()
        opt.zero_grad()

    def plans(a: Agent) -> list:
        return list(getattr(a.state.snapshots.get("contract"), "records", ()))

    with mscale.contract("balanced", {"io": {"cpu_cores": [first]}}, msrp=False) as applied:
        guard = mscale.attach(model, opt, job_id="restart", socket_path=sock, cmsa=False)
        try:
            step()
            (r,) = wait_for(lambda: plans(agent), 60, what="the plan")
            assert r.contract_id == applied.plan.contract_id
            agent.stop()
            agent = Agent(sock, features=FEATURES)  # a fresh agent knows nothing of the job

            def resent() -> list:
                step()  # the plugin resends at a step end once the link has reconnected
                return plans(agent)

            (r,) = wait_for(resent, 60, what="the plan, sent again")  # a loaded machine: reconnects
            assert r.contract_id == applied.plan.contract_id and r.job_id == "restart"
        finally:
            guard.detach()
            agent.stop()
