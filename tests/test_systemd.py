"""systemd: the unit passes `systemd-analyze verify`, keeps the settings the agent relies on,
and the agent speaks sd_notify (READY, STATUS, WATCHDOG, STOPPING) over a real datagram socket."""

from __future__ import annotations

import configparser
import os
import signal
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from support import REPO, free_port, require_tool

UNIT = REPO / "deploy" / "mscale-agent.service"


def venv_mscale() -> Path:
    exe = Path(sys.executable).parent / "mscale"
    assert exe.exists(), f"console script missing: {exe} (make venv installs it)"
    return exe


def unit_for_here(tmp_path: Path, text: str | None = None) -> Path:
    """The shipped unit with ExecStart pointing at this checkout's mscale: verify checks that
    the binary exists, and /usr/local/bin/mscale is not installed on a test machine."""
    text = (text or UNIT.read_text()).replace("/usr/local/bin/mscale", str(venv_mscale()))
    path = tmp_path / "mscale-agent.service"
    path.write_text(text)
    return path


def verify(path: Path) -> subprocess.CompletedProcess:
    tool = require_tool("systemd-analyze")
    return subprocess.run(
        [tool, "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )


def test_systemd_analyze_verify_passes(tmp_path) -> None:
    proc = verify(unit_for_here(tmp_path))
    # verify exits 0 even for settings it ignores; those are warnings naming the unit file.
    assert proc.returncode == 0, proc.stderr
    assert "mscale-agent.service" not in proc.stderr and "ignoring" not in proc.stderr, proc.stderr


def test_verify_does_catch_mistakes_here(tmp_path) -> None:
    """The check above can fail: a mistyped value and a missing binary are reported."""
    text = UNIT.read_text().replace("WatchdogSec=30s", "WatchdogSec=thirty")
    proc = verify(unit_for_here(tmp_path, text))
    assert "WatchdogSec" in proc.stderr or "Failed to parse sec value" in proc.stderr, proc.stderr
    bad = tmp_path / "missing" / "mscale-agent.service"
    bad.parent.mkdir()
    bad.write_text(UNIT.read_text().replace("/usr/local/bin/mscale", str(tmp_path / "nope" / "mscale")))
    assert verify(bad).returncode != 0


def test_unit_settings() -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment]
    cp.read_string(UNIT.read_text())
    s = cp["Service"]
    assert s["Type"] == "notify" and s["Restart"] == "on-failure" and s["WatchdogSec"] == "30s"
    assert s["ExecStart"].split()[1:] == ["agent", "--config", "/etc/mscale/agent.toml"]
    caps = set(s["CapabilityBoundingSet"].split())
    assert {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_RESOURCE", "CAP_SYS_ADMIN"} <= caps
    assert set(s["AmbientCapabilities"].split()) == caps
    assert s["DevicePolicy"] == "closed" and "char-nvidia*" in UNIT.read_text()
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict"
    assert "bpf" in s["SystemCallFilter"].split() and "perf_event_open" in s["SystemCallFilter"].split()
    assert s["RuntimeDirectory"] == "mscale"  # /run/mscale/agent.sock, the default socket path
    # room for the HTTP connection cap (http.max_connections) and its reserve, well over 1,024
    assert int(s["LimitNOFILE"]) >= 4096
    assert cp["Install"]["WantedBy"] == "multi-user.target"


def test_agent_speaks_sd_notify_over_a_real_socket(tmp_path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(1.0)
    timeline = str(resources.files("mscale.sim") / "timelines" / "default.yaml")
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[probes.ebpf]\nenabled = false\n")
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}  # a ping every 0.2 s
    log = open(tmp_path / "agent.log", "w")
    proc = subprocess.Popen(
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
            f"127.0.0.1:{free_port()}",
            "--socket",
            str(tmp_path / "a.sock"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    messages: list[str] = []

    def receive_until(pred, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, (
                f"got only {messages}; log: {(tmp_path / 'agent.log').read_text()[-2000:]}"
            )
            try:
                data, _ = sock.recvfrom(4096)
            except TimeoutError:
                assert proc.poll() is None, (tmp_path / "agent.log").read_text()[-2000:]
                continue
            messages.append(data.decode())

    try:
        receive_until(lambda: any("READY=1" in m for m in messages))
        ready = next(m for m in messages if "READY=1" in m).split("\n")
        assert f"MAINPID={proc.pid}" in ready
        assert any(line.startswith("STATUS=serving http://127.0.0.1:") for line in ready)
        receive_until(lambda: sum(m == "WATCHDOG=1" for m in messages) >= 3)
        proc.send_signal(signal.SIGTERM)
        receive_until(lambda: "STOPPING=1" in messages)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        sock.close()
    # READY comes before any watchdog ping, STOPPING last.
    first_ready = next(i for i, m in enumerate(messages) if "READY=1" in m)
    assert all(m != "WATCHDOG=1" for m in messages[:first_ready])
    assert messages[-1] == "STOPPING=1"
