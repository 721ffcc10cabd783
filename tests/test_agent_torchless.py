"""The agent as the README installs it on a node (the package without the `hook` extra, so no
torch): a real `mscale agent --simulate` process in which every module of the extras is
unimportable (tests/support/torchless.py). Every healing action's spec loads there, every
alert the shipped policy names is posted to the webhook, firing then resolved, and each answer
is 2xx (or a documented 4xx); /metrics still serves and no refused import was attempted.

The bug this holds: a resolved MscaleChecksumFailures loaded every action of its rule, and the
L2 action's module pulled in the hook library and torch: HTTP 500, resent by Alertmanager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mscale.healing import policy as policymod
from support import REPO, free_port, stop_process

TORCHLESS = str(REPO / "tests" / "support" / "torchless.py")
TIMELINE = str(resources.files("mscale.sim") / "timelines" / "default.yaml")
TOKEN = "t0ken-for-the-test"
# the 4xx the webhook documents (docs/healing.md, mscale/daemon/webhook.py): none is expected
# of a well-formed, authenticated payload, but one of them would not be a server fault
DOCUMENTED_4XX = (400, 401, 403, 413, 415, 429)


def _env(refused: Path) -> dict[str, str]:
    return {**os.environ, "MSCALE_WEBHOOK_TOKEN": TOKEN, "MSCALE_TEST_REFUSED": str(refused)}


def test_the_finder_refuses_torch_and_the_hook_library(tmp_path: Path) -> None:
    """The set-up is honest: under it torch cannot be imported, nor the job side's actions;
    the specs the agent needs can."""
    code = (
        "import importlib\n"
        "from mscale.healing import actions\n"
        "assert [s.name for s in actions.specs()] == list(actions.NAMES)\n"
        "for m in ('torch', 'mscale.hook.fuse.actions'):\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError:\n"
        "        print('refused', m)\n"
    )
    refused = tmp_path / "refused"
    out = subprocess.run(
        [sys.executable, TORCHLESS, "-c", code], env=_env(refused), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["refused torch", "refused mscale.hook.fuse.actions"]
    assert "torch" in refused.read_text().split()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchless")
    port = free_port()
    cfg = tmp / "agent.toml"
    cfg.write_text("[probes.ebpf]\nenabled = false\n[probes.host]\ninterval_s = 1.0\n")
    log = tmp / "agent.log"
    refused = tmp / "refused"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, TORCHLESS, "agent", "--config", str(cfg), "--simulate", TIMELINE]
            + ["--listen", f"127.0.0.1:{port}", "--socket", str(tmp / "agent.sock")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(refused),
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"agent exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            urllib.request.urlopen(url + "/healthz", timeout=2).read()
            break
        except OSError:
            assert time.monotonic() < deadline, "the agent never answered /healthz:\n" + log.read_text()[-3000:]
            time.sleep(0.1)
    yield url, log, refused, proc
    stop_process(proc)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/api/v1/alerts",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"body": e.read().decode(errors="replace")}


def _payload(alertname: str, status: str, gpu_uuid: str) -> dict:
    labels = {
        "alertname": alertname,
        "severity": "critical",
        "gpu": "0",
        "gpu_uuid": gpu_uuid,
        "job_id": "job-on-node",
        "mpu_id": "001",
        "node": "sim-node",
    }
    alert = {
        "status": status,
        "labels": labels,
        "annotations": {"summary": f"{alertname} in the torch-free test"},
        "startsAt": "2026-11-30T04:30:27.123Z",
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-11-30T04:35:27.123Z",
        "fingerprint": f"fp-{alertname}",
    }
    return {
        "receiver": "mscale",
        "status": status,
        "alerts": [alert],
        "groupLabels": {"alertname": alertname},
        "commonLabels": labels,
        "commonAnnotations": {},
        "externalURL": "http://127.0.0.1:9093",
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{alertname}"}}',
        "truncatedAlerts": 0,
    }


def test_every_alert_of_the_shipped_policy_firing_then_resolved(agent) -> None:
    url, log, refused, proc = agent
    names = sorted({a for rule in policymod.load("").rules for a in rule.alerts})
    assert {"MscaleChecksumFailures", "MscaleMpuHealthLow", "MscaleGpuFatalXid"} <= set(names)
    deadline = time.monotonic() + 30
    while not (gpus := json.loads(urllib.request.urlopen(url + "/api/v1/gpus", timeout=5).read())["gpus"]):
        assert time.monotonic() < deadline, "the simulated GPUs were never sampled"
        time.sleep(0.1)
    uuid = gpus[0]["uuid"]
    answers = []
    for name in names:
        for status in ("firing", "resolved"):
            code, body = _post(url, _payload(name, status, uuid))
            answers.append((name, status, code, body))
            assert 200 <= code < 300 or code in DOCUMENTED_4XX, f"{name} {status}: HTTP {code} {body}"
    # a well-formed, authenticated payload is taken: each alert counted by its status
    for name, status, code, body in answers:
        assert code == 200 and body[status] == 1, (name, status, code, body)
    page = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    families = {f.name for f in text_string_to_metric_families(page)}
    assert {"mscale_gpu_health", "mscale_heal_actions"} <= families, sorted(families)
    assert proc.poll() is None
    assert not refused.exists() or not refused.read_text(), "the agent tried to import: " + refused.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
