"""Webhook cost against the agent's alert history: does a body cost more as history grows?

A fresh real agent (the embedded one: create_app on 127.0.0.1, port 0, simulated GPUs, the
shipped policy, the default action budget of 30 a minute) is sent --bodies Alertmanager v4
bodies of --alerts alerts each over HTTP, one after the other, every alert new (its own
fingerprint): a mix of GPU double-bit ECC alerts over the 8 simulated GPUs (matched by the
gpu_fatal rule: decided, deduplicated by the engine, rate-limited by the budget) and
temperature warnings no rule matches. The figure is the wall time of the last body against
the first, in the same agent (target: flat, ratio near 1; before issue 16 the dedup table
was scanned per alert and kept 24 h, and five bodies of 4,000 grew 6.7x).

Each agent is first sent a warm-up body of 50 alerts. The control runs interleaved with it:
after each body, a body of the same shape is posted to another fresh (warmed-up) agent, so
the control's last/first ratio is what the machine's drift and noise alone make of the same
positions in the run. Repeated --repeats times; the verdict is on the median growth
(last/first - 1) against --tolerance (benchmarks/_verdict.py): "met" (flat) when it stays
below by more than the control's noise, "MISSED" (grows) when above by more, otherwise
"inconclusive" (the control is noisier than the effect looked for).

A second figure: the longest /healthz answer while a body of --big alerts is processed,
against the whole body's time (1.0: the event loop was blocked for the whole body, as
10,000 alerts did for up to 43.6 s before issue 16; the systemd watchdog fires at 30 s).

    .venv/bin/python benchmarks/webhook_cost.py [--bodies 5] [--alerts 4000] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verdict import Report, add_json_arg  # noqa: E402

from mscale.demo.embedded import EmbeddedAgent  # noqa: E402


def body(tag: str, n: int) -> bytes:
    alerts = []
    for i in range(n):
        if i % 2:
            labels = {"alertname": "MscaleGpuEccDoubleBit", "gpu": str(i % 8), "severity": "critical"}
        else:
            labels = {"alertname": "MscaleGpuTemperatureHigh", "gpu": str(i % 8), "severity": "warning"}
        alerts.append(
            {
                "status": "firing",
                "labels": labels,
                "annotations": {},
                "startsAt": "2026-11-30T06:00:00Z",
                "fingerprint": f"{tag}-{i}",
            }
        )
    return json.dumps({"version": "4", "status": "firing", "receiver": "mscale-p0", "alerts": alerts}).encode()


def post(agent: EmbeddedAgent, data: bytes) -> float:
    u = urlsplit(agent.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    headers = {"Authorization": f"Bearer {agent.token}", "Content-Type": "application/json"}
    t0 = time.perf_counter()
    conn.request("POST", "/api/v1/alerts", body=data, headers=headers)
    resp = conn.getresponse()
    reply = resp.read()
    elapsed = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"webhook answered {resp.status}: {reply[:300]!r}")
    return elapsed


def costs(bodies: int, alerts: int, rep: int) -> tuple[list[float], list[float]]:
    """(the body costs of one agent with growing history, of a fresh agent per body)."""
    limits = {"max_body_bytes": 1 << 30}
    history, control = [], []
    with EmbeddedAgent(webhook=limits) as agent:
        post(agent, body(f"r{rep}w", 50))  # warm-up: first-request costs are not history
        for b in range(bodies):
            history.append(post(agent, body(f"r{rep}b{b}", alerts)))
            with EmbeddedAgent(webhook=limits) as fresh:
                post(fresh, body(f"r{rep}c{b}w", 50))
                control.append(post(fresh, body(f"r{rep}c{b}", alerts)))
    return history, control


def stall(alerts: int) -> tuple[float, float, int]:
    """(longest /healthz answer while the body is processed, the body's time, answers)."""
    with EmbeddedAgent(webhook={"max_body_bytes": 1 << 30}) as agent:
        data = body("stall", alerts)
        u = urlsplit(agent.url)
        done = threading.Event()
        waits: list[float] = []

        def probe() -> None:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
            while not done.is_set():
                t0 = time.perf_counter()
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                waits.append(time.perf_counter() - t0)
            conn.close()

        t = threading.Thread(target=probe, daemon=True)
        t.start()
        try:
            took = post(agent, data)
        finally:
            done.set()
            t.join()
        return max(waits), took, len(waits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bodies", type=int, default=5, help="bodies posted to one agent (default 5)")
    ap.add_argument("--alerts", type=int, default=4000, help="new alerts per body (default 4000)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh agents (default 3)")
    ap.add_argument("--tolerance", type=float, default=0.25, help="flat: |ratio - 1| within this (default 0.25)")
    ap.add_argument("--big", type=int, default=10_000, help="alerts in the stall body (default 10000)")
    add_json_arg(ap)
    args = ap.parse_args()
    report = Report("webhook_cost", args.json)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))

    ratios, control, firsts = [], [], []
    for rep in range(args.repeats):
        h, c = costs(args.bodies, args.alerts, rep)
        ratios.append(h[-1] / h[0])
        control.append(c[-1] / c[0])
        firsts.append(h[0])
        print(f"repeat {rep + 1}: " + ", ".join(f"{x:.3f}" for x in h) + f" s  (last/first {h[-1] / h[0]:.2f})")
        print("  control: " + ", ".join(f"{x:.3f}" for x in c) + f" s  (last/first {c[-1] / c[0]:.2f})")
    print(f"\nwebhook cost, body {args.bodies} against body 1 ({args.alerts} new alerts each):")
    report.figure("first body, s", firsts, unit="s")
    report.figure("control: last/first body, fresh agent per body", control, unit="x")
    report.verdict(
        "growth: last body / first body - 1", [r - 1 for r in ratios], args.tolerance, at_most=True, control=control
    )

    longest, took, n = stall(args.big)
    print(
        f"longest /healthz answer during a {args.big}-alert body: {longest * 1e3:.1f} ms of the body's "
        f"{took:.2f} s ({longest / took:.3f} of it; 1.0 = loop blocked throughout), {n} answers"
    )
    report.figure(f"longest /healthz answer / {args.big}-alert body time", [longest / took], unit="x", digits=3)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
