"""The link protocol module (mscale.link) and the agent's one HTTP client (mscale.agent_client):
wire format byte for byte, validators, the command vocabulary, defaults in one place, and the
client against a real HTTP server that answers, refuses, stalls or talks nonsense."""

from __future__ import annotations

import ast
import http.server
import json
import math
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from mscale import link as protocol
from mscale.agent_client import AgentClient, AgentError
from mscale.findings import Finding, Reason, Severity
from mscale.link import BadMessage, Command, Msg

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "mscale"


# --- wire format --------------------------------------------------------------------------------


def test_messages_are_byte_compatible_with_the_wire_format():
    mpus = (protocol.MpuInfo("001", "vision", 0),)
    assert (
        protocol.encode(protocol.Register(job_id="j", rank=0, pid=7, step=3, mpus=mpus).to_wire())
        == '{"type": "register", "job_id": "j", "rank": 0, "pid": 7, "step": 3, "mpus": [{"mpu_id": "001", '
        '"name": "vision", "path": "", "device": "", "gpu": 0, "gpu_uuid": "", "fuse_level": "healthy", '
        '"params": 0}], "local_rank": 0, "world_size": 1}'
    )
    assert (
        protocol.encode(protocol.Report("j", 2, (protocol.StepReport(step=1, time=5.0),)).to_wire())
        == '{"type": "report", "job_id": "j", "dropped": 2, "reports": [{"step": 1, "time": 5.0, "loss": "nan", '
        '"grad_norm": "nan", "skipped": false, "guard_overhead_ratio": "nan", "mpus": {}, "findings": []}]}'
    )
    assert (
        protocol.encode(protocol.Reply(9, {"ok": True, "step": 4}).to_wire())
        == '{"type": "reply", "id": 9, "ok": true, "step": 4}'
    )
    assert protocol.encode(protocol.Pong(1).to_wire()) == '{"type": "pong", "id": 1}'
    assert (
        protocol.encode(protocol.Registered("j", "node-a").to_wire())
        == '{"type": "registered", "job_id": "j", "node": "node-a"}'
    )
    assert protocol.encode(protocol.Error("no").to_wire()) == '{"type": "error", "error": "no"}'
    assert (
        protocol.encode(protocol.Heal("lr_cool", reason="LossSpike", end=True).to_wire())
        == '{"type": "heal", "action": "lr_cool", "reason": "LossSpike", "end": true}'
    )
    assert (
        protocol.encode(protocol.Chaos("gpu_fault", gpu=1, mode="noise", fault="xid").to_wire())
        == '{"type": "chaos", "kind": "gpu_fault", "gpu": 1, "mode": "noise", "fault": "xid"}'
    )
    # the messages put plain strings on the wire, so a plugin comparing with "heal" still matches
    heal = protocol.Heal("l1_swap").to_wire()
    assert type(heal["type"]) is str and heal["type"] == Command.HEAL == "heal"


def test_every_message_reads_back_what_it_wrote():
    """from_wire(to_wire(m)) == m for every message the two sides exchange (a step report's
    findings come back as the agent's, source "hook:<detector>")."""
    f = Finding("checksum", Reason.CHECKSUM_FAILURE, Severity.WARNING, "x", {"mpu_id": "001"}, time=3.0)
    figures = dict.fromkeys(("backward_s", "gvc", "clip_ratio", *protocol.CHECK_FIGURES), 0.25)
    mpu = protocol.MpuReport(
        forward_s=0.5, grad_norm=float("inf"), gpu=1, fuse_level="l1", memory_used_bytes=2.0, **figures
    )
    step = protocol.StepReport(step=4, time=1.0, loss=2.0, grad_norm=1.0, guard_overhead_ratio=0.01, mpus={"001": mpu})
    step.findings, step.seconds = [f], {"hang": 1.0}  # what a plugin may set
    back = protocol.Report.from_wire(protocol.Report("j", 1, (step,)).to_wire())
    (got,) = back.reports
    assert got.mpus == {"001": mpu} and got.seconds == {"hang": 1.0} and (got.step, got.time, got.loss) == (4, 1.0, 2.0)
    assert got.refused_findings == [] and (got.grad_norm, got.guard_overhead_ratio) == (1.0, 0.01)
    assert [g.source for g in got.findings] == ["hook:checksum"] and got.findings[0].labels == f.labels
    assert (back.job_id, back.dropped) == ("j", 1)
    reg = protocol.Register(
        "j", 2, 9, 5, (protocol.MpuInfo("001", "v", 3, "m.v", "cpu", "GPU-3", "l1", 10),), 2, 4, protocol.Pod("p", "n")
    )
    assert protocol.Register.from_wire(reg.to_wire()) == reg
    for msg in (
        protocol.Heal("l1_swap", rule="r", gpu="3", decided_at=1.5, end=True),
        protocol.StandbyRequest(3, "001", 2, (5, 7)),
        protocol.Standby(3, None, why="none free", decided=False),
        protocol.Contract("j", 0, {"contract_id": "0123456789ab", "compute_profile": "default"}),
        protocol.Msrp("j", 0, {"0": {"bandwidth_bytes_per_s": 1.0}}, {"001": {"flops_per_step": 2.0}}),
        protocol.Registered("j", "n"),
        protocol.Error("no"),
        protocol.Pong(1),
        protocol.Reply(2, {"ok": True}),
    ):
        assert type(msg).from_wire(msg.to_wire()) == msg, msg
    assert protocol.Chaos.from_wire(protocol.Chaos("hang", seconds=2.0).to_wire()).injection() == {
        "kind": "hang",
        "seconds": 2.0,
    }


def test_the_engines_heal_command_is_the_protocols():
    from mscale.healing.engine import Decision, Target

    d = Decision(
        rule="xid_fatal",
        action="l1_swap",
        level="L1",
        target=Target("job", "001", 3, "GPU-x"),
        before="healthy",
        reason="gpu_xid",
        why="Xid 79",
        time=12.5,
    )
    for cmd in (d.command(), d.command(end=True)):
        wire = cmd.to_wire()
        assert protocol.Heal.from_wire(wire) == cmd
        assert set(wire) - {"type", "action"} <= protocol.HEAL_FIELDS
        assert Decision.from_command(cmd, "job").fault_key == d.fault_key
    with pytest.raises(BadMessage, match="unknown field"):
        protocol.Heal.from_wire({"type": "heal", "action": "l1_swap", "colour": "red"})
    with pytest.raises(ValueError, match="kind"):
        protocol.Chaos("meteor")


# --- reading and validating ---------------------------------------------------------------------

REG = {
    "type": "register",
    "job_id": "job-1",
    "rank": 0,
    "pid": 12,
    "mpus": [{"mpu_id": "001", "name": "vision", "gpu": 0}],
}


def test_decode_refuses_oversized_malformed_and_untyped_frames():
    assert protocol.decode(json.dumps(REG), 4096) == REG
    cases = [
        ("x" * 5000, "oversized", "over socket.max_message_bytes"),
        ("not json", "malformed", "not JSON"),
        ("[1, 2]", "malformed", "JSON object"),
        ('{"type": 3}', "malformed", "string 'type'"),
    ]
    for frame, why, words in cases:
        with pytest.raises(BadMessage, match=words) as e:
            protocol.decode(frame, 4096)
        assert e.value.why == why


@pytest.mark.parametrize(
    "change,words",
    [
        ({"job_id": "has space"}, "job_id"),
        ({"rank": -1}, "rank"),
        ({"rank": True}, "rank"),
        ({"pid": 0}, "pid"),
        ({"mpus": []}, "mpus must be a list of 1 to 64"),
        ({"mpus": [{"mpu_id": "001", "name": "v", "gpu": 0}] * 2}, "repeated"),
        ({"mpus": [{"mpu_id": "001", "name": "v", "gpu": 4096}]}, "gpu must be a GPU index"),
        ({"local_rank": -1}, "local_rank"),
        ({"local_rank": "0"}, "local_rank"),
        ({"world_size": 0}, "world_size"),
        ({"rank": 4, "world_size": 4}, "above rank"),
        ({"world_size": 1.5}, "world_size"),
    ],
)
def test_register_validator(change, words):
    assert protocol.Register.from_wire(REG).mpus == (protocol.MpuInfo("001", "vision", 0),)
    protocol.Register.from_wire({**REG, "rank": 3, "local_rank": 3, "world_size": 8})  # both optional
    with pytest.raises(BadMessage, match=words):
        protocol.Register.from_wire({**REG, **change})


@pytest.mark.parametrize(
    "report,words",
    [
        ({"reports": "x"}, "reports must be a list"),
        ({"reports": [], "dropped": -1}, "dropped"),
        ({"reports": [{"step": "x"}]}, "step"),
        ({"reports": [{"step": 1, "loss": "big"}]}, "loss"),
        ({"reports": [{"step": 1, "mpus": {"001": {"gvc": [1]}}}]}, "gvc"),
        ({"reports": [{"step": 1, "findings": {}}]}, "findings must be a list"),
        ({"reports": [{"step": 0}] * (protocol.MAX_REPORTS + 1)}, "reports must be a list"),
    ],
)
def test_report_validator(report, words):
    (step,) = protocol.Report.from_wire(
        {"reports": [{"step": 1, "loss": "nan", "grad_norm": 2.0, "mpus": {"001": {"gvc": None}}}]}
    ).reports
    assert math.isnan(step.loss) and step.grad_norm == 2.0 and math.isnan(step.mpus["001"].gvc)
    with pytest.raises(BadMessage, match=words):
        protocol.Report.from_wire(report)


def test_a_reported_finding_is_read_back_clamped():
    sent = Finding(
        "checksum",
        Reason.CHECKSUM_FAILURE,
        Severity.WARNING,
        "m" * 5000,
        {f"k{i}": "v" * 999 for i in range(40)},
        time=5.0,
    ).to_dict()
    got = protocol.finding(sent)
    assert got.source == "hook:checksum" and got.reason is Reason.CHECKSUM_FAILURE and got.time == 5.0
    assert len(got.message) == protocol.MAX_FINDING_MESSAGE and len(got.labels) == protocol.MAX_FINDING_LABELS
    assert {len(v) for v in got.labels.values()} == {protocol.MAX_LABEL_VALUE}
    assert protocol.finding({**sent, "reason": "no_such_reason"}) is None
    assert protocol.finding({**sent, "labels": ["x"]}) is None and protocol.finding("x") is None


def test_check_command_and_the_vocabulary():
    protocol.check_command({"type": "probe"})  # a plugin may take types beyond Command
    for bad in ({"kind": "x"}, {"type": 1}, ["type"]):
        with pytest.raises(ValueError, match="string 'type'"):
            protocol.check_command(bad)
    assert not set(Msg) & set(Command), "a message type and a command type share a name"
    assert protocol.RESERVED | protocol.ACCEPTED_SILENTLY <= set(Msg)


# --- defaults in one place ----------------------------------------------------------------------


def test_socket_path_precedence(monkeypatch):
    monkeypatch.delenv(protocol.SOCKET_ENV, raising=False)
    assert protocol.socket_path() == protocol.DEFAULT_SOCKET == "/run/mscale/agent.sock"
    monkeypatch.setenv(protocol.SOCKET_ENV, "/tmp/env.sock")
    assert protocol.socket_path() == "/tmp/env.sock" and protocol.socket_path("/tmp/x.sock") == "/tmp/x.sock"


def test_defaults_everywhere_are_the_protocols():
    from mscale import cli
    from mscale.daemon import config

    assert protocol.DEFAULT_LISTEN == "127.0.0.1:9477" and protocol.DEFAULT_URL == "http://127.0.0.1:9477"
    cfg = config.from_dict({})
    assert cfg.agent.listen == protocol.DEFAULT_LISTEN and cfg.agent.socket_path == protocol.DEFAULT_SOCKET
    assert cfg.socket.max_message_bytes == protocol.MAX_MESSAGE_BYTES
    parser = cli.build_parser()
    assert parser.parse_args(["status"]).agent == protocol.DEFAULT_URL
    assert parser.parse_args(["chaos", "inject", "nan-loss"]).agent == protocol.DEFAULT_URL
    assert parser.parse_args(["demo"]).listen == protocol.DEFAULT_LISTEN
    params = yaml.safe_load((PKG / "rules" / "params.yaml").read_text())
    assert params["alertmanager"]["webhook_url"] == protocol.DEFAULT_URL + "/api/v1/alerts"


def test_the_protocol_and_the_client_load_neither_torch_nor_aiohttp():
    code = (
        "import sys, mscale.link, mscale.agent_client; "
        "print(sorted(m for m in ('torch', 'aiohttp', 'mscale.daemon') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _calls_urlopen(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.Attribute) and n.attr == "urlopen" for n in ast.walk(tree))


def test_one_http_client_of_the_agent_and_no_message_literals_in_the_link_ends():
    # dcgm.py reads dcgm-exporter, not the agent
    users = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if _calls_urlopen(p))
    assert users == ["agent_client.py", "probes/dcgm.py"], users
    for rel in ("daemon/link.py", "hook/core/link.py"):
        text = (PKG / rel).read_text()
        assert '"type":' not in text and "json." not in text, f"{rel} builds or parses messages itself"


# --- the HTTP client against a real server ------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    release: threading.Event
    stall_ended: threading.Event
    seen: list

    def log_message(self, *args) -> None:
        pass

    def _answer(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, None, self.headers.get("Authorization")))
        if self.path.startswith("/api/v1/status"):
            self._answer(200, json.dumps({"node": "n", "asked": self.path}).encode())
        elif self.path == "/metrics":
            self._answer(200, b"# HELP x\nx 1\n", "text/plain")
        elif self.path == "/stall":
            self.release.wait(30)
            self.stall_ended.set()
            self._answer(200, b"{}")
        elif self.path == "/html":
            self._answer(200, b"<html>hi</html>", "text/html")
        else:
            self._answer(404, b"no such route")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("POST", self.path, body, self.headers.get("Authorization")))
        if body.get("kind") == "meteor":
            self._answer(400, json.dumps({"error": "kind: expected one of"}).encode())
        elif body.get("kind") == "teapot":
            self._answer(418, b"short and stout", "text/plain")
        else:
            self._answer(200, json.dumps({"injected": body.get("kind")}).encode())


@pytest.fixture
def server():
    handler = type("H", (_Handler,), {"release": threading.Event(), "stall_ended": threading.Event(), "seen": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, handler
    finally:
        handler.release.set()
        srv.shutdown()
        srv.server_close()


def test_client_calls_the_api_and_passes_errors_back(server):
    srv, h = server
    host, port = srv.server_address
    client = AgentClient(f"{host}:{port}/", timeout=5)  # a bare HOST:PORT is taken as http
    assert client.url == f"http://{host}:{port}"
    assert client.status(events=3) == {"node": "n", "asked": "/api/v1/status?events=3"}
    assert client.metrics() == "# HELP x\nx 1\n"
    assert client.chaos({"kind": "nan_loss"}) == (200, {"injected": "nan_loss"})
    assert client.chaos({"kind": "meteor"}) == (400, {"error": "kind: expected one of"})
    assert client.chaos({"kind": "teapot"}) == (418, {"error": "short and stout"})
    assert client.post_json("/api/v1/alerts", {"kind": "x"}, token="t0k") == (200, {"injected": "x"})
    assert h.seen[-1] == ("POST", "/api/v1/alerts", {"kind": "x"}, "Bearer t0k")
    with pytest.raises(
        AgentError, match=rf"the agent at http://{host}:{port} answered GET /nope with HTTP 404: no such route"
    ):
        client.get_json("/nope")
    with pytest.raises(
        AgentError, match=rf"at http://{host}:{port} answered GET /html with something that is not JSON"
    ):
        client.get_json("/html")


def test_client_times_out_naming_the_agent(server):
    srv, h = server
    host, port = srv.server_address
    client = AgentClient(f"http://{host}:{port}", timeout=0.3)
    with pytest.raises(AgentError, match=rf"the agent at http://{host}:{port} did not answer GET /stall within 0.3 s"):
        client.get("/stall")
    assert not h.stall_ended.is_set()  # the client gave up while the server still held the answer
    h.release.set()


def test_client_says_which_agent_it_cannot_reach():
    with socket.socket() as s:  # bound, never listening: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(AgentError, match=rf"cannot reach the agent at http://127.0.0.1:{port}: .*refused"):
            AgentClient(f"http://127.0.0.1:{port}", timeout=5).status()
    with pytest.raises(AgentError, match="cannot reach the agent at ftp-ish://x"):
        AgentClient("ftp-ish://x").status()
    with pytest.raises(ValueError, match="timeout"):
        AgentClient(timeout=0)


def test_a_heal_commands_gpu_is_read_once_at_the_wire_edge_as_an_index_in_range():
    from mscale.healing.engine import Decision

    def target_gpu(text: str) -> int | None:
        return Decision.from_command(protocol.Heal("quarantine_gpu", gpu=text), "job").target.gpu

    assert target_gpu("3") == 3 and target_gpu("0") == 0 and target_gpu("4095") == 4095
    for bad in ("", "4096", "007", "-1", "²", "3.0", " 3"):
        assert target_gpu(bad) is None, bad
