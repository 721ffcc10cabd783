"""Chaos against a real agent (in-process on 127.0.0.1, simulated GPUs) and a real training
job: the CLI, bad requests, an Xid healed through the agent (emergency snapshot on disk,
swap, GPU quarantined), `mscale status`, and agent-kill on a real agent process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from mscale.daemon.chaos import is_loopback_peer
from mscale.demo.embedded import EmbeddedAgent
from mscale.demo.scenario import Run, RunConfig
from support import free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def agent():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with EmbeddedAgent() as a:
        yield a
    structlog.reset_defaults()


def cli(*args: str, timeout: float = 60, token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MSCALE_CHAOS_TOKEN"}
    if token is not None:
        env["MSCALE_CHAOS_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "mscale", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def test_only_loopback_peers_are_accepted():
    assert is_loopback_peer(("127.0.0.1", 5000)) and is_loopback_peer(("::1", 5000, 0, 0))
    assert is_loopback_peer(("127.8.9.10", 1)) and is_loopback_peer("")  # a Unix socket peer
    assert not is_loopback_peer(("10.0.0.7", 5000)) and not is_loopback_peer(("192.168.1.2", 1))
    assert not is_loopback_peer(("2001:db8::1", 1, 0, 0)) and not is_loopback_peer(None)


@pytest.mark.parametrize(
    "body,words",
    [
        ({"kind": "meteor"}, "kind: expected one of"),
        ({"kind": "corrupt", "mode": "noise"}, "exactly one of mpu"),
        ({"kind": "corrupt", "mpu": "vision", "mode": "acid"}, "mode: expected one of"),
        ({"kind": "xid", "gpu": 99}, "gpu"),
        ({"kind": "loss_spike", "factor": -3}, "factor"),
        ({"kind": "hang", "seconds": 5, "colour": "red"}, "unknown field(s): colour"),
    ],
)
def test_bad_chaos_requests_are_refused_and_change_nothing(agent, body, words):
    before = len(agent.events())
    status, reply = agent.chaos(body)
    assert status == 400 and words in reply["error"]
    assert not [e for e in agent.events()[before:] if e["reason"] == "chaos_injected"]


def test_xid_through_the_cli_is_seen_by_the_probe_and_healed_in_the_job(agent, tmp_path):
    r = Run(RunConfig(steps=40, socket_path=agent.socket_path, job_id="chaotic", snapshot_dir=str(tmp_path)))
    try:
        agent.wait_for(
            lambda evs: any(e["reason"] == "job_registered" and e["labels"].get("job_id") == "chaotic" for e in evs)
        )
        for _ in range(12):
            r.one_step()
        res = cli(
            "chaos",
            "inject",
            "xid",
            "--gpu",
            "0",
            "--code",
            "79",
            "--corrupt",
            "none",
            "--agent",
            agent.url,
            token=agent.chaos_token,
        )
        assert res.returncode == 0, res.stderr
        assert "xid 79 on GPU 0" in res.stdout
        agent.wait_for(lambda evs: [e for e in evs if e["reason"] == "gpu_xid" and e["labels"].get("gpu") == "0"])
        agent.wait_for(
            lambda evs: (
                len(
                    [
                        e
                        for e in evs
                        if e["source"] == "healing"
                        and e["labels"].get("result") == "sent"
                        and e["labels"].get("job_id") == "chaotic"
                    ]
                )
                == 4  # gpu_fatal: snapshot, quarantine, swap; node_drain (RESTART_BM): snapshot
            )
        )
        while r.guard.mpu("vision").gpu == 0 and r.guard.current_step < 30:
            r.one_step()
        assert r.guard.mpu("vision").gpu == 3 and 0 in r.fuse.states["quarantine_gpu"].gpus
        # one emergency snapshot per command (gpu_fatal's, and node_drain's for a RESTART_BM Xid),
        # each the newest in-memory snapshot (every 5 steps) when its command came
        writes = r.fuse.states["emergency_snapshot"].writes
        applied = [
            f
            for f in r.findings
            if f.labels.get("action") == "emergency_snapshot" and f.labels.get("result") == "applied"
        ]
        assert len(writes) == len(applied) == 2
        for fut, em in zip(writes, applied, strict=True):
            path = Path(fut.result(timeout=30))
            assert path.parent == tmp_path and (path / "manifest.json").exists()
            manifest = json.loads((path / "manifest.json").read_text())
            assert manifest["step"] % 5 == 0 and 10 <= manifest["step"] <= int(em.labels["step"])
        # a later command for the same fault (e.g. the alert) changes nothing
        status, _ = agent.chaos({"kind": "corrupt", "gpu": 0, "mode": "noise", "steps": 3})
        assert status == 200
        for _ in range(4):
            r.one_step()
        assert not [f for f in r.findings if f.reason.value == "checksum_failure"]  # nothing runs on GPU 0 now
        agent.wait_for(
            lambda evs: [e for e in evs if e["source"] == "hook:fuse" and e["labels"].get("action") == "l1_swap"]
        )
        metrics = agent.get("/metrics")
        assert 'mpu_drift_count_total{job_id="chaotic",mpu_id="001"} 1.0' in metrics
        assert 'mscale_fuse_level{job_id="chaotic",mpu_id="001"} 1.0' in metrics
        res = cli("status", "--agent", agent.url)
        assert res.returncode == 0, res.stderr
        assert "chaotic" in res.stdout and "l1_swapped" in res.stdout and "vision" in res.stdout
        assert "failed" in res.stdout  # GPU 0's health after the Xid
    finally:
        r.close()


def test_corruption_through_the_cli_reaches_the_job(agent):
    r = Run(RunConfig(steps=40, socket_path=agent.socket_path, job_id="corrupted"))
    try:
        agent.wait_for(
            lambda evs: any(e["reason"] == "job_registered" and e["labels"].get("job_id") == "corrupted" for e in evs)
        )
        res = cli(
            "chaos",
            "inject",
            "corrupt",
            "--mpu",
            "aligner",
            "--mode",
            "nan",
            "--steps",
            "2",
            "--job-id",
            "corrupted",
            "--agent",
            agent.url,
            token=agent.chaos_token,
        )
        assert res.returncode == 0 and "delivered to 1 job" in res.stdout, res.stderr
        deadline = time.monotonic() + 20
        while not r.chaos.log and time.monotonic() < deadline:
            r.one_step()
        assert r.chaos.log[0]["kind"] == "corrupt" and r.chaos.log[0]["mpu"] == "aligner"
        for _ in range(3):
            r.one_step()
        assert [f for f in r.findings if f.reason.value == "nonfinite_output" and f.labels["mpu_id"] == "002"]
        assert not r.nonfinite_weights  # the NaN steps were dropped and rolled back
    finally:
        r.close()


def test_cli_refusals_exit_nonzero(agent):
    res = cli("chaos", "inject", "xid", "--gpu", "42", "--agent", agent.url, token=agent.chaos_token)
    assert res.returncode == 2 and "gpu" in res.stderr
    res = cli("chaos", "inject", "nan-loss", "--agent", agent.url)  # no token
    assert res.returncode == 1 and "refused (401)" in res.stderr and "missing bearer token" in res.stderr
    res = cli("chaos", "inject", "nan-loss", "--agent", "http://127.0.0.1:1")
    assert res.returncode == 1 and "cannot reach" in res.stderr


@pytest.mark.slow  # a real agent process killed: about 2 s
def test_agent_kill_kills_a_real_agent(tmp_path):
    port = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f'[agent]\nlisten = "127.0.0.1:{port}"\nsocket_path = "{tmp_path}/a.sock"\n'
        "[probes.ebpf]\nenabled = false\n[probes.host]\nenabled = false\n"
        '[chaos]\ntoken = "kill-token-0123"\n'  # on through --simulate; its token here
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mscale",
            "agent",
            "--config",
            str(cfg),
            "--simulate",
            str(REPO / "mscale/sim/timelines/default.yaml"),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            res = cli("status", "--agent", f"http://127.0.0.1:{port}")
            if res.returncode == 0:
                break
            assert time.monotonic() < deadline and proc.poll() is None, res.stderr
            time.sleep(0.2)
        token_file = tmp_path / "chaos-token"
        token_file.write_text("kill-token-0123\n")
        res = cli(
            "chaos", "inject", "agent-kill", "--agent", f"http://127.0.0.1:{port}", "--token-file", str(token_file)
        )
        assert res.returncode == 0, res.stderr
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
