#!/usr/bin/env python3
"""Agent overhead: 8 simulated GPUs probed every second for --duration seconds (default 30).

Prints the agent's CPU (percent of one core) and peak RSS against their targets (< 1 % of a
core, < 80 MB), and /metrics scrape latency p50/p99 against Debian's prometheus-node-exporter
started on 127.0.0.1 and scraped in the same run, alternately, over kept-alive connections
(as Prometheus does). Each figure is printed as a ratio against its target or baseline:
a ratio <= 1 meets it.

The agent runs as `mscale agent --simulate` with the GPU probe at 1 s and the host probe at
its default; the eBPF probe is off (it has its own benchmark). Phase 1 measures CPU while the
agent probes and is scraped every --scrape-interval seconds (Prometheus-like); phase 2
measures scrape latency over --latency-scrapes back-to-back scrapes of each target. Peak RSS
is the agent's high-water mark over the whole run.

Both phases are split into --repeats blocks (3 by default); every verdict is on the median
of the blocks' figures, their range printed (benchmarks/_verdict.py). The latency control:
node_exporter's own scrapes split into two interleaved halves, whose p99 ratio is truly 1.00;
when it strays further than the agent's p99 ratio from its target, the verdict is
"inconclusive".

    .venv/bin/python benchmarks/agent_overhead.py [--duration 30] [--repeats 3] [--json PATH] [--strict]
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from _verdict import Report, add_json_arg  # noqa: E402

TIMELINE = """\
gpus: 8
model: h100
events: []
"""
TARGET_CPU_PCT = 1.0
TARGET_RSS_MB = 80.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, path: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process {proc.args[0]} exited with {proc.returncode} before serving")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().read() and True:
                conn.close()
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"nothing served on 127.0.0.1:{port}{path} within {timeout_s}s")


def scrape(conn: http.client.HTTPConnection) -> tuple[float, int]:
    t0 = time.perf_counter()
    conn.request("GET", "/metrics", headers={"Accept": "text/plain;version=0.0.4"})
    body = conn.getresponse().read()
    return time.perf_counter() - t0, len(body)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return psutil.Process(pid).memory_info().rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds to measure CPU (default 30)")
    ap.add_argument("--repeats", type=int, default=3, help="blocks each phase is split into")
    add_json_arg(ap)
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds after start-up before measuring")
    ap.add_argument(
        "--scrape-interval",
        type=float,
        default=15.0,
        help="seconds between scrapes while CPU is measured (Prometheus-like; default 15)",
    )
    ap.add_argument("--latency-scrapes", type=int, default=300, help="scrapes of each target for p50/p99")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()

    node_exporter = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if node_exporter is None:
        print("agent_overhead: prometheus-node-exporter not found (make test installs it)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="mscale-bench-"))
    (tmp / "timeline.yaml").write_text(TIMELINE)
    (tmp / "agent.toml").write_text("[probes.gpu]\ninterval_s = 1.0\n[probes.ebpf]\nenabled = false\n")
    agent_port, node_port = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    try:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mscale",
                "agent",
                "--config",
                str(tmp / "agent.toml"),
                "--simulate",
                str(tmp / "timeline.yaml"),
                "--listen",
                f"127.0.0.1:{agent_port}",
                "--socket",
                str(tmp / "agent.sock"),
                "--log-level",
                "warning",
            ],
            stdout=open(tmp / "agent.log", "w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        procs.append(agent)
        node = subprocess.Popen(
            [node_exporter, f"--web.listen-address=127.0.0.1:{node_port}", "--log.level=warn"],
            stdout=open(tmp / "node.log", "w"),
            stderr=subprocess.STDOUT,
        )
        procs.append(node)
        wait_http(agent_port, "/metrics", agent)
        wait_http(node_port, "/metrics", node)
        time.sleep(args.warmup)  # start-up (imports, first samples) is not steady state

        pa, pn = psutil.Process(agent.pid), psutil.Process(node.pid)
        conns = {
            "agent": http.client.HTTPConnection("127.0.0.1", agent_port, timeout=10),
            "node_exporter": http.client.HTTPConnection("127.0.0.1", node_port, timeout=10),
        }
        size: dict[str, int] = {}

        # Phase 1, overhead: the agent probing, scraped as a Prometheus server would.
        agent_cpu, node_cpu, peaks = [], [], []
        block = args.duration / args.repeats
        wall = 0.0
        next_scrape = time.monotonic()
        for _ in range(args.repeats):
            ca0, cn0, t0 = pa.cpu_times(), pn.cpu_times(), time.monotonic()
            while time.monotonic() - t0 < block:
                if time.monotonic() >= next_scrape:
                    for name, conn in conns.items():
                        size[name] = scrape(conn)[1]
                    next_scrape += args.scrape_interval
                time.sleep(max(0.0, min(next_scrape, t0 + block) - time.monotonic()))
            took = time.monotonic() - t0
            wall += took
            ca1, cn1 = pa.cpu_times(), pn.cpu_times()
            agent_cpu.append((ca1.user + ca1.system - ca0.user - ca0.system) / took * 100)
            peaks.append(peak_rss_bytes(agent.pid) / 1e6)  # the high-water mark so far
            node_cpu.append((cn1.user + cn1.system - cn0.user - cn0.system) / took * 100)

        # Phase 2, latency: alternate scrapes so both targets see the same machine load.
        lat: dict[str, list[float]] = {k: [] for k in conns}
        for _ in range(args.latency_scrapes):
            for name, conn in conns.items():
                lat[name].append(scrape(conn)[0])
            time.sleep(0.02)
        peaks.append(peak_rss_bytes(agent.pid) / 1e6)
        node_peak = peak_rss_bytes(node.pid) / 1e6
        conns["agent"].request("GET", "/metrics")
        page = conns["agent"].getresponse().read().decode()
        gpu_series = sum(1 for line in page.splitlines() if line.startswith("mscale_gpu_"))
        for c in conns.values():
            c.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    rep = Report("agent_overhead", args.json)
    k = max(1, len(lat["agent"]) // args.repeats)
    blocks = [slice(i * k, (i + 1) * k) for i in range(args.repeats)]

    def per_block(name: str, q: float) -> list[float]:
        return [pct(lat[name][b], q) * 1e3 for b in blocks]

    a50, a99, n50, n99 = (
        per_block("agent", 50),
        per_block("agent", 99),
        per_block("node_exporter", 50),
        per_block("node_exporter", 99),
    )
    node = lat["node_exporter"]
    control = [pct(node[b][0::2], 99) / pct(node[b][1::2], 99) for b in blocks]  # truly 1.00
    print(
        f"agent_overhead: 8 simulated GPUs, GPU probe every 1 s; CPU over {wall:.0f} s with a scrape every "
        f"{args.scrape_interval:g} s; latency over {len(lat['agent'])} alternating scrapes per target; "
        f"{os.cpu_count()} CPUs, {args.repeats} blocks"
    )
    print(
        f"  /metrics size: agent {size['agent']} bytes ({gpu_series} mscale_gpu_* lines), "
        f"node_exporter {size['node_exporter']} bytes"
    )
    rep.figure("node_exporter CPU, % of a core (baseline)", node_cpu, unit="%", digits=2)
    rep.figure("node_exporter peak RSS, MB (baseline)", [node_peak], unit="MB", digits=1)
    rep.figure("scrape p50 agent, ms", a50, unit="ms", digits=2)
    rep.figure("scrape p50 node_exporter, ms", n50, unit="ms", digits=2)
    rep.figure("scrape p99 agent, ms", a99, unit="ms", digits=2)
    rep.figure("scrape p99 node_exporter, ms", n99, unit="ms", digits=2)
    verdicts = [
        rep.verdict("agent CPU, % of one core", agent_cpu, TARGET_CPU_PCT, higher=False, unit="%"),
        # the high-water mark after each CPU block and after the latency phase: the last is the run's peak
        rep.verdict("agent peak RSS, MB", peaks, TARGET_RSS_MB, higher=False, unit=" MB", digits=1),
        rep.verdict(
            "scrape p99: agent / node_exporter",
            [x / y for x, y in zip(a99, n99, strict=True)],
            1.0,
            higher=False,
            control=control,
        ),
    ]
    rep.write()
    return 1 if args.strict and "MISSED" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
