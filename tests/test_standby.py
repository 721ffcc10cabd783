"""A standby the node agrees on: a rank's L1 swap asks the agent, which answers from its node
view (GPU health from the GPU probe on simulated GPUs, every rank's GPUs, quarantines, the
MPU's history), or "none", which escalates to L2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mscale
from mscale import link as protocol
from mscale.daemon.config import from_dict
from mscale.findings import Finding, Reason, Severity
from mscale.probes.gpu import GpuProbe, NvmlReader
from mscale.probes.gpu_health import HealthModel
from mscale.sim.nvml import SimNvml
from mscale.sim.timeline import event_from_dict
from mscale.sim.tinymm import TinyConfig, TinyMultimodal
from support.link_agent import Agent, wait_for

JOB = "standby-job"


def gpu_snapshot(gpus: int, failed: int):
    """The GPU probe's snapshot of a simulated node where GPU `failed` lost itself."""
    sim = SimNvml(gpus, model="h100")
    sim.inject(event_from_dict({"gpu": failed, "fault": "gpu_lost"}, gpus=gpus))
    probe = GpuProbe(NvmlReader(sim, backend="sim"), HealthModel(from_dict({}).health), emit=lambda f: None)
    return probe.sample()


def rank(sock: str, r: int, gpus: dict[str, int]):
    torch.manual_seed(0)
    model = TinyMultimodal(TinyConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = mscale.attach(model, opt, job_id=JOB, rank=r, socket_path=sock, snapshots=True, gpus=gpus)
    wait_for(lambda: guard.link.connected, 20, f"rank {r} connected")
    return guard


def quarantine(agent: Agent, gpu: int) -> None:
    """What the node's healing engine emits when it quarantines a GPU."""
    labels = {"action": "quarantine_gpu", "result": "sent", "gpu": str(gpu)}
    agent.state.events.emit(Finding("healing", Reason.HEAL_ACTION, Severity.WARNING, "quarantined", labels))


def swap(guard, mpu_id: str, gpu: int) -> dict:
    cmd = protocol.Heal(
        "l1_swap", rule="gpu_fatal", level="L1", mpu_id=mpu_id, gpu=str(gpu), reason="gpu_xid"
    ).to_wire()
    return guard.fuse.on_command(cmd)


def test_the_agent_grants_a_free_healthy_gpu_then_none_which_escalates_to_l2(tmp_path: Path) -> None:
    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock)
    agent.state.publish("gpu", gpu_snapshot(8, failed=0))
    assert {g.index: g.health for g in agent.state.snapshots["gpu"].gpus}[0] == "failed"
    g0 = rank(sock, 0, {"vision": 0, "aligner": 1, "text": 2})
    g1 = rank(sock, 1, {"vision": 3, "aligner": 4, "text": 5})
    try:
        wait_for(
            lambda: len(agent.state.jobs.get(JOB, {}).ranks if JOB in agent.state.jobs else ()) == 2, 20, "2 ranks"
        )
        # rank 0's vision leaves the failed GPU 0: 1-5 hold MPUs (3-5 rank 1's): 6, which no MPU uses
        assert swap(g0, "001", 0) == {"ok": True, "result": "applied"}
        assert g0.mpu("001").gpu == 6 and g0.fuse.ask_standby.answers[-1]["gpu"] == 6
        quarantine(agent, 7)
        # rank 1's vision leaves GPU 3: 6 is rank 0's, 7 quarantined, nothing free: the GPU of its
        # own aligner (a rank's MPUs may share a GPU; another rank's, never)
        assert swap(g1, "001", 3)["ok"] and g1.mpu("001").gpu == 4
        quarantine(agent, 5)
        # rank 1's aligner leaves 4: its text's GPU 5 quarantined too: none -> L2
        assert swap(g1, "002", 4)["ok"] and g1.mpu("002").gpu == 4
        answer = g1.fuse.ask_standby.answers[-1]
        assert answer["gpu"] is None
        for what in ("unhealthy: 0", "quarantined: 5, 7", "in use by another rank: "):
            assert what in answer["why"], answer["why"]
        assert g1.mpu("002").fuse_level == "l2_degraded"
        events = [f for _, f in agent.state.events.since(0) if f.source == "standby"]
        assert [(f.labels["rank"], f.labels["result"], f.labels.get("standby_gpu")) for f in events] == [
            ("0", "granted", "6"),
            ("1", "granted", "4"),
            ("1", "none", None),
        ]
    finally:
        g0.detach()
        g1.detach()
        agent.stop()


def test_a_bad_standby_request_is_refused_and_counted(tmp_path: Path) -> None:
    from support.link_agent import RawLink

    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock)
    raw = RawLink(sock)
    try:
        reg = protocol.Register(job_id="j", rank=0, pid=1, step=0, mpus=(protocol.MpuInfo("001", "v", 0),)).to_wire()
        assert '"registered"' in raw.ask(protocol.encode(reg))
        bad = {"type": "standby_request", "id": 1, "mpu_id": "001", "gpu": 0, "avoid": ["x"]}
        got = raw.ask(protocol.encode(bad))
        assert '"error"' in got and "avoid" in got
        assert agent.state.refused[("socket", "malformed")] == 1
        good = {**bad, "avoid": [1]}
        assert '"standby"' in raw.ask(protocol.encode(good))  # the connection goes on
        no_view = json.loads(raw.ask(protocol.encode({**good, "id": 2})))
        assert no_view["gpu"] is None and no_view["decided"] is False and "no GPU data" in no_view["why"]
    finally:
        raw.close()
        agent.stop()


def test_without_an_agent_answer_the_job_chooses_alone() -> None:
    model = TinyMultimodal(TinyConfig())
    guard = mscale.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.01), job_id="alone", connect=False, snapshots=True
    )
    try:
        assert getattr(guard.fuse, "ask_standby", None) is None
        assert swap(guard, "001", 0)["ok"] and guard.mpu("001").gpu == 3  # the first GPU no MPU uses
    finally:
        guard.detach()


def test_timeout_must_be_positive() -> None:
    from mscale.hook.fuse.standby import AgentStandby

    with pytest.raises(ValueError, match="timeout_s"):
        AgentStandby(object(), timeout_s=0)


def test_an_agent_without_gpu_data_leaves_the_choice_to_the_job(tmp_path: Path) -> None:
    """No GPU probe snapshot: the agent has no view, says so, and the swap goes on with the job's
    own choice (an L1 swap, not an escalation)."""
    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock)
    g = rank(sock, 0, {"vision": 0, "aligner": 1, "text": 2})
    try:
        assert swap(g, "001", 0) == {"ok": True, "result": "applied"}
        assert g.fuse.ask_standby.answers[-1]["decided"] is False
        assert g.mpu("001").gpu == 3 and g.mpu("001").fuse_level == "l1_swapped"
    finally:
        g.detach()
        agent.stop()
