"""The must-show, end to end: `mscale agent --simulate <Xid 79 on GPU 3 at 2 s>` as a real
subprocess on 127.0.0.1; /metrics shows GPU 3's Xid counter and `failed`, the others
`healthy`; the log has exactly one event for the Xid; promtool accepts the live page;
/api/v1/gpus is useful JSON; SIGTERM ends it with status 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from importlib import resources
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import free_port, require_tool

XID_TIMELINE = str(resources.files("mscale.sim") / "timelines" / "xid79_gpu3.yaml")


class Agent:
    def __init__(self, tmp: Path, timeline: str = XID_TIMELINE, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "agent.log"
        cfg = tmp / "agent.toml"
        # Only the probes this test is about: keeps the run light on a shared machine.
        cfg.write_text("[probes.ebpf]\nenabled = false\n[probes.host]\ninterval_s = 1.0\n")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mscale",
                "agent",
                "--config",
                str(cfg),
                "--simulate",
                timeline,
                "--listen",
                f"127.0.0.1:{self.port}",
                "--socket",
                str(tmp / "agent.sock"),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return r.read()

    def metrics(self) -> dict:
        text = self.get("/metrics").decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def log_events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def until(self, fn, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (
                f"agent exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
            )
            try:
                result = fn()
                if result:
                    return result
            except OSError as e:  # not listening yet
                last = e
            time.sleep(0.1)
        raise AssertionError(f"condition not met (last error: {last}); log tail:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = Agent(tmp_path_factory.mktemp("agent"))
    yield a
    a.kill()


def _health(m: dict, gpu: str) -> str:
    states = [
        dict(lb)["state"]
        for (name, lb), v in m.items()
        if name == "mscale_gpu_health" and dict(lb)["gpu"] == gpu and v == 1
    ]
    assert len(states) == 1, states
    return states[0]


@pytest.mark.slow  # a real agent process through a fault timeline: about 3 s
def test_xid_79_on_gpu_3_fails_it_and_only_it(agent) -> None:
    def xid_seen():
        m = agent.metrics()
        xid = [
            v
            for (name, lb), v in m.items()
            if name == "mscale_gpu_xid_errors_total" and dict(lb)["gpu"] == "3" and dict(lb)["xid"] == "79"
        ]
        return m if xid == [1.0] and _health(m, "3") == "failed" else None

    m = agent.until(xid_seen)
    assert [_health(m, str(i)) for i in range(8) if i != 3] == ["healthy"] * 7
    assert not any(name == "mscale_gpu_xid_errors_total" and dict(lb)["gpu"] != "3" for name, lb in m)
    # Exactly one log event for the Xid (JSON lines on stdout).
    xids = agent.until(lambda: [e for e in agent.log_events() if e.get("event") == "gpu_xid"])
    assert len(xids) == 1
    (ev,) = xids
    assert (ev["labels"]["gpu"], ev["labels"]["xid"], ev["labels"]["xid_class"], ev["level"]) == (
        "3",
        "79",
        "fatal",
        "error",
    )
    assert "fallen off the bus" in ev["message"]
    # ... and one in the event API, the same finding.
    events = json.loads(agent.get("/api/v1/events"))["events"]
    assert [(e["reason"], e["labels"]["gpu"]) for e in events if e["reason"].startswith("gpu_")] == [("gpu_xid", "3")]


def test_api_gpus_json(agent) -> None:
    body = agent.until(
        lambda: (lambda b: b if b.get("gpus") and b["gpus"][3]["health"] == "failed" else None)(
            json.loads(agent.get("/api/v1/gpus"))
        )
    )
    assert body["backend"] == "sim" and len(body["gpus"]) == 8 and body["time"] > 0
    g3 = body["gpus"][3]
    assert g3["index"] == 3 and g3["uuid"].startswith("GPU-") and g3["xid_errors"] == [[79, 1]]
    assert any("Xid 79" in r for r in g3["reasons"])
    g0 = body["gpus"][0]
    assert g0["health"] == "healthy" and g0["memory_total_bytes"] > 0 and len(g0["nvlinks"]) == 18
    assert g0["nvlinks"][0] == {
        "link": 0,
        "up": True,
        "replay_errors": 0,
        "recovery_errors": 0,
        "crc_flit_errors": 0,
        "crc_data_errors": 0,
    }


def test_promtool_accepts_the_live_page(agent) -> None:
    promtool = require_tool("promtool")
    agent.until(
        lambda: (
            b"mscale_host_cpu_seconds_total" in agent.get("/metrics") and b"mscale_gpu_health" in agent.get("/metrics")
        )
    )
    page = agent.get("/metrics")
    proc = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert proc.stdout.decode().strip() == "" and proc.stderr.decode().strip() == "", "promtool lint findings"


def test_healthz(agent) -> None:
    body = agent.until(lambda: (lambda b: b if b["probes"].get("gpu") else None)(json.loads(agent.get("/healthz"))))
    assert body["status"] == "ok" and body["probes"]["gpu"] is True and body["probes"]["host"] is True


def test_sigterm_exits_0(tmp_path) -> None:
    a = Agent(tmp_path)
    try:
        a.until(lambda: b"mscale_gpu_health" in a.get("/metrics"))
        code = a.stop()
    finally:
        a.kill()
    assert code == 0, a.log_path.read_text()[-3000:]
    events = [e.get("event") for e in a.log_events()]
    assert events.index("agent_stopping") < events.index("agent_stopped")
    assert "Traceback" not in a.log_path.read_text()
