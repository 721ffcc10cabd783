"""The link between the hook library and a real agent app on a temporary Unix socket."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from mscale.hook.checks.checksum import ChecksumConfig
from mscale.hook.core.attach import attach
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal
from support import require
from support.link_agent import Agent, metric, wait_for


def make_job(socket_path: str, job_id: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = attach(model, opt, job_id=job_id, socket_path=socket_path, **kw)
    data = SyntheticCaptions(cfg, size=10_000, seed=seed)
    it = iter(torch.utils.data.DataLoader(data, batch_size=4))

    def train(n: int) -> None:
        for _ in range(n):
            b = next(it)
            model(b["images"], b["tokens"])["loss"].backward()
            opt.step()
            opt.zero_grad()

    return guard, train


@pytest.fixture
def sock(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "agent.sock")


def test_register_reports_and_metrics(sock: str) -> None:
    agent = Agent(sock)
    guard, train = make_job(sock, "job-a")
    try:
        train(25)
        job = wait_for(lambda: agent.state.jobs.get("job-a"), what="registration")
        assert job.pid == os.getpid() and job.rank == 0
        assert [(m.mpu_id, m.name, m.gpu) for m in job.mpus.values()] == [
            ("001", "vision", 0),
            ("002", "aligner", 1),
            ("003", "text", 2),
        ]
        wait_for(lambda: job.step == 24, what="the last report")
        assert job.reports_total == 25 and job.reports_dropped == 0
        assert job.mpus["001"].latency["forward"].last_s > 0 and job.mpus["003"].latency["backward"].last_s > 0
        text = agent.metrics()
        for mpu_id, name in (("001", "vision"), ("002", "aligner"), ("003", "text")):
            for phase in ("forward", "backward"):
                value = metric(
                    text,
                    f'mpu_health_score{{job_id="job-a",local_rank="0",mpu="{name}",mpu_id="{mpu_id}",phase="{phase}",rank="0"}}',
                )
                assert (
                    60 <= value <= 100
                )  # healthy (latency may wobble on a shared CPU; no checksum, GPU or memory penalty)
        assert 'cmsa_clip_ratio{job_id="job-a",local_rank="0",mpu_id="003",rank="0"}' in text
        assert 'mscale_distill_share{job_id="job-a",local_rank="0",mpu_id="001",rank="0"} 0.0' in text  # no L3 term
        assert 'mscale_job_up{job_id="job-a",local_rank="0",rank="0"} 1.0' in text
        assert 'mscale_job_loss{job_id="job-a"}' in text
        # no L3 term: the task loss is the loss returned
        assert metric(text, 'mscale_job_task_loss{job_id="job-a"}') == metric(text, 'mscale_job_loss{job_id="job-a"}')
        assert 'mscale_mpu_checksum_failures_total{job_id="job-a",local_rank="0",mpu_id="002",rank="0"} 0.0' in text
        # a command reaches the plugins at the next step boundary
        got = []

        class P:
            def on_command(self, command):
                got.append(command)
                return {"ok": True}

        guard.add_plugin(P())
        assert agent.call(agent.link.send("job-a", {"type": "probe", "id": 7}))
        wait_for(lambda: guard.link._messages or guard._commands, what="the command to arrive")
        train(1)
        assert got == [{"type": "probe", "id": 7}]
        assert agent.call(agent.link.send("nope", {"type": "probe"})) is False
        assert agent.call(agent.link.broadcast({"type": "ping", "id": 1})) == 1
    finally:
        guard.detach()
        agent.stop()


def test_checksum_findings_reach_the_agent(sock: str) -> None:
    from mscale.sim.inject import inject

    agent = Agent(sock)
    # every layer every step: three faulty steps in a row, each caught (not the rotation's test)
    guard, train = make_job(sock, "job-f", checksum=ChecksumConfig(full=True))
    try:
        train(2)
        inject(guard, kind="exponent_flip", mpu="aligner", steps=3)
        train(3)
        wait_for(lambda: agent.state.jobs.get("job-f") and agent.state.jobs["job-f"].step == 4, what="reports")
        job = agent.state.jobs["job-f"]
        assert job.mpus["002"].checksum_consecutive_failures == 3
        assert job.mpus["002"].health["forward"] <= 40  # 3 in a row: below the "act" line of 60
        assert job.mpus["001"].health["forward"] == 100
        # the step report and the finding travel as separate messages: wait for the finding itself
        l1 = wait_for(
            lambda: [f for _, f in agent.state.events.since(0) if f.reason.value == "checksum_l1_trigger"],
            what="the L1 trigger finding",
        )
        assert l1[0].labels["job_id"] == "job-f" and l1[0].labels["mpu_id"] == "002" and l1[0].source == "hook:checksum"
        assert (
            'mscale_mpu_checksum_consecutive_failures{job_id="job-f",local_rank="0",mpu_id="002",rank="0"} 3.0'
            in agent.metrics()
        )
    finally:
        guard.detach()
        agent.stop()


def test_agent_down_and_restarted_training_goes_on_and_reconnects(sock: str) -> None:
    agent = Agent(sock)
    guard, train = make_job(sock, "job-r", report_queue=8)
    try:
        train(3)
        wait_for(lambda: guard.link.connected, what="connection")
        agent.stop()
        wait_for(lambda: not guard.link.connected, what="the link to notice")
        train(20)  # the agent is down: nothing raises, the queue drops the oldest
        assert guard.current_step == 23
        assert guard.link.dropped >= 20 - 8
        agent = Agent(sock)
        wait_for(lambda: guard.link.connects >= 2, what="reconnection")
        train(2)
        job = wait_for(lambda: agent.state.jobs.get("job-r"), what="re-registration")
        wait_for(lambda: job.step == 24, what="reports after reconnecting")
        assert job.reports_dropped == guard.link.dropped
        assert 'mscale_job_reports_dropped_total{job_id="job-r"}' in agent.metrics()
    finally:
        guard.detach()
        agent.stop()


async def _raw(sock: str, frames: list) -> list:
    replies = []
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s:
        async with s.ws_connect("http://localhost/v1/link", max_msg_size=0) as ws:
            for f in frames:
                await (ws.send_bytes(f) if isinstance(f, bytes) else ws.send_str(f))
                msg = await ws.receive(timeout=10)
                replies.append(msg.data if msg.type == aiohttp.WSMsgType.TEXT else msg.type)
    return replies


def test_malformed_and_oversized_messages_refused_and_counted_other_job_undisturbed(sock: str) -> None:
    agent = Agent(sock, max_message_bytes=4096)
    guard, train = make_job(sock, "job-ok")
    try:
        train(2)
        wait_for(lambda: "job-ok" in agent.state.jobs and agent.state.jobs["job-ok"].step == 1, what="first job")
        reg = {
            "type": "register",
            "job_id": "bad",
            "rank": 0,
            "pid": 1,
            "mpus": [{"mpu_id": "001", "name": "vision", "gpu": 0}],
        }
        replies = asyncio.run(
            _raw(
                sock,
                [
                    "not json",
                    json.dumps([1, 2]),
                    json.dumps({"type": "report", "job_id": "bad", "reports": []}),
                    json.dumps({**reg, "rank": -1}),
                    json.dumps(reg),
                    json.dumps({"type": "report", "job_id": "bad", "reports": [{"step": "x"}]}),
                    json.dumps({"type": "teleport"}),
                    b"\x00\x01",
                ],
            )
        )
        answers = [json.loads(r) for r in replies]
        assert answers[4] == {"type": "registered", "job_id": "bad", "node": agent.state.node}
        errors = [a["error"] for a in answers if a["type"] == "error"]
        assert len(errors) == 8 - 1  # every frame but the valid register was answered with an error
        assert any("not JSON" in e for e in errors) and any("register first" in e for e in errors)
        assert any("rank" in e for e in errors) and any("step" in e for e in errors)
        oversized = asyncio.run(_raw(sock, ["x" * 10_000]))
        assert oversized[0] in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
        refused = agent.state.refused
        assert refused[("socket", "malformed")] == 5
        assert refused[("socket", "unregistered")] == 1 and refused[("socket", "unknown_type")] == 1
        wait_for(lambda: refused[("socket", "oversized")] == 1, what="the oversized count")
        train(3)  # the first job never noticed
        wait_for(lambda: agent.state.jobs["job-ok"].step == 4, what="first job's reports")
        assert agent.state.jobs["job-ok"].connected and guard.link.connects == 1
        assert 'mscale_refused_messages_total{where="socket",why="oversized"} 1.0' in agent.metrics()
    finally:
        guard.detach()
        agent.stop()


PEER = """
import asyncio, os, sys, aiohttp
os.setgid(65534); os.setuid(65534)
async def main():
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sys.argv[1])) as s:
        try:
            async with s.ws_connect("http://localhost/v1/link") as ws:
                print("connected")
        except aiohttp.WSServerHandshakeError as e:
            print("refused", e.status)
        except aiohttp.ClientError:  # closed at once, before any HTTP (issue 25 item 6)
            print("closed")
asyncio.run(main())
"""


@pytest.mark.parametrize("allowed", [False, True])
def test_peer_credentials(allowed: bool) -> None:
    require(os.getuid() == 0, "needs root to run a peer as another user")
    # the socket's directory must be reachable by the other user (pytest's tmp_path is not)
    tmp = tempfile.mkdtemp(prefix="mscale-link-")
    os.chmod(tmp, 0o755)
    sock = os.path.join(tmp, "agent.sock")
    agent = Agent(sock, mode=0o666, allowed_uids=[65534] if allowed else [])
    try:
        out = subprocess.run([sys.executable, "-c", PEER, sock], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        if allowed:
            assert out.stdout.strip() == "connected"
            assert agent.state.refused[("socket", "peer_uid")] == 0
        else:
            assert out.stdout.strip() == "closed"
            # aiohttp's client tries again once on a connection closed before any answer
            assert agent.state.refused[("socket", "peer_uid")] in (1, 2)
    finally:
        agent.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_socket_in_use_is_not_stolen(sock: str) -> None:
    first = Agent(sock)
    second = Agent(sock)
    try:
        assert "in use" in second.link.error
        assert first.link.error == "" and os.path.exists(sock)
    finally:
        second.stop()
        first.stop()


def test_snapshot_and_loss_findings_become_per_job_metrics(sock: str, tmp_path: Path) -> None:
    """The job's snapshot engine and loss detector report through the link; the agent exports
    them per job_id: writes (duration histogram, size, last success), a failed write, the
    recovery times of a rollback (memory) and a resume (disk), and the findings counter."""
    from mscale.findings import Reason
    from mscale.snapshot.config import SnapshotConfig
    from mscale.snapshot.data import ResumableLoader
    from mscale.snapshot.plugin import SnapshotPlugin

    agent = Agent(sock)
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = ResumableLoader(SyntheticCaptions(cfg, size=256, seed=0), batch_size=4, seed=0)
    snaps = tmp_path / "snaps"
    plugin = SnapshotPlugin(
        config=SnapshotConfig(directory=snaps, memory_every=2, disk_every=4, node_every=0),  # the disk tier's figures
        data=loader,
        rollback_on={Reason.LOSS_NONFINITE},
    )
    guard = attach(model, opt, job_id="job-s", socket_path=sock, cmsa=False, plugins=[plugin])

    def train(n: int, nan: bool = False) -> None:
        for _ in range(n):
            b = loader.next_batch()
            images = b["images"] * (float("nan") if nan else 1.0)
            model(images, b["tokens"])["loss"].backward()
            opt.step()
            opt.zero_grad()

    def scraped(series: str) -> float | None:
        try:
            return metric(agent.metrics(), series)
        except AssertionError:
            return None

    try:
        train(6)  # disk snapshots of steps 0 and 4
        plugin.engine.flush()
        assert plugin.resume() == 4  # a start-up resume: recovery from disk
        train(1, nan=True)  # NaN loss: rollback to the in-memory snapshot of step 4
        assert plugin.rollbacks[-1]["to"] == 4
        shutil.rmtree(snaps)
        snaps.write_text("not a directory any more")  # the next disk write fails
        train(4)
        plugin.engine.flush()
        train(1)  # the writer's findings travel with the next step's report
        job = 'job_id="job-s"'
        wait_for(lambda: scraped(f"mscale_snapshot_failures_total{{{job}}}") == 1, what="the failed write")
        text = agent.metrics()
        assert metric(text, f"mscale_snapshot_duration_seconds_count{{{job}}}") == 2
        assert metric(text, f'mscale_snapshot_duration_seconds_bucket{{{job},le="+Inf"}}') == 2
        assert 0 < metric(text, f"mscale_snapshot_duration_seconds_sum{{{job}}}") < 600
        assert metric(text, f"mscale_snapshot_size_bytes{{{job}}}") > sum(p.numel() * 4 for p in model.parameters())
        assert abs(metric(text, f"mscale_snapshot_last_success_timestamp_seconds{{{job}}}") - time.time()) < 600
        assert metric(text, f'checkpoint_recovery_time_seconds{{{job},tag="memory"}}') > 0
        assert metric(text, f'checkpoint_recovery_time_seconds{{{job},tag="disk"}}') > 0
        assert (
            metric(
                text,
                f'mscale_job_findings_total{{{job},reason="loss_nonfinite",severity="critical",source="hook:loss"}}',
            )
            == 1
        )
        assert (
            metric(
                text, f'mscale_job_findings_total{{{job},reason="rollback",severity="warning",source="hook:snapshot"}}'
            )
            == 1
        )
        assert (
            metric(
                text,
                f'mscale_job_findings_total{{{job},reason="snapshot_written",severity="info",source="hook:snapshot"}}',
            )
            == 2
        )
    finally:
        guard.detach()
        plugin.engine.close()
        agent.stop()


def test_lr_cooling_is_exported_for_every_registered_job() -> None:
    """0 for a job not cooled (absence would read as "no data"), 1 while cooled."""
    from prometheus_client import generate_latest

    from mscale.daemon.exporters import make_registry
    from mscale.daemon.jobs import JobState
    from mscale.daemon.state import AgentState
    from mscale.healing.engine import HealingSnapshot

    state = AgentState(node="n")
    state.jobs = {j: JobState(job_id=j, rank=0, pid=1) for j in ("a", "b")}
    state.publish("healing", HealingSnapshot(time=0.0, actions=(), drift=(), levels=(), cooling=("b",), recent=()))
    text = generate_latest(make_registry(state)).decode()
    assert metric(text, 'mscale_lr_cooling{job_id="a"}') == 0 and metric(text, 'mscale_lr_cooling{job_id="b"}') == 1
    # a new job's snapshot failure counter starts at 0, so that increase() sees its first failure
    assert metric(text, 'mscale_snapshot_failures_total{job_id="a"}') == 0
    assert "mscale_snapshot_last_success_timestamp_seconds{" not in text
