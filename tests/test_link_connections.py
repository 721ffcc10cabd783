"""Issue 25 item 6, the hook socket: connections from refused uids are closed at once, a
handshake or a registration that never comes is closed by its deadline (nothing sent, half a
request head, a frame header and 3 of its 1,000 bytes), and one uid's connections are capped,
while /healthz and /metrics keep answering. The attackers are real processes, a real second
user where the attack needs one; each attack is bounded (a few hundred connections, seconds)."""

from __future__ import annotations

import base64
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from support import REPO, free_port
from support.link_agent import Agent, RawLink, metric, wait_for
from support.users import second_uid

MPUS = [{"mpu_id": "001", "name": "text", "gpu": 0}]
IDLE = Path(__file__).parent / "support" / "idle_connections.py"
PEER = Path(__file__).parent / "support" / "link_peer.py"


@pytest.fixture
def other() -> tuple[int, int]:
    return second_uid()


@pytest.fixture
def shared_sock():
    tmp = tempfile.mkdtemp(prefix="mscale-conn-")
    os.chmod(tmp, 0o755)
    yield os.path.join(tmp, "agent.sock")
    shutil.rmtree(tmp, ignore_errors=True)


def idle(uid: int, sock: str, count: int, seconds: float, mode: str = "silent") -> dict:
    out = subprocess.run(
        [sys.executable, str(IDLE), str(uid), sock, str(count), str(seconds), mode],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def answers(agent: Agent) -> None:
    """/healthz and /metrics answer, each within the probe's usual timeout."""
    for path in ("/healthz", "/metrics"):
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}{path}", timeout=10) as r:
            assert r.status == 200


def test_a_refused_uids_connections_are_closed_at_once(other, shared_sock: str) -> None:
    # the attack: idle connections from a uid the socket refuses were never closed
    agent = Agent(shared_sock, mode=0o666)
    try:
        got = idle(other[0], shared_sock, 300, 5)
        assert got == {"opened": 300, "closed": 300}, got  # within 5 s: before any deadline (10 s)
        assert agent.state.refused[("socket", "peer_uid")] == 300
        answers(agent)
    finally:
        agent.stop()


@pytest.mark.parametrize("mode", ["silent", "half_head"])
def test_a_handshake_that_never_comes_is_closed_by_its_deadline(tmp_path: Path, mode: str) -> None:
    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock, handshake_timeout_s=1, register_timeout_s=600)
    try:
        got = idle(os.getuid(), sock, 100, 15, mode)
        assert got == {"opened": 100, "closed": 100}, got
        assert agent.state.refused[("socket", "handshake_timeout")] == 100
        answers(agent)
    finally:
        agent.stop()


def _handshake(sock_path: str) -> socket.socket:
    """A websocket handshake done by hand, so that a frame can be left unfinished."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock_path)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        (
            "GET /v1/link HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        assert chunk, "closed during the handshake"
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while True:
            if s.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_a_connection_that_never_registers_is_closed_by_its_deadline(tmp_path: Path) -> None:
    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock, handshake_timeout_s=600, register_timeout_s=1)
    raw = RawLink(sock)  # a job that registers in time: first, so its deadline passes first
    reg = {"type": "register", "job_id": "j", "rank": 0, "pid": 1, "step": 0, "mpus": MPUS}
    assert json.loads(raw.ask(json.dumps(reg)))["type"] == "registered"
    conns = [_handshake(sock) for _ in range(3)]
    try:
        # one sends nothing, one a text frame header for 1,000 bytes and 3 of them, one 3 pings
        header = bytes([0x81, 0x80 | 126]) + (1000).to_bytes(2, "big") + os.urandom(4)
        conns[1].sendall(header + b"abc")
        for _ in range(3):
            conns[2].sendall(bytes([0x89, 0x80]) + os.urandom(4))
        assert all(_closed_within(s, 15) for s in conns)
        assert agent.state.refused[("socket", "register_timeout")] == 3
        # the registered job's deadline passed before theirs: it stays
        assert agent.state.jobs["j"].connected
        assert json.loads(raw.ask(json.dumps({"type": "still-there"})))["type"] == "error"
        answers(agent)
    finally:
        raw.close()
        for s in conns:
            s.close()
        agent.stop()


def test_one_uids_connections_are_capped_and_another_uid_still_connects(other, shared_sock: str) -> None:
    agent = Agent(shared_sock, mode=0o666, allowed_uids=[other[0]], max_connections_per_uid=8)
    links = []
    try:
        for i in range(8):
            links.append(RawLink(shared_sock))
            reg = {"type": "register", "job_id": f"mine-{i}", "rank": 0, "pid": 1, "step": 0, "mpus": MPUS}
            assert json.loads(links[-1].ask(json.dumps(reg)))["type"] == "registered"
        got = idle(os.getuid(), shared_sock, 50, 10)  # root's 9th and later: closed at once
        assert got == {"opened": 50, "closed": 50}, got
        assert agent.state.refused[("socket", "uid_connection_limit")] == 50
        assert metric(agent.metrics(), 'mscale_refused_messages_total{where="socket",why="uid_connection_limit"}') == 50
        # another uid is not kept out by root's connections
        reg = {"type": "register", "job_id": "theirs", "rank": 0, "pid": 1, "step": 0, "mpus": MPUS}
        peer = subprocess.run(
            [sys.executable, str(PEER), str(other[0]), shared_sock, json.dumps([[reg]]), "0.1"],
            input="go\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert peer.returncode == 0, peer.stderr
        assert json.loads(peer.stdout.splitlines()[0])["type"] == "registered"
        assert all(agent.state.jobs[f"mine-{i}"].connected for i in range(8))
        answers(agent)
    finally:
        for raw in links:
            raw.close()
        agent.stop()


def _limit_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_1124_idle_connections_leave_no_accept_tracebacks_in_the_agents_log(other, shared_sock: str) -> None:
    """The issue's flood on a real agent process under the common 1,024 open-files limit: 1,124
    idle connections from a uid the socket refuses, then 1,124 from an allowed uid (past its
    cap). Before, they filled the agent's descriptors and asyncio logged about 8,500 accept()
    tracebacks a second; now each is closed at accept or by its handshake deadline."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    tmp = Path(shared_sock).parent
    port = free_port()
    (tmp / "timeline.yaml").write_text("gpus: 2\nevents: []\n")
    (tmp / "agent.toml").write_text(
        f'[agent]\nlisten = "127.0.0.1:{port}"\nsocket_path = "{shared_sock}"\n'
        f'simulate = "{tmp / "timeline.yaml"}"\n'
        "[probes.ebpf]\nenabled = false\n"
        f"[socket]\nmode = {0o666}\nhandshake_timeout_s = 3\n"
    )
    log_path = tmp / "agent.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mscale", "agent", "--config", str(tmp / "agent.toml")],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_limit_nofile,
        )
    try:
        wait_for(lambda: os.path.exists(shared_sock) or proc.poll() is not None, 60, "the agent's socket")
        assert proc.poll() is None, log_path.read_text()[-2000:]
        refused_uid = idle(other[0], shared_sock, 1124, 10)
        assert refused_uid == {"opened": 1124, "closed": 1124}, refused_uid
        allowed_uid = idle(os.getuid(), shared_sock, 1124, 30)  # 256 of them wait for their deadline
        assert allowed_uid == {"opened": 1124, "closed": 1124}, allowed_uid
        for path in ("/healthz", "/metrics"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                assert r.status == 200
        assert proc.poll() is None
        log = log_path.read_text()
        assert "accept" not in log and "Traceback" not in log and "out of system resource" not in log, log[-3000:]
        assert log.count("link_connection_refused") < 40  # rate-limited
    finally:
        proc.terminate()
        proc.wait(timeout=30)
