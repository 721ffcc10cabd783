"""`mscale status`: the running agent's GPUs, jobs, MPUs, health, fuse levels and last events."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from mscale.agent_client import AgentClient, AgentError
from mscale.link import DEFAULT_URL, printable

HELP = "show GPUs, jobs and their ranks, MPUs, health scores, fuse levels and the last events of the running agent"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--agent", default=DEFAULT_URL, metavar="URL", help=f"the agent's HTTP address (default {DEFAULT_URL})"
    )
    p.add_argument("--events", type=int, default=10, metavar="N", help="how many recent events to show")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S")


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[printable(c) for c in r] for r in rows]  # job-supplied strings: no terminal escapes
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def render(view: dict[str, Any]) -> str:
    out = [f"node {printable(view.get('node', '?'))}", ""]
    gpus = view.get("gpus", [])
    out.append(
        table(
            ["GPU", "UUID", "HEALTH", "REASONS"],
            [[g["index"], g["uuid"], g["health"], ", ".join(g.get("reasons", [])) or "-"] for g in gpus],
        )
        if gpus
        else "no GPU data"
    )
    out.append("")
    rows = []
    cooling = set(view.get("cooling", []))
    for job in view.get("jobs", []):
        for r in job.get("ranks", []) or [{}]:
            for m in r.get("mpus", []) or [{}]:
                score = m.get("health_score")
                rows.append(
                    [
                        job["job_id"] + (" (LR cooled)" if job["job_id"] in cooling else ""),
                        r.get("rank", "-"),
                        r.get("local_rank", "-"),
                        r.get("pid", "-"),
                        r.get("step") if r.get("step") is not None else "-",
                        m.get("mpu_id", "-"),
                        m.get("name", "-"),
                        m.get("gpu", "-"),
                        "-" if score is None else f"{score:.0f}",
                        m.get("fuse", "-"),
                    ]
                )
    headers = ["JOB", "RANK", "LOCAL", "PID", "STEP", "MPU", "NAME", "GPU", "HEALTH", "FUSE"]
    out.append(table(headers, rows) if rows else "no jobs")
    steps = [
        f"{j['job_id']}: step {j.get('step')} (slowest rank), {len(j.get('ranks', []))} ranks"
        for j in view.get("jobs", [])
    ]
    out.extend(steps)
    out.append("")
    evs = view.get("events", [])
    if evs:
        out.append(
            table(
                ["TIME", "SOURCE", "REASON", "SEVERITY", "MESSAGE"],
                [
                    [
                        clock(e.get("time")),
                        e["source"],
                        e["reason"],
                        e["severity"],
                        printable(e["message"], 80),
                    ]
                    for e in evs
                ],
            )
        )
    else:
        out.append("no events")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    try:
        view = AgentClient(args.agent, timeout=args.timeout).status(args.events)
    except (AgentError, ValueError) as e:
        print(f"mscale status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(view, indent=2) if args.json else render(view))
    return 0


def clock(t: Any) -> str:
    """HH:MM:SS of an event's time, whatever a job reported (1e308, NaN, a string): "?" when
    it is no time a clock can show."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(float(t)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"
