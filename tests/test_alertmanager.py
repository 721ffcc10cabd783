"""The Alertmanager example: amtool checks it, amtool routes each severity, and a real
Alertmanager on 127.0.0.1 applies the inhibition rules and delivers to a webhook with the token."""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from mscale.rules import params as paramsmod
from mscale.rules import render
from support import REPO, free_port, require_tool
from support.alertmanager import Alertmanager, adapted_config

SHIPPED = REPO / "mscale" / "rules" / "alertmanager.yml"
DEPLOY = REPO / "deploy" / "alertmanager.yml"
TOKEN = "s3cret-test-token"


class WebhookSink:
    """Records what Alertmanager POSTs, with the Authorization header."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api/v1/alerts"

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append((request.headers.get("Authorization", ""), await request.json()))
        return web.json_response({"ok": True})

    async def __aenter__(self) -> WebhookSink:
        app = web.Application()
        app.router.add_post("/api/v1/alerts", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    def delivered(self) -> set[tuple]:
        return {
            (a["labels"]["alertname"], a["labels"].get("node"), a["labels"].get("gpu_uuid"), a["labels"].get("mpu_id"))
            for _, body in self.calls
            for a in body["alerts"]
            if a["status"] == "firing"
        }


def rule_labels(name: str) -> dict[str, str]:
    doc = yaml.safe_load((REPO / "mscale" / "rules" / render.ALERTS_FILE).read_text())
    return next(r["labels"] for g in doc["groups"] for r in g["rules"] if r["alert"] == name)


def alert(name: str, **labels: str) -> dict:
    now = dt.datetime.now(dt.UTC)
    return {
        "labels": {"alertname": name, **rule_labels(name), **labels},
        "annotations": {"summary": name},
        "startsAt": now.isoformat(),
        "endsAt": (now + dt.timedelta(minutes=10)).isoformat(),
    }


# --- static checks -------------------------------------------------------------------


def test_deploy_copy_is_the_shipped_file():
    assert DEPLOY.read_text() == SHIPPED.read_text()


@pytest.mark.parametrize("path", [SHIPPED, DEPLOY], ids=["package", "deploy"])
def test_amtool_check_config(path: Path):
    amtool = require_tool("amtool")
    out = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 inhibit rules" in out.stdout


ROUTE_CASES = [
    ({"alertname": "MscaleGpuFatalXid", "severity": "critical", "node": "node-a"}, "mscale-p0"),
    ({"alertname": "MscaleAgentDown", "severity": "critical", "node": "node-a"}, "mscale-p0"),
    ({"alertname": "MscaleMpuHealthLow", "severity": "warning", "node": "node-a", "job_id": "j1"}, "mscale-p1"),
    ({"alertname": "MscaleGpuDegraded", "severity": "info", "node": "node-a"}, "mscale-p2"),
    ({"alertname": "SomethingElse", "node": "node-a"}, "mscale-default"),
    ({"alertname": "SomethingElse", "severity": "page"}, "mscale-default"),
]


@pytest.mark.parametrize(
    "labels,receiver", ROUTE_CASES, ids=[f"{lb.get('severity', 'none')}-{lb['alertname']}" for lb, _ in ROUTE_CASES]
)
def test_amtool_routes_each_severity(labels: dict, receiver: str):
    amtool = require_tool("amtool")
    args = [f"{k}={v}" for k, v in labels.items()]
    out = subprocess.run(
        [amtool, "config", "routes", "test", f"--config.file={SHIPPED}", f"--verify.receivers={receiver}", *args],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == receiver


def test_amtool_route_test_can_fail():
    amtool = require_tool("amtool")
    out = subprocess.run(
        [
            amtool,
            "config",
            "routes",
            "test",
            f"--config.file={SHIPPED}",
            "--verify.receivers=mscale-p2",
            "severity=critical",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0


def test_every_rule_severity_has_its_route_and_timings_escalate():
    cfg = yaml.safe_load(SHIPPED.read_text())
    routes = {r["matchers"][0]: r for r in cfg["route"]["routes"]}
    severities = {rule_labels(a)["severity"] for a in paramsmod.load()["alerts"]}
    assert {f'severity="{s}"' for s in severities} == set(routes)
    assert cfg["route"]["group_by"] == ["alertname", "node", "job_id"]
    secs = {"s": 1, "m": 60, "h": 3600}
    p0, p1, p2 = (routes[f'severity="{s}"'] for s in ("critical", "warning", "info"))
    for key in ("group_wait", "group_interval", "repeat_interval"):
        v0, v1, v2 = (int(r[key][:-1]) * secs[r[key][-1]] for r in (p0, p1, p2))
        assert v0 <= v1 <= v2 and v0 < v2, key  # P0 at once and often, P2 batched
    for r in cfg["receivers"]:
        hook = r["webhook_configs"][0]
        assert hook["url"].endswith("/api/v1/alerts") and hook["send_resolved"] is True
        assert hook["http_config"]["authorization"]["type"] == "Bearer"
    inhibited_sources = {
        a for rule in cfg["inhibit_rules"] for m in rule["source_matchers"] for a in m.split('"')[1].split("|")
    }
    assert inhibited_sources <= set(paramsmod.load()["alerts"]), "an inhibition names an alert the rules lack"


# --- a real Alertmanager ---------------------------------------------------------------


async def test_real_alertmanager_inhibits_symptoms_and_delivers_the_rest_with_the_token(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with WebhookSink() as sink, aiohttp.ClientSession() as session:
        with Alertmanager(adapted_config(sink.url, token_file), tmp_path) as am:
            await am.wait_ready(session)
            # the root causes first, as the rules' for-durations make them fire first (see
            # test_inhibition_sources_fire_before_their_targets)
            causes = [
                alert("MscaleGpuFatalXid", node="node-a", gpu="3", gpu_uuid="GPU-3", xid="79"),
                alert("MscaleAgentDown", node="node-b", instance="node-b:9477"),
                alert("MscaleNodeDown", node="node-c"),
            ]
            async with session.post(f"{am.url}/api/v2/alerts", json=causes) as r:
                assert r.status == 200, await r.text()
            deadline = time.monotonic() + 30
            while len(sink.delivered()) < len(causes):
                assert time.monotonic() < deadline, f"causes not delivered: {sink.delivered()}\n{am.logs()}"
                await asyncio.sleep(0.1)
            sent = causes + [
                # training alerts the GPU failure explains (same gpu_uuid), and one it does not
                alert("MscaleMpuHealthLow", node="node-a", job_id="j1", mpu_id="001", gpu="3", gpu_uuid="GPU-3"),
                alert("MscaleChecksumFailures", node="node-a", job_id="j1", mpu_id="001", gpu="3", gpu_uuid="GPU-3"),
                alert("MscaleMpuHealthLow", node="node-a", job_id="j1", mpu_id="002", gpu="5", gpu_uuid="GPU-5"),
                alert("MscaleGpuTemperatureHigh", node="node-a", gpu="3", gpu_uuid="GPU-3"),
                # an agent down hides its probe alerts, not another node's
                alert("MscaleProbeDown", node="node-b", probe="gpu"),
                alert("MscaleProbeDown", node="node-a", probe="ebpf"),
                # a node down hides everything else on that node
                alert("MscaleAgentDown", node="node-c", instance="node-c:9477"),
                alert("MscaleGpuTemperatureHigh", node="node-c", gpu="0", gpu_uuid="GPU-C0"),
                alert("MscaleMpuHealthLow", node="node-c", job_id="j9", mpu_id="001", gpu="0", gpu_uuid="GPU-C0"),
            ]
            async with session.post(f"{am.url}/api/v2/alerts", json=sent[len(causes) :]) as r:
                assert r.status == 200, await r.text()

            while True:  # until Alertmanager has routed and judged every alert
                async with session.get(f"{am.url}/api/v2/alerts") as r:
                    got = await r.json()
                if len(got) == len(sent) and all(a["status"]["state"] != "unprocessed" for a in got):
                    break
                assert time.monotonic() < deadline, f"alerts not processed: {got}\n{am.logs()}"
                await asyncio.sleep(0.2)

            def key(a: dict) -> tuple:
                lb = a["labels"]
                return (lb["alertname"], lb.get("node"), lb.get("gpu_uuid"), lb.get("mpu_id"))

            inhibited = {key(a) for a in got if a["status"]["inhibitedBy"]}
            assert inhibited == {
                ("MscaleMpuHealthLow", "node-a", "GPU-3", "001"),
                ("MscaleChecksumFailures", "node-a", "GPU-3", "001"),
                ("MscaleProbeDown", "node-b", None, None),
                ("MscaleAgentDown", "node-c", None, None),
                ("MscaleGpuTemperatureHigh", "node-c", "GPU-C0", None),
                ("MscaleMpuHealthLow", "node-c", "GPU-C0", "001"),
            }
            active = {key(a) for a in got} - inhibited

            while sink.delivered() != active:  # every alert left active reaches the webhook
                assert time.monotonic() < deadline, f"delivered {sink.delivered()} != {active}\n{am.logs()}"
                await asyncio.sleep(0.2)
            assert {auth for auth, _ in sink.calls} == {f"Bearer {TOKEN}"}
            receivers = {body["receiver"] for _, body in sink.calls}
            assert receivers == {"mscale-p0", "mscale-p1"}
            for _, body in sink.calls:  # grouped by alertname, node, job_id
                assert set(body["groupLabels"]) <= {"alertname", "node", "job_id"}
                assert {a["labels"]["severity"] for a in body["alerts"]} == {
                    {"mscale-p0": "critical", "mscale-p1": "warning"}[body["receiver"]]
                }


def test_inhibition_sources_fire_before_their_targets():
    """Alertmanager can only hide an alert whose cause it already holds: a cause must not need
    longer to fire (`for`) than the symptoms it inhibits, else the symptom pages first."""
    secs = {"s": 1, "m": 60, "h": 3600}
    params = paramsmod.load()["alerts"]
    wait = {a: int(p["for"][:-1]) * secs[p["for"][-1]] for a, p in params.items()}
    assert wait["MscaleNodeDown"] < wait["MscaleAgentDown"]
    gpu_causes = [a for a in params if rule_labels(a)["component"] == "gpu" and params[a]["severity"] == "critical"]
    training = [a for a in params if rule_labels(a)["component"] == "training"]
    assert max(wait[a] for a in gpu_causes) <= min(wait[a] for a in training)
