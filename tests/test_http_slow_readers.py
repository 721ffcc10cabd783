"""Issue 25 item 6, HTTP: slow readers do not keep /healthz and /metrics from answering. The
issue's two attacks on a real agent over real sockets, each for the issue's 60 s: 64
connections from 127.0.0.1 that ask for /metrics and read a byte a second (the probes from
127.0.0.1 too), and 512 of them over 127.0.0.1-8 (the probes from 127.0.0.9). Before, the
readers held every slot of the per-peer or the total cap while their responses stalled, so each
probe was closed at once. Now a stalled connection is the first to make room, and is closed
after `http.write_timeout_s`."""

from __future__ import annotations

import http.client
import logging
import re
import resource
import socket
import time

import pytest
import structlog

from mscale.demo.embedded import EmbeddedAgent

pytestmark = pytest.mark.slow  # two 60 s attacks on real agents

ATTACK_S = 60.0  # the issue's: the probes keep answering for 60 s
PIPELINE = 4  # /metrics requests each reader sends at once: more than its buffers hold
PROBE_TIMEOUT_S = 10.0  # Prometheus's default scrape timeout
TCP_ESTABLISHED = 1  # tcpi_state, the first byte of TCP_INFO


@pytest.fixture(autouse=True)
def quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    yield
    structlog.reset_defaults()


class SlowReaders:
    """`per_source` connections from each source address, each with the smallest receive
    buffer and segments the kernel allows, sending PIPELINE requests for /metrics and then reading one byte
    per `tick()`. A reader the agent closed is reopened at once, so the flood stays full."""

    def __init__(self, port: int, sources: list[str], per_source: int) -> None:
        self.port = port
        self.request = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode() * PIPELINE
        self.slots: list[tuple[str, socket.socket | None]] = [(s, None) for s in sources for _ in range(per_source)]
        self.opened = self.closed_by_agent = 0

    def _open(self, source: str) -> socket.socket | None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's minimum
        # small segments: the agent's kernel sizes its send buffer by them, so what the reader
        # does not read stays in the agent's process, as over a slow link
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        s.bind((source, 0))
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", self.port))
            s.sendall(self.request)
        except OSError:
            s.close()
            return None
        s.setblocking(False)
        self.opened += 1
        return s

    def tick(self) -> None:
        for i, (source, s) in enumerate(self.slots):
            if s is not None:
                if not gone(s):
                    continue
                self.closed_by_agent += 1
                s.close()
            self.slots[i] = (source, self._open(source))

    def close(self) -> None:
        for _, s in self.slots:
            if s is not None:
                s.close()


def gone(s: socket.socket) -> bool:
    """The agent closed this reader: an end of stream, an error, or (what a reset leaves while
    unread bytes are still queued here) a TCP state other than established."""
    try:
        if s.recv(1) == b"":
            return True
    except BlockingIOError:
        pass
    except OSError:
        return True
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_ESTABLISHED


def get(port: int, path: str, source: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_TIMEOUT_S, source_address=(source, 0))
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()  # the whole body (Content-Length), or IncompleteRead
    finally:
        conn.close()


def refused(page: str, why: str) -> float:
    m = re.search(rf'^mscale_refused_messages_total{{where="http",why="{why}"}} (\S+)$', page, re.M)
    return float(m.group(1)) if m else 0.0


def attack(sources: list[str], per_source: int, probe_from: str) -> None:
    with EmbeddedAgent() as agent:  # the default caps: 64 per peer, 512 in all
        port = int(agent.url.rsplit(":", 1)[1])
        readers = SlowReaders(port, sources, per_source)
        failures: list[str] = []
        probes = 0
        try:
            readers.tick()
            end = time.monotonic() + ATTACK_S
            while (now := time.monotonic()) < end:
                for path in ("/healthz", "/metrics"):
                    try:
                        status, body = get(port, path, probe_from)
                        ok = status == 200 and (b'"ok"' in body if path == "/healthz" else b"mscale_probe_up" in body)
                        if not ok:
                            failures.append(f"{path}: {status}")
                    except (OSError, http.client.HTTPException) as e:
                        failures.append(f"{path}: {e!r}")
                    probes += 1
                time.sleep(max(0.0, now + 1.0 - time.monotonic()))  # the readers' pace: a byte a second
                readers.tick()
        finally:
            readers.close()
        assert probes >= 2 * 10 and not failures, f"{len(failures)} of {probes} probes failed: {failures[:5]}"
        page = agent.get("/metrics")
        # the attack was on: every reader stalled and was closed by the agent, most more than once
        stalled = refused(page, "stalled_evicted") + refused(page, "write_timeout")
        assert stalled >= per_source * len(sources) and readers.closed_by_agent >= per_source * len(sources), (
            stalled,
            readers.opened,
            readers.closed_by_agent,
        )


def test_64_slow_readers_from_the_probes_address_leave_healthz_and_metrics_answering():
    attack(["127.0.0.1"], 64, probe_from="127.0.0.1")


def test_512_slow_readers_over_8_addresses_leave_healthz_and_metrics_answering():
    attack([f"127.0.0.{i}" for i in range(1, 9)], 64, probe_from="127.0.0.9")
