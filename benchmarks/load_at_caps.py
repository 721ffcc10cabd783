#!/usr/bin/env python3
"""The agent under jobs that report at full rate inside every cap: do its probes and scrapes
still answer in time? (issue 38 item 10)

A real `mscale agent` process on simulated GPUs; a load process holding the socket's total cap
of MPU states (by default 32 jobs x 4 ranks x 16 MPUs = 2,048, the issue's 2 users x 16 jobs
spelled as one uid with `socket.max_mpu_states_per_uid` at the total: the agent's work is the
same), each rank sending `--rate` report messages a second of `--steps` steps (default 2 and 5,
1,280 step reports and 20,480 MPU reports a second). Meanwhile this process asks `/healthz`
every 0.25 s (timeout 5 s) and scrapes `/metrics` every 5 s (timeout 30 s), for `--seconds`
after every rank has registered. Printed: the worst `/healthz` answer against the 1 s target,
the probes unanswered, the worst scrape against Prometheus's default 10 s timeout (each as a
ratio: <= 1 meets it), the medians, the messages the load managed to send, the load average.

    PYTHONPATH=. .venv/bin/python benchmarks/load_at_caps.py [--seconds 60] [--json PATH] [--strict]

On a shared machine the figures move with its load (printed): run it with the machine
otherwise idle for the figure docs/security.md quotes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _verdict import Report, add_json_arg  # noqa: E402

PROBE_TARGET_S, SCRAPE_TARGET_S = 1.0, 10.0
PROBE_EVERY_S, SCRAPE_EVERY_S = 0.25, 5.0


# --- the load: run as `load_at_caps.py --load SOCKET JOBS RANKS MPUS RATE STEPS SECONDS` ----------


async def _rank(path: str, job: str, rank: int, mpus: int, rate: float, steps: int, until: float, out: dict) -> None:
    import aiohttp

    ids = [f"{m:03d}" for m in range(mpus)]
    reg = {
        "type": "register",
        "job_id": job,
        "rank": rank,
        "pid": 1,
        "step": 0,
        "mpus": [{"mpu_id": m, "name": f"mpu{m}", "gpu": i % 8, "params": 1000} for i, m in enumerate(ids)],
    }
    figures = {"forward_s": 0.01, "backward_s": 0.02, "grad_norm": 1.0, "gvc": 0.5, "checksum_ok": True}
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
        async with session.ws_connect("http://localhost/v1/link") as ws:
            await ws.send_str(json.dumps(reg))
            answer = await ws.receive(timeout=60)
            if json.loads(answer.data).get("type") != "registered":
                raise RuntimeError(f"{job} rank {rank}: {answer.data}")
            out["registered"] += 1
            step = 0
            while (now := time.monotonic()) < until:
                reports = [
                    {"step": step + i, "loss": 2.0, "grad_norm": 1.0, "mpus": {m: figures for m in ids}}
                    for i in range(steps)
                ]
                step += steps
                t = time.monotonic()
                await ws.send_str(json.dumps({"type": "report", "job_id": job, "dropped": 0, "reports": reports}))
                out["sent"] += 1
                out["send_s"] = max(out["send_s"], time.monotonic() - t)
                await asyncio.sleep(max(0.0, 1.0 / rate - (time.monotonic() - now)))


async def _load(path: str, jobs: int, ranks: int, mpus: int, rate: float, steps: int, seconds: float) -> None:
    out = {"registered": 0, "sent": 0, "send_s": 0.0}
    until = time.monotonic() + seconds
    tasks = [
        asyncio.create_task(_rank(path, f"team-{j % 2}/run-{j}", r, mpus, rate, steps, until, out))
        for j in range(jobs)
        for r in range(ranks)
    ]
    while out["registered"] < len(tasks) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.1)
    print(json.dumps({"phase": "registered", "ranks": out["registered"]}), flush=True)
    await asyncio.gather(*tasks)
    print(json.dumps({"phase": "done", **out}), flush=True)


# --- the agent, the probes ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float) -> float | None:
    t = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
    except OSError:
        return None
    return time.monotonic() - t


def _poll(url: str, every: float, timeout: float, stop: threading.Event, out: list[float | None]) -> None:
    while not stop.is_set():
        t = time.monotonic()
        out.append(_get(url, timeout))
        stop.wait(max(0.0, every - (time.monotonic() - t)))


def _agent(d: Path, states: int) -> tuple[subprocess.Popen, str, str]:
    port = _free_port()
    (d / "t.yaml").write_text("gpus: 8\nevents: []\n")
    (d / "agent.toml").write_text(
        f"[socket]\nmax_mpu_states = {states}\nmax_mpu_states_per_uid = {states}\n"
        "[probes.ebpf]\nenabled = false\n[remediation]\nenabled = false\n"
    )
    sock = str(d / "agent.sock")
    argv = ["--config", str(d / "agent.toml"), "--simulate", str(d / "t.yaml"), "--log-level", "error"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mscale", "agent", *argv, "--listen", f"127.0.0.1:{port}", "--socket", sock],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while _get(url + "/healthz", 1.0) is None:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("the agent did not start")
        time.sleep(0.2)
    return proc, url, sock


def _reports_taken(url: str) -> tuple[float, float]:
    """The step reports the agent has taken from every job (mscale_job_reports_total, summed),
    and the report messages it shed unread while behind (mscale_link_reports_shed_total; 0 on an
    agent without it); NaN when no page came within 60 s."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            page = r.read().decode()
    except OSError:
        return float("nan"), float("nan")

    def total(prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(prefix))

    return total("mscale_job_reports_total{"), total("mscale_link_reports_shed_total ")


def _worst(xs: list[float | None]) -> float:
    """The slowest answer; infinite when one went unanswered (or none came)."""
    return float("inf") if None in xs or not xs else max(x for x in xs if x is not None)


def _median(xs: list[float | None]) -> float:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mpus", type=int, default=16)
    p.add_argument("--rate", type=float, default=2.0, help="report messages a second per rank")
    p.add_argument("--steps", type=int, default=5, help="steps per message")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    add_json_arg(p)
    p.add_argument("--load", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.load:
        path, *n = args.load
        asyncio.run(_load(path, int(n[0]), int(n[1]), int(n[2]), float(n[3]), int(n[4]), float(n[5])))
        return 0
    states = args.jobs * args.ranks * args.mpus
    with tempfile.TemporaryDirectory(prefix="mscale-load-") as tmp:
        agent, url, sock = _agent(Path(tmp), max(states, 1024))
        load = None
        try:
            run_s = args.seconds + 120  # the load outlives the measurement: registration comes first
            load = subprocess.Popen(
                [sys.executable, __file__, "--load", sock, str(args.jobs), str(args.ranks), str(args.mpus)]
                + [str(args.rate), str(args.steps), str(run_s)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert load.stdout is not None
            first = json.loads(load.stdout.readline() or "{}")
            if first.get("ranks") != args.jobs * args.ranks:
                raise SystemExit(f"the load did not register every rank: {first}")
            probes: list[float | None] = []
            scrapes: list[float | None] = []
            stop = threading.Event()
            pollers = [
                threading.Thread(target=_poll, args=(url + "/healthz", PROBE_EVERY_S, 5.0, stop, probes)),
                threading.Thread(target=_poll, args=(url + "/metrics", SCRAPE_EVERY_S, 30.0, stop, scrapes)),
            ]
            taken, shed = _reports_taken(url)
            start = time.monotonic()
            for t in pollers:
                t.start()
            stop.wait(args.seconds)
            stop.set()
            for t in pollers:
                t.join(40)
            taken_now, shed_now = _reports_taken(url)
            rate = (taken_now - taken) / (time.monotonic() - start)
            shed = shed_now - shed
        finally:
            for proc in (load, agent):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(5)
    offered = args.jobs * args.ranks * args.rate * args.steps
    print(
        f"step reports taken {rate:.0f}/s of {offered:.0f}/s offered; report messages shed by the agent while behind: "
        f"{shed:.0f} (the rest wait in the socket and the jobs' bounded queues)"
    )
    return _report(args, states, probes, scrapes)


def _report(args: argparse.Namespace, states: int, probes: list, scrapes: list) -> int:
    rep = Report("load_at_caps", args.json)
    print(
        f"{states} MPU states ({args.jobs} jobs x {args.ranks} ranks x {args.mpus} MPUs), "
        f"{args.rate:g} messages/s per rank of {args.steps} steps, {args.seconds:g} s; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    lost_probes, lost_scrapes = probes.count(None), scrapes.count(None)
    print(
        f"  /healthz: {len(probes)} probes, {lost_probes} unanswered; /metrics: {len(scrapes)}, {lost_scrapes} failed"
    )
    answered = [x for x in probes if x is not None]
    scraped = [x for x in scrapes if x is not None]
    for label, xs in (("/healthz answers", answered), ("/metrics scrapes", scraped)):
        if xs:
            rep.figure(label, xs, show=False)
    worst_probe, worst_scrape = _worst(probes), _worst(scrapes)
    print(f"  /healthz median {_median(probes):.4f} s, worst {worst_probe:.3f} s")
    print(f"  /metrics median {_median(scrapes):.2f} s, worst {worst_scrape:.2f} s")
    # each verdict on the worst one, as a ratio to its target (<= 1 meets it): one late probe is a miss
    verdicts = [
        rep.verdict("worst /healthz / 1 s", [worst_probe / PROBE_TARGET_S], 1.0, higher=False),
        rep.verdict("worst /metrics / 10 s", [worst_scrape / SCRAPE_TARGET_S], 1.0, higher=False),
    ]
    met = lost_probes == 0 and lost_scrapes == 0 and "MISSED" not in verdicts
    print("  targets met" if met else "  targets MISSED (or unanswered)")
    rep.write()
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
