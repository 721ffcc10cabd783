"""The demo's run (see mscale/demo/cli.py): agent, reference run, faulted run; the fault script
is mscale/demo/faults.py, the summary and plot mscale/demo/report.py."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from mscale.demo.faults import ScriptedFault, script
from mscale.demo.report import plot, render, summarise
from mscale.demo.scenario import Run, RunConfig
from mscale.demo.scenario import run as run_plain
from mscale.link import DEFAULT_HOST

if TYPE_CHECKING:
    from mscale.agent_client import AgentClient
    from mscale.demo.embedded import EmbeddedAgent

JOB = "demo-tinymm"
SHORT = {"vision": "vis", "aligner": "aln", "text": "txt"}


def _free(listen: str) -> str:
    host, _, port = listen.rpartition(":")
    with socket.socket() as s:
        try:
            s.bind((host or DEFAULT_HOST, int(port)))
        except OSError:
            return f"{host or DEFAULT_HOST}:0"
    return listen


class Live:
    """The progress bar and the live line (redrawn in place on a terminal)."""

    def __init__(self, total: int, stream=sys.stdout) -> None:
        self.total, self.stream = total, stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.last_print = -1
        self.note = ""

    def draw(self, step: int, loss: float, mpus: list[dict], cooling: bool, force: bool = False) -> None:
        width = 24
        done = int(width * min(step, self.total) / self.total)
        bar = "#" * done + "-" * (width - done)
        parts = []
        for m in mpus:
            h = m.get("health")
            parts.append(
                f"{SHORT.get(m['name'], m['name'])}@gpu{m['gpu']} {m['fuse']:<13} "
                f"h={'--' if h is None else f'{h:3.0f}'}"
            )
        line = f"[{bar}] {step:4d}/{self.total} loss {loss:7.4f}{' LR-cooled' if cooling else ''} | " + " | ".join(
            parts
        )
        if self.note:
            line += f" | {self.note}"
        if self.tty:
            self.stream.write("\r\033[K" + line[: shutil.get_terminal_size((200, 20)).columns - 1])
            self.stream.flush()
        elif force or step - self.last_print >= max(10, self.total // 12):
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last_print = step

    def say(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()


def _mpu_view(agent: Any, r: Run) -> list[dict]:
    """Health from the agent (what it computes from the job's reports), fuse and binding
    from the job."""
    from mscale.daemon import keys

    job = agent.app[keys.STATE].jobs.get(JOB)
    out = []
    for m in r.guard.mpus:
        ms = getattr(job, "mpus", {}).get(m.mpu_id) if job is not None else None
        h = getattr(ms, "health_score", None)
        out.append(
            {
                "name": m.name,
                "mpu_id": m.mpu_id,
                "gpu": m.gpu,
                "fuse": m.fuse_level,
                "health": float(h) if isinstance(h, (int, float)) and math.isfinite(h) else None,
            }
        )
    return out


def main(
    *,
    steps: int,
    out: str,
    listen: str,
    seed: int = 0,
    hold: bool = False,
    heal: bool = True,
    checksum_failures_l1: int = 3,
) -> int:
    from mscale.demo.embedded import EmbeddedAgent

    outdir = _quiet_and_ready(Path(out))
    t_start = time.perf_counter()
    address = _free(listen)
    if address != listen:
        print(f"mscale demo: {listen} is busy; using a free port")
    faults = script(steps)
    healing = {
        "recovery_clean_steps": max(10, steps // 18),
        "lr_cool_steps": max(5, steps // 36),
        "enabled": heal,
        "checksum_failures_l1": checksum_failures_l1,
    }
    with EmbeddedAgent(listen=address, healing=healing) as agent:
        client = agent.client
        if client is None:  # set by start(), which __enter__ ran
            raise RuntimeError("the embedded agent did not start")
        print(
            f"mscale demo: agent on a simulated 8-GPU node (H100); metrics at {agent.url}/metrics, "
            f"status at {agent.url}/api/v1/status (try: mscale status --agent {agent.url})"
        )
        ref, r = _reference_and_faulted(agent, steps, seed, heal, len(faults), outdir / "snapshots")
        health: list[tuple[int, dict]] = []
        try:
            wall, eval_loss = _faulted_run(agent, client, r, faults, steps, health)
        finally:
            r.close()
        agent.wait_for(lambda evs: True, timeout=5)
        summary = _report(outdir, agent, client, faults, r, ref, eval_loss, wall, steps, health, t_start)
        if hold:
            print(f"  holding: the agent keeps serving at {agent.url} (Ctrl-C stops)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    ok = summary["healed_all"] and summary["loss_gap"] is not None and summary["loss_gap"] < 0.05
    return 0 if ok else 1


def _quiet_and_ready(outdir: Path) -> Path:
    """Logs off the terminal (the events go to the agent's API); the output folder made, the
    last run's snapshots cleared."""
    from mscale import logs

    logs.configure("warning", json=False, stream=open(os.devnull, "w"))
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    outdir.mkdir(parents=True, exist_ok=True)
    snapdir = outdir / "snapshots"
    if snapdir.exists():
        shutil.rmtree(snapdir)
    return outdir


def _reference_and_faulted(
    agent: EmbeddedAgent, steps: int, seed: int, heal: bool, n_faults: int, snapdir: Path
) -> tuple[Any, Run]:
    """The fault-free reference run, done; the faulted run, made and reporting to the agent."""
    healing_cfg = agent.config.healing
    print(f"  reference run: {steps} steps without faults ...", flush=True)
    ref = run_plain(RunConfig(steps=steps, seed=seed, healing=healing_cfg, job_id=JOB + "-ref"))
    print(f"  reference done in {ref.wall_s:.1f} s, held-out loss {ref.eval_loss:.4f}")
    print(
        f"  faulted run: {steps} steps, {n_faults} faults scripted; the job reports to the agent"
        + ("" if heal else " (healing off: detect and report only)")
    )
    return ref, Run(
        RunConfig(
            steps=steps,
            seed=seed,
            healing=healing_cfg,
            job_id=JOB,
            snapshot_dir=str(snapdir),
            disk_every=max(50, steps // 4),
            socket_path=agent.socket_path,
        )
    )


def _faulted_run(
    agent: EmbeddedAgent,
    client: AgentClient,
    r: Run,
    faults: list[ScriptedFault],
    steps: int,
    health: list[tuple[int, dict]],
) -> tuple[float, float]:
    """The faulted run's steps, each fault sent when its step comes, the live line drawn and
    each step's MPU health kept in `health`: its wall time and held-out loss."""
    live = Live(steps)
    agent.wait_for(lambda evs: any(e["reason"] == "job_registered" for e in evs), timeout=20)
    t0 = time.perf_counter()
    while r.guard.current_step < steps:
        _send_due(agent, client, r, faults, live)
        info = r.one_step()
        view = _mpu_view(agent, r)
        health.append((info["step"], {m["name"]: m["health"] for m in view}))
        live.draw(info["step"], info["loss"], view, info["cooling"])
        if r.steps_run > steps * 3:
            live.say("  stopping: the run is not converging on its steps")
            break
    wall = time.perf_counter() - t0
    live.draw(r.guard.current_step, r.losses[-1][1], _mpu_view(agent, r), r.fuse.cooling, force=True)
    if live.tty:
        print()
    r.snapshots.flush(timeout=30)
    return wall, r.evaluate()


def _send_due(agent: EmbeddedAgent, client: AgentClient, r: Run, faults: list[ScriptedFault], live: Live) -> None:
    """Send the faults whose step has come through the chaos API, as an operator would."""
    step = r.guard.current_step
    for f in faults:
        if f.sent_step < 0 and step >= f.at:
            status, f.reply = client.chaos(f.chaos)
            f.sent_step, f.sent_time = step, time.time()
            f.mpus = {m.mpu_id: (m.name, m.gpu) for m in r.guard.mpus}
            live.say(f"  step {step}: injected {f.name} (chaos API {status}) -> expect {f.expect}")
            if f.chaos["kind"] in ("xid", "ecc"):  # the agent's probe and engine act on it
                agent.wait_for(
                    lambda evs: any(e["reason"] == "heal_action" and e["source"] == "healing" for e in evs),
                    timeout=20,
                )
            _wait_delivered(r)


def _report(
    outdir: Path,
    agent: EmbeddedAgent,
    client: AgentClient,
    faults: list[ScriptedFault],
    r: Run,
    ref: Any,
    eval_loss: float,
    wall: float,
    steps: int,
    health: list[tuple[int, dict]],
    t_start: float,
) -> dict:
    """The summary from the run and the agent's events and metrics, printed and written with
    the plot and the metrics page."""
    agent_events = client.events()
    metrics = client.metrics()
    summary = summarise(faults, r, ref, eval_loss, wall, agent_events, metrics, steps)
    summary["agent_url"] = agent.url
    summary["wall_s_total"] = round(time.perf_counter() - t_start, 2)
    (outdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = render(summary)
    (outdir / "summary.txt").write_text(text + "\n")
    (outdir / "metrics.txt").write_text(metrics)
    print(text)
    png = plot(outdir / "loss_health.png", r, ref, health, faults, summary)
    print(f"\n  written: {outdir / 'summary.txt'}, {outdir / 'summary.json'}, {png}, {outdir / 'metrics.txt'}")
    print(f"  total {summary['wall_s_total']:.1f} s")
    return summary


def _wait_delivered(r: Run, timeout: float = 10.0) -> None:
    """Chaos commands reach the job over its socket; give them a moment to arrive so the
    fault lands at the step it was sent (the guard takes commands at step boundaries)."""
    deadline = time.monotonic() + timeout
    while not r.guard._commands and time.monotonic() < deadline:
        time.sleep(0.005)
