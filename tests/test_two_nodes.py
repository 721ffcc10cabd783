"""Two nodes on one machine, end to end: two real agents (`mscale agent`, their own node names,
ports, sockets and simulated GPUs), a job of 2 nodes x 2 ranks (gloo over loopback, DDP), and
Prometheus scraping both with `node` labels and the shipped rules. An Xid on node B's GPU 1
(through node B's chaos API, into its simulated NVML) makes node B's agent send an emergency
snapshot to its ranks (Xid 79 asks for the node to be drained) and the quarantine and the L1
swap to the rank on that GPU only; that rank
takes them at its next step boundary, its standby granted by node B's agent (the GPU no rank
uses); all four ranks stay in step; the alert carries node B;
the job never restarts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import yaml

from mscale.demo.nodes import node_config
from mscale.rules import render
from support import REPO, free_port, require_tool
from support.e2e import Proc, http, poll

RULES_DIR = REPO / "mscale" / "rules"
CHAOS = {"Authorization": "Bearer two-nodes-chaos-0123"}
JOB = "ddp-job"  # tests/support/ddp_job.py's


def agent(tmp: Path, node: str, gpus: int) -> tuple[Proc, int, Path]:
    d = tmp / node
    d.mkdir()
    port = free_port()
    config = node_config(d, node, port, gpus, CHAOS["Authorization"].split()[1])
    return Proc(node, [sys.executable, "-m", "mscale", "agent", "--config", str(config)], d).start(), port, d


@pytest.mark.slow
@pytest.mark.parametrize("standby", [True, False], ids=["standby", "no-standby"])
def test_an_xid_on_node_b_heals_node_b_ranks_and_the_job_goes_on(tmp_path: Path, standby: bool) -> None:
    """standby: 3 GPUs a node, node B's agent grants GPU 2 and rank 3 swaps (L1); no-standby:
    2 GPUs, the agent has none, rank 3 degrades its MPUs in place (L2, its CMSA thresholds
    raised), and the replicas still stay equal (the ranks clip with the agreed thresholds)."""
    prometheus = require_tool("prometheus")
    procs: list[Proc] = []
    job: subprocess.Popen | None = None
    try:
        gpus = 3 if standby else 2
        a, port_a, dir_a = agent(tmp_path, "node-a", gpus)
        b, port_b, dir_b = agent(tmp_path, "node-b", gpus)
        procs += [a, b]
        prom_port = free_port()
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES_DIR / render.RECORDING_FILE), str(RULES_DIR / render.ALERTS_FILE)],
            "scrape_configs": [
                {
                    "job_name": "mscale-agent",
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{port_a}"], "labels": {"node": "node-a"}},
                        {"targets": [f"127.0.0.1:{port_b}"], "labels": {"node": "node-b"}},
                    ],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        procs.append(
            Proc(
                "prometheus",
                [
                    prometheus,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--log.level=warn",
                ],
                tmp_path,
            ).start()
        )

        def logs() -> str:
            return "\n".join(p.logs() for p in procs) + (
                "\n--- job ---\n" + (tmp_path / "job.log").read_text()[-4000:]
                if (tmp_path / "job.log").exists()
                else ""
            )

        def query(expr: str) -> list[dict]:
            out = http(f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            return out["data"]["result"]

        for d in (dir_a, dir_b):
            poll("an agent's socket", lambda d=d: (d / "agent.sock").exists(), logs=logs)
        out, go = tmp_path / "out", tmp_path / "go"
        out.mkdir()
        argv = [sys.executable, "tests/support/ddp_job.py", "--world", "4", "--port", str(free_port()),
                "--out", str(out), "--snapshots", "--snapdir", str(tmp_path / "snaps"), "--steps", "8",
                "--sockets", f"{dir_a / 'agent.sock'},{dir_b / 'agent.sock'}", "--hold-at", "4", "--go", str(go)]  # fmt: skip
        job_log = open(tmp_path / "job.log", "w")
        job = subprocess.Popen(argv, cwd=REPO, stdout=job_log, stderr=subprocess.STDOUT, start_new_session=True)

        def status(port: int) -> dict:
            return http(f"http://127.0.0.1:{port}/api/v1/status?events=1")

        def holding(port: int, ranks: list[int]) -> bool:
            jobs = [j for j in status(port)["jobs"] if j["job_id"] == JOB]
            return bool(jobs) and [(r["rank"], r["step"]) for r in jobs[0]["ranks"]] == [(r, 3) for r in ranks]

        poll("node A holding ranks 0, 1 at step 3", lambda: holding(port_a, [0, 1]), timeout_s=180, logs=logs)
        poll("node B holding ranks 2, 3 at step 3", lambda: holding(port_b, [2, 3]), timeout_s=60, logs=logs)
        poll("both nodes in Prometheus", lambda: len(query('mscale_job_up{job_id="ddp-job"} == 1')) == 4, logs=logs)
        assert {(s["metric"]["node"], s["metric"]["rank"], s["metric"]["local_rank"]) for s in query("mscale_job_up")} == {
            ("node-a", "0", "0"), ("node-a", "1", "1"), ("node-b", "2", "0"), ("node-b", "3", "1")
        }  # fmt: skip

        http(
            f"http://127.0.0.1:{port_b}/api/v1/chaos",
            data={"kind": "xid", "gpu": 1, "code": 79, "corrupt": "none"},
            headers=CHAOS,
        )

        def sent() -> list[str]:
            evs = http(f"http://127.0.0.1:{port_b}/api/v1/events?limit=10000")["events"]
            return sorted(
                e["labels"]["action"]
                for e in evs
                if e["reason"] == "heal_action" and e["labels"].get("result") == "sent"
            )

        poll(
            "node B's agent to send its decisions",
            lambda: "l1_swap" in sent() and "emergency_snapshot" in sent(),
            logs=logs,
        )
        alerts = poll("the Xid alert", lambda: query('ALERTS{alertname="MscaleGpuFatalXid"}'), logs=logs)
        assert {(s["metric"]["node"], s["metric"]["gpu"]) for s in alerts} == {("node-b", "1")}
        go.touch()
        assert job.wait(timeout=240) == 0, logs()
        ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(4)]
        for r in ranks:  # no restart: every rank ran its 8 steps once, from one process each
            assert r["final_step"] == 8 and r["finite"] and r["rollbacks"] == []
        assert [r["node"] for r in ranks] == ["node-a", "node-a", "node-b", "node-b"]
        assert {r["hash"] for r in ranks} == {ranks[0]["hash"]}  # in step: the replicas equal
        assert [[e["hash"] for e in r["ends"]] for r in ranks[1:]] == [[e["hash"] for e in ranks[0]["ends"]]] * 3
        # Xid 79 means "reboot the node" (RESTART_BM): every rank on node B writes an emergency
        # snapshot (the drain); rank 3, on GPU 1, also moves its MPUs off it; node A does nothing
        for r in ranks[2:]:
            assert r["emergency"] and all(Path(p).is_dir() for p in r["emergency"])
        applied = {a for a, res in ranks[3]["heal"] if res == "applied"}
        if standby:  # node B's agent gave rank 3 its free GPU 2 (GPU 0 is rank 2's): all three MPUs moved there
            assert ranks[3]["gpus"] == {"001": 2, "002": 2, "003": 2}
            assert set(ranks[3]["fuse_levels"].values()) == {"l1_swapped"}
            assert applied >= {"emergency_snapshot", "l1_swap"}
        else:  # none: L2, degraded in place
            assert set(ranks[3]["fuse_levels"].values()) == {"l2_degraded"}
            assert applied >= {"emergency_snapshot", "l2_degrade"} and "l1_swap" not in applied
        for r in ranks[:2]:
            assert r["heal"] == [] and r["emergency"] == [] and set(r["fuse_levels"].values()) == {"healthy"}
        assert [a for a, res in ranks[2]["heal"] if res == "applied"] == ["emergency_snapshot"]
        assert ranks[2]["gpus"] == {"001": 0, "002": 0, "003": 0}
        assert set(ranks[2]["fuse_levels"].values()) == {"healthy"}
    finally:
        if job is not None and job.poll() is None:
            import os

            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=10)
        for p in reversed(procs):
            p.stop()
