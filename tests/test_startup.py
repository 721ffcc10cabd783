"""`mscale agent` start-up and shutdown, through the real process (issue 16, item 8 and "What
to build" 7): every input it reads at start-up (config, healing policy, fault timeline, Xid
table) refuses a malformation with exit 2 naming the file, line and key, never a traceback; a
listen address or hook socket path it cannot use exits 2 naming it; SIGTERM stops it, exit 0,
within `agent.shutdown_timeout_s` even with a hook client that never finishes the close."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import stop_process

pytestmark = pytest.mark.slow  # a real agent process per malformed input: about 30 s

POLICY_OK = "version: 1\nrules:\n  - {name: r, target: mpu, reasons: [checksum_mismatch], actions: {any: [swap_mpu]}}\n"


def agent_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mscale", "agent", *args]


def run_agent(d: Path, *args: str, listen: str = "127.0.0.1:0", sock: str | None = None) -> subprocess.CompletedProcess:
    cmd = agent_cmd("--listen", listen, "--socket", sock if sock is not None else str(d / "a.sock"), *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def assert_refused(proc: subprocess.CompletedProcess, words: list[str]) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("mscale agent: "), proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


# (id, files written into the test's folder ({d} is that folder), agent arguments, words the
# message must contain). A config, when given, is agent.toml and passed with --config.
INPUTS = [
    # issue 16 item 8: NaN accepted (100% CPU, SIGTERM ignored); inf refused as well
    (
        "interval_s_nan",
        {"agent.toml": "[probes.gpu]\ninterval_s = nan\n"},
        [],
        ["agent.toml", "probes.gpu.interval_s", "line 2", "finite", "nan"],
    ),
    (
        "shutdown_timeout_s_nan",
        {"agent.toml": "[agent]\nshutdown_timeout_s = nan\n"},
        [],
        ["agent.shutdown_timeout_s", "line 2", "finite"],
    ),
    (
        "lr_cool_factor_nan",
        {"agent.toml": "\n[healing]\nlr_cool_factor = nan\n"},
        [],
        ["healing.lr_cool_factor", "line 3", "finite"],
    ),
    (
        "sbe_inf",
        {"agent.toml": "[health]\nsbe_per_hour_degraded = inf\n"},
        [],
        ["health.sbe_per_hour_degraded", "line 2", "finite", "inf"],
    ),
    (
        "host_interval_neg_inf",
        {"agent.toml": "[probes.gpu]\ninterval_s = 1\n[probes.host]\ninterval_s = -inf\n"},
        [],
        ["probes.host.interval_s", "line 4"],
    ),
    # issue 16 item 8: a non-UTF-8 config ended in a traceback
    ("config_not_utf8", {"agent.toml": b'[agent]\nnode = "n\xff"\n'}, [], ["agent.toml line 2", "not UTF-8", "0xff"]),
    # issue 25: a 5,000-digit integer gave a traceback; an unknown key's escape reached the terminal
    (
        "config_integer_5000_digits",
        {"agent.toml": "[socket]\nmax_jobs = " + "1" * 5000 + "\n"},
        [],
        ["agent.toml: line 2", "5000 digits"],
    ),
    (
        "config_unknown_key_escape",
        {"agent.toml": '[socket]\n"a\\u001b[2Jb" = 1\n'},
        [],
        ["socket.a\\x1b[2Jb", "unknown key"],
    ),
    (
        "config_nested_deep",
        {"agent.toml": "a = " + "[" * 3000 + "]" * 3000 + "\n"},
        [],
        ["agent.toml", "nested too deeply"],
    ),
    # issue 16 item 8: listen = "256.1.1.1:80" ended in a traceback
    (
        "listen_256_in_config",
        {"agent.toml": '[agent]\nlisten = "256.1.1.1:80"\n'},
        ["--listen", ""],
        ["agent.toml: agent.listen (line 2)", "'256.1.1.1'", "not a valid IPv4 address"],
    ),
    (
        "listen_256_flag",
        {},
        ["--listen", "256.1.1.1:80"],
        ["agent.listen (--listen)", "256.1.1.1", "not a valid IPv4 address"],
    ),
    ("listen_superscript_port", {}, ["--listen", "127.0.0.1:²"], ["agent.listen", "--listen", "port 0..65535"]),
    ("listen_port_too_big", {}, ["--listen", "127.0.0.1:65536"], ["agent.listen", "port 0..65535"]),
    ("listen_bad_name", {}, ["--listen", "no_such host!:80"], ["agent.listen", "host name"]),
    (
        "socket_path_nul",
        {"agent.toml": '[agent]\nsocket_path = "/tmp/a\\u0000b"\n'},
        ["--socket", ""],
        ["agent.toml: agent.socket_path (line 2)", "NUL"],
    ),
    # issue 16 item 8: a timeline with a 300-digit `at` or a list as a key ended in tracebacks
    (
        "timeline_at_300_digits",
        {"t.yaml": "gpus: 2\nevents:\n  - at: " + "9" * 300 + "\n    gpu: 0\n    fault: gpu_lost\n"},
        ["--simulate", "{d}/t.yaml"],
        ["t.yaml line 3", "events[0].at", "duration"],
    ),
    (
        "timeline_list_key",
        {"t.yaml": "gpus: 2\nevents:\n  - ? [a, b]\n    : 1\n    gpu: 0\n    fault: gpu_lost\n"},
        ["--simulate", "{d}/t.yaml"],
        ["t.yaml line 3", "events[0]", "plain names"],
    ),
    (
        "timeline_list_fault",
        {"t.yaml": "events:\n  - {at: 1s, gpu: 0, fault: [xid]}\n"},
        ["--simulate", "{d}/t.yaml"],
        ["t.yaml line 2", "events[0].fault"],
    ),
    (
        "timeline_bad_date",
        {"t.yaml": "events:\n  - {at: 2001-13-45, gpu: 0, fault: gpu_lost}\n"},
        ["--simulate", "{d}/t.yaml"],
        ["t.yaml line 2", "events[0].at"],
    ),
    # issue 16 item 8: non-UTF-8 policy/timeline/Xid files and Xid code ² named no file or line
    (
        "timeline_not_utf8",
        {"t.yaml": b"gpus: 2\nevents:\n  # \xfe\n"},
        ["--simulate", "{d}/t.yaml"],
        ["t.yaml line 3", "not UTF-8", "0xfe"],
    ),
    (
        "policy_not_utf8",
        {"agent.toml": '[healing]\npolicy = "{d}/p.yaml"\n', "p.yaml": b"version: 1\n\xc3(\n"},
        [],
        ["p.yaml line 2", "not UTF-8"],
    ),
    (
        "xid_not_utf8",
        {
            "agent.toml": '[health]\nxid_table = "{d}/x.csv"\n',
            "x.csv": b"code,class,description\n79,fatal,ok\n48,fatal,\x80\n",
        },
        [],
        ["x.csv line 3", "not UTF-8"],
    ),
    (
        "xid_code_superscript",
        {"agent.toml": '[health]\nxid_table = "{d}/x.csv"\n', "x.csv": "code,class,description\n²,fatal,odd\n"},
        [],
        ["x.csv line 2", "code", "'²'"],
    ),
    (
        "policy_nul_char",
        {"agent.toml": '[healing]\npolicy = "{d}/p.yaml"\n', "p.yaml": POLICY_OK + "# \x00\n"},
        [],
        ["p.yaml", "line 4", "not valid YAML"],
    ),
    # a FIFO in place of a data file: refused at once, not a hang
    ("timeline_fifo", {"t.yaml": None}, ["--simulate", "{d}/t.yaml"], ["t.yaml", "not a regular file"]),
]


@pytest.mark.parametrize("files,args,words", [c[1:] for c in INPUTS], ids=[c[0] for c in INPUTS])
def test_malformed_startup_input_exits_2_naming_file_line_and_key(tmp_path, files, args, words) -> None:
    for name, body in files.items():
        path = tmp_path / name
        if body is None:
            os.mkfifo(path)
        elif isinstance(body, bytes):
            path.write_bytes(body)
        else:
            path.write_text(body.replace("{d}", str(tmp_path)))
    argv = [a.replace("{d}", str(tmp_path)) for a in args]
    if "agent.toml" in files:
        argv += ["--config", str(tmp_path / "agent.toml")]
    for flag, value in (("--listen", "127.0.0.1:0"), ("--socket", str(tmp_path / "a.sock"))):
        if flag not in argv:
            argv += [flag, value]
    # A flag given "" in a case is left out: its value comes from the case's config file.
    pairs = [argv[i : i + 2] for i in range(0, len(argv), 2)]
    argv = [x for pair in pairs if pair[1] != "" for x in pair]
    proc = subprocess.run(agent_cmd(*argv), capture_output=True, text=True, timeout=60)
    assert_refused(proc, words)


def test_listen_port_in_use_exits_2_naming_the_address(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_agent(tmp_path, listen=f"127.0.0.1:{port}")
    assert_refused(proc, ["agent.listen", f"127.0.0.1:{port}", "in use"])


def _file_in_the_way(d: Path) -> str:
    (d / "plain").write_text("")
    return str(d / "plain" / "a.sock")  # its directory cannot be created: a file is there


def _not_a_socket(d: Path) -> str:
    (d / "a.sock").write_text("not a socket")
    return str(d / "a.sock")


def _writable_by_others(d: Path) -> str:
    (d / "shared").mkdir()
    os.chmod(d / "shared", 0o777)  # issue 25 item 1: another user could swap the socket there
    return str(d / "shared" / "a.sock")


def _too_long(d: Path) -> str:
    return str(d / ("s" * (120 - len(str(d)))))


@pytest.mark.parametrize(
    "make,words",
    [
        (_file_in_the_way, ["agent.socket_path", "cannot serve the hook socket", "plain"]),
        (_not_a_socket, ["agent.socket_path", "exists and is not a socket"]),
        (_too_long, ["agent.socket_path (--socket)", "too long for a Unix socket", "at most 107"]),
        (_writable_by_others, ["agent.socket_path", "cannot serve the hook socket", "writable by others"]),
    ],
    ids=["directory_cannot_be_created", "non_socket_file", "too_long_for_af_unix", "directory_writable_by_others"],
)
def test_unusable_socket_path_exits_2_naming_the_path(tmp_path, make, words) -> None:
    # issue 16 item 8: the agent kept running with /healthz ok and no hook socket
    path = make(tmp_path)
    proc = run_agent(tmp_path, sock=path)
    assert_refused(proc, [*words, path])


def _wait_listening(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The metrics URL from the agent's `agent_listening` log line (stdout, JSON lines)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        for line in buf.split(b"\n"):
            if b'"agent_listening"' in line:
                return json.loads(line)["metrics_url"]
    raise AssertionError(f"the agent did not start listening: rc={proc.poll()} {buf[-2000:]!r}")


def _silent_hook_client(path: Path) -> socket.socket:
    """A websocket on the hook socket that never reads again, so never answers the agent's
    close frame (aiohttp would wait 10 s for the answer)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(path))
    s.sendall(
        b"GET /v1/link HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


@pytest.mark.parametrize("shutdown_timeout_s", [1.0, 2.5])
def test_sigterm_stops_the_agent_within_shutdown_timeout(tmp_path, shutdown_timeout_s) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f"[agent]\nshutdown_timeout_s = {shutdown_timeout_s}\n")
    sock = tmp_path / "a.sock"
    proc = subprocess.Popen(
        agent_cmd("--config", str(cfg), "--listen", "127.0.0.1:0", "--socket", str(sock)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    clients: list[socket.socket] = []
    try:
        url = _wait_listening(proc)
        clients.append(_silent_hook_client(sock))
        host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
        http = socket.create_connection((host, int(port)), timeout=30)
        http.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head never finished
        clients.append(http)
        margin_s = 2.0  # interpreter exit on a loaded 2-core machine
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=shutdown_timeout_s + margin_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM: the agent still ran {shutdown_timeout_s + margin_s:g} s later")
        took = time.monotonic() - started
    finally:
        for c in clients:
            c.close()
        stop_process(proc)
    assert rc == 0, rc
    assert took <= shutdown_timeout_s + margin_s


def test_hard_stop_ends_a_wedged_process_at_the_deadline() -> None:
    """The timer a stop signal arms ends the process at the deadline even when the main
    thread never returns (here: blocked in a sleep, as a wedged event loop would be)."""
    code = (
        "import time\n"
        "from mscale.daemon.main import HardStop\n"
        "HardStop(0.5).arm()\n"
        "print('armed', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "armed\n"
        started = time.monotonic()
        rc = proc.wait(timeout=0.5 + 5.0)
        took = time.monotonic() - started
        out = proc.stdout.read()
    finally:
        stop_process(proc)
    assert rc == 0 and took < 5.0, (rc, took)
    assert "agent_shutdown_forced" in out, out


@pytest.mark.parametrize("usec", ["²", "12x", "9" * 5000, "-5"])
def test_malformed_watchdog_usec_means_no_watchdog(usec) -> None:
    from mscale.daemon.notify import Notifier

    assert Notifier(address="", environ={"WATCHDOG_USEC": usec}).watchdog_interval_s is None
    assert Notifier(address="", environ={"WATCHDOG_USEC": "2000000"}).watchdog_interval_s == 1.0
