"""HTTP connection limits (issue 16, item 2) on a real agent over real sockets: a flood of idle
connections from one address leaves /healthz and /metrics served to another, idle and
headless connections are closed by their deadlines, connections over a cap that cannot evict
an idle one are closed at once, and an agent process under a 1,024 open-files limit survives
the issue's 1,100 idle connections with its descriptors, hook socket and log intact."""

from __future__ import annotations

import http.client
import logging
import os
import re
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import structlog

from mscale.daemon.access import RateLimitedLog
from mscale.demo.embedded import EmbeddedAgent
from support import REPO, free_port

pytestmark = pytest.mark.slow  # connection floods against real agents: about 30 s


@pytest.fixture(autouse=True)
def quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


def poll(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def connect(port: int, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def is_closed(s: socket.socket) -> bool:
    """The agent closed (or reset) this connection; data it sent is read and dropped."""
    s.setblocking(False)
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def open_count(socks: Iterable[socket.socket]) -> int:
    return sum(not is_closed(s) for s in socks)


def get(port: int, path: str, source: str = "127.0.0.2", timeout: float = 10.0) -> tuple[int, bytes]:
    """GET from `source` with the client's normal timeout (a stalled agent fails it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def refused(port: int, why: str, source: str = "127.0.0.2") -> float:
    _, page = get(port, "/metrics", source)
    m = re.search(rf'^mscale_refused_messages_total{{where="http",why="{why}"}} (\S+)$', page.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def port_of(agent: EmbeddedAgent) -> int:
    return int(agent.url.rsplit(":", 1)[1])


def test_an_idle_flood_from_one_peer_leaves_healthz_and_metrics_served():
    limits = {"max_connections": 128, "max_connections_per_peer": 64, "header_timeout_s": 3, "idle_timeout_s": 60}
    with EmbeddedAgent(http=limits) as agent:
        port = port_of(agent)
        flood = [connect(port, "127.0.0.1") for _ in range(200)]
        try:
            for s in flood[1::2]:  # half of them start a request head and never finish it
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            # the flood's newest connections pushed its oldest idle ones out: 64 at most remain
            poll("the per-peer cap", lambda: open_count(flood) <= 64)
            status, body = get(port, "/healthz")
            assert status == 200 and b'"status": "ok"' in body
            status, page = get(port, "/metrics")
            assert status == 200 and b"mscale_agent_start_time_seconds" in page
            # the first-head deadline closes every one of them
            poll("the header deadline", lambda: open_count(flood) == 0)
            evicted, timed_out = refused(port, "idle_evicted"), refused(port, "header_timeout")
            assert evicted >= 200 - 64 and evicted + timed_out == 200
            assert refused(port, "peer_limit") == 0 and refused(port, "connection_limit") == 0
        finally:
            for s in flood:
                s.close()


def test_an_idle_keepalive_connection_is_closed_by_the_idle_timeout():
    with EmbeddedAgent(http={"idle_timeout_s": 1, "header_timeout_s": 30}) as agent:
        s = connect(port_of(agent), "127.0.0.1")
        try:
            s.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port_of(agent)}\r\n\r\n".encode())
            first = b""
            while b"\r\n\r\n" not in first:
                first += s.recv(65536)
            assert first.startswith(b"HTTP/1.1 200")
            poll("the idle timeout", lambda: is_closed(s))
        finally:
            s.close()


def busy(port: int, source: str, token: str) -> socket.socket:
    """A connection serving a request: a webhook POST whose body never comes (the agent has
    answered 100 Continue, so its handler runs)."""
    s = connect(port, source)
    s.sendall(
        (
            f"POST /api/v1/alerts HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 50\r\nExpect: 100-continue\r\n\r\n"
        ).encode()
    )
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 100"), got
    return s


def test_busy_connections_over_a_cap_are_closed_at_once_and_the_body_deadline_frees_them():
    limits = {"max_connections": 8, "max_connections_per_peer": 4, "body_timeout_s": 3, "header_timeout_s": 30}
    with EmbeddedAgent(http=limits) as agent:
        port = port_of(agent)
        held = [busy(port, "127.0.0.1", agent.token) for _ in range(4)]
        try:
            extra = connect(port, "127.0.0.1")  # a fifth from the same peer: nothing idle to evict
            held.append(extra)
            poll("the over-cap connection closed", lambda: is_closed(extra))
            held += [busy(port, "127.0.0.3", agent.token) for _ in range(4)]
            other = connect(port, "127.0.0.2")  # within its peer cap, over the total
            held.append(other)
            poll("the over-total connection closed", lambda: is_closed(other))
            # the body deadline answers the held requests 408 and frees the slots
            poll("/healthz served again", lambda: _healthz_ok(port))
            # (the polls above were refused too while all 8 slots were busy)
            assert refused(port, "peer_limit") == 1 and refused(port, "connection_limit") >= 1
            assert agent.get("/metrics").count('where="webhook",why="timeout"} 8.0') == 1
        finally:
            for s in held:
                s.close()


def _healthz_ok(port: int) -> bool:
    try:
        return get(port, "/healthz", timeout=2)[0] == 200
    except (OSError, http.client.HTTPException):
        return False


def test_refusal_log_lines_are_rate_limited():
    now = [0.0]
    lines = RateLimitedLog(interval_s=10, clock=lambda: now[0])
    written = [lines.warning(("http", "peer_limit"), "x") for _ in range(1000)]
    assert written.count(True) == 1
    now[0] = 10.5
    assert lines.warning(("http", "peer_limit"), "x") and lines.warning(("http", "header_timeout"), "x")


def _limit_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_an_agent_under_1024_open_files_survives_1100_idle_connections(tmp_path: Path):
    """The issue's flood, on a real agent process: 1,100 idle connections (from 20 loopback
    addresses, so the total cap is what holds) against the common 1,024 open-files limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    port = free_port()
    sock_path = tmp_path / "agent.sock"
    (tmp_path / "timeline.yaml").write_text("gpus: 2\nevents: []\n")
    (tmp_path / "agent.toml").write_text(
        f'[agent]\nlisten = "127.0.0.1:{port}"\nsocket_path = "{sock_path}"\nsimulate = "{tmp_path / "timeline.yaml"}"\n'
        "[probes.ebpf]\nenabled = false\n"
        "[http]\nmax_connections = 5000\nheader_timeout_s = 5\n"  # above what 1,024 files allow: capped
    )
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mscale", "agent", "--config", str(tmp_path / "agent.toml")],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_limit_nofile,
        )
    flood: list[socket.socket] = []
    try:
        poll("the agent", lambda: _healthz_ok(port) or proc.poll() is not None, timeout_s=60)
        assert proc.poll() is None, log_path.read_text()[-2000:]
        for i in range(1100):
            flood.append(connect(port, f"127.0.1.{1 + i % 20}"))
        # Refused connections are closed as the loop gets to them: the count settles under the cap.
        poll("the agent's open files under the cap", lambda: len(os.listdir(f"/proc/{proc.pid}/fd")) < 1024 - 64)
        status, _ = get(port, "/healthz")
        assert status == 200
        status, page = get(port, "/metrics")
        assert status == 200 and b"mscale_probe_up" in page
        with socket.socket(socket.AF_UNIX) as hook:  # the hook library's socket still accepts
            hook.connect(str(sock_path))
        poll("the header deadline", lambda: open_count(flood) == 0)
        assert _healthz_ok(port) and proc.poll() is None
        log = log_path.read_text()
        assert "http_connections_capped_by_nofile" in log
        assert log.count("http_connection_refused") < 40, log.count("http_connection_refused")
        assert len(log) < 200_000
    finally:
        for s in flood:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)
