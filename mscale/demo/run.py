"""The demo's run (see mscale/demo/cli.py): agent, reference run, faulted run, summary, plot."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from mscale.demo.scenario import Run, RunConfig, relative_gap
from mscale.demo.scenario import run as run_plain
from mscale.demo.verdict import judge
from mscale.healing.words import Result
from mscale.link import DEFAULT_HOST

JOB = "demo-tinymm"
SHORT = {"vision": "vis", "aligner": "aln", "text": "txt"}


@dataclass
class ScriptedFault:
    at: int  # step it is sent at
    name: str
    expect: str  # the healing it should cause
    chaos: dict  # body for POST /api/v1/chaos
    sent_step: int = -1
    sent_time: float = 0.0
    reply: dict = field(default_factory=dict)
    mpus: dict = field(default_factory=dict)  # mpu_id -> (name, gpu) when it was sent


def script(steps: int) -> list[ScriptedFault]:
    """The fault sequence, placed at fractions of the run so --steps scales it."""

    def at(frac: float) -> int:
        return max(5, int(steps * frac))

    span = max(6, steps // 12)
    return [
        ScriptedFault(
            at(0.10),
            "SDC on the vision MPU's GPU 0",
            "L1 swap to a standby GPU",
            {"kind": "corrupt", "gpu": 0, "mode": "noise", "steps": span},
        ),
        ScriptedFault(
            at(0.28),
            "corruption following the vision MPU",
            "L1, then L2 (standby fails), then L3",
            {"kind": "corrupt", "mpu": "vision", "mode": "noise", "steps": span + 6},
        ),
        ScriptedFault(
            at(0.55),
            "25x loss spike",
            "LR x0.1 for a cooling window",
            {"kind": "loss_spike", "factor": 25.0, "steps": 1},
        ),
        ScriptedFault(at(0.66), "NaN loss", "step dropped, rollback, batch skipped", {"kind": "nan_loss", "steps": 1}),
        ScriptedFault(
            at(0.78),
            "Xid 79 on GPU 1 (aligner)",
            "emergency snapshot, GPU quarantined, L1 swap",
            {"kind": "xid", "gpu": 1, "code": 79, "corrupt": "noise"},
        ),
    ]


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
    from mscale import logs
    from mscale.demo.embedded import EmbeddedAgent

    logs.configure("warning", json=False, stream=open(os.devnull, "w"))  # events go to the agent's API
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    snapdir = outdir / "snapshots"
    if snapdir.exists():
        shutil.rmtree(snapdir)
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
        healing_cfg = agent.config.healing
        print(f"  reference run: {steps} steps without faults ...", flush=True)
        ref = run_plain(RunConfig(steps=steps, seed=seed, healing=healing_cfg, job_id=JOB + "-ref"))
        print(f"  reference done in {ref.wall_s:.1f} s, held-out loss {ref.eval_loss:.4f}")
        print(
            f"  faulted run: {steps} steps, {len(faults)} faults scripted; the job reports to the agent"
            + ("" if heal else " (healing off: detect and report only)")
        )
        r = Run(
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
        live = Live(steps)
        health: list[tuple[int, dict]] = []
        try:
            agent.wait_for(lambda evs: any(e["reason"] == "job_registered" for e in evs), timeout=20)
            t0 = time.perf_counter()
            while r.guard.current_step < steps:
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
            eval_loss = r.evaluate()
        finally:
            r.close()
        agent.wait_for(lambda evs: True, timeout=5)
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
        if hold:
            print(f"  holding: the agent keeps serving at {agent.url} (Ctrl-C stops)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    ok = summary["healed_all"] and summary["loss_gap"] is not None and summary["loss_gap"] < 0.05
    return 0 if ok else 1


def _wait_delivered(r: Run, timeout: float = 10.0) -> None:
    """Chaos commands reach the job over its socket; give them a moment to arrive so the
    fault lands at the step it was sent (the guard takes commands at step boundaries)."""
    deadline = time.monotonic() + timeout
    while not r.guard._commands and time.monotonic() < deadline:
        time.sleep(0.005)


def _first(findings: list, since_step: int, reasons: tuple[str, ...], until_step: int | None = None):
    for f in findings:
        s = int(f.labels.get("step", -1))
        if f.reason.value in reasons and s >= since_step and (until_step is None or s < until_step):
            return f
    return None


def summarise(
    faults: list[ScriptedFault],
    r: Run,
    ref: Any,
    eval_loss: float,
    wall: float,
    agent_events: list[dict],
    metrics: str,
    steps: int,
) -> dict:
    detect = {
        "corrupt": ("checksum_failure", "nonfinite_output"),
        "loss_spike": ("loss_jump", "loss_spike_action"),
        "nan_loss": ("loss_nonfinite",),
        "xid": ("gpu_xid",),
    }
    rows = []
    fs = r.findings
    for i, f in enumerate(faults):
        until = faults[i + 1].sent_step if i + 1 < len(faults) else None
        kind = f.chaos["kind"]
        row = {"fault": f.name, "injected_at": f.sent_step, "expect": f.expect}
        if kind == "xid":
            ev = next((e for e in agent_events if e["reason"] == "gpu_xid" and e["time"] >= f.sent_time - 1), None)
            row["detected"] = f"gpu probe (agent): Xid {ev['labels'].get('xid')}" if ev else "no"
        else:
            d = _first(fs, f.sent_step, detect[kind], until)
            row["detected"] = f"step {d.labels.get('step')} by {d.source} ({d.reason.value})" if d else "no"
        acts = [
            a
            for a in fs
            if a.reason.value == "heal_action"
            and a.labels.get("result") in (Result.APPLIED, Result.ENDED)
            and int(a.labels.get("step", -1)) >= f.sent_step
            and (until is None or int(a.labels.get("step", -1)) < until)
        ]
        names: list[str] = []
        for a in acts:
            names.append(
                f"{a.labels['action']}"
                + (f"({a.labels['mpu_id']})" if a.labels.get("mpu_id") else "")
                + ("" if a.labels["result"] == Result.APPLIED else f":{a.labels['result']}")
            )
        row["actions"] = [n if names.count(n) == 1 else f"{n} x{names.count(n)}" for n in dict.fromkeys(names)]
        row["duplicates"] = sum(
            1
            for a in fs
            if a.reason.value == "heal_action"
            and a.labels.get("result") == Result.DUPLICATE
            and int(a.labels.get("step", -1)) >= f.sent_step
            and (until is None or int(a.labels.get("step", -1)) < until)
        )
        lost = [
            rb
            for rb in r.fuse.states["rollback"].rollbacks
            if rb["step"] >= f.sent_step and (until is None or rb["step"] < until)
        ]
        row["steps_lost"] = sum(rb["step"] - (rb["to"] if rb["to"] is not None else rb["step"] - 1) for rb in lost)
        healed, row["healed_by"], row["evidence"] = judge(
            f.chaos,
            f.sent_step,
            until,
            fs,
            r.checks,
            r.losses,
            mpus_at_start=f.mpus,
            nan_in_weights=r.nonfinite_weights,
        )
        row["healed"] = row["detected"] != "no" and healed
        rows.append(row)
    gap = relative_gap(eval_loss, ref.eval_loss)
    heal_lines = [
        ln for ln in metrics.splitlines() if ln.startswith(("mscale_heal_actions_total{", "mpu_drift_count_total{"))
    ]
    return {
        "steps": steps,
        "steps_run": r.steps_run,
        "steps_lost": r.steps_run - r.guard.current_step,
        "faults": rows,
        "healed_all": all(x["healed"] for x in rows),
        "final_loss": eval_loss,
        "reference_loss": ref.eval_loss,
        "loss_gap": gap if math.isfinite(gap) else None,
        "wall_s": round(wall, 2),
        "reference_wall_s": round(ref.wall_s, 2),
        "goodput_ratio": round((r.guard.current_step / wall) / (steps / ref.wall_s), 3) if wall else None,
        "time_by_cause": {c: round(sec, 3) for c, sec, _ in r.goodput.breakdown()},
        "nan_reached_weights": r.nonfinite_weights,
        "agent_metrics": heal_lines,
    }


def render(s: dict) -> str:
    from mscale.daemon.status_cli import table

    rows = [
        [
            i + 1,
            x["fault"],
            x["injected_at"],
            x["detected"],
            ", ".join(x["actions"]) or "-",
            x["duplicates"],
            x["steps_lost"],
            "yes" if x["healed"] else "no",
            (", ".join(x["healed_by"]) + ": " if x["healed"] else "") + x["evidence"],
        ]
        for i, x in enumerate(s["faults"])
    ]
    lines = [
        "",
        "Summary",
        "=======",
        table(["#", "FAULT", "STEP", "DETECTED", "ACTIONS", "DUP", "LOST", "HEALED", "HEALED BY / WHY NOT"], rows),
        "",
        "HEALED: the action the fault's level calls for was applied and the fault's effect ended "
        "(clean checks on the new placement, the loss back in its band); marking an MPU suspect is not healing.",
        f"faults healed: {sum(1 for x in s['faults'] if x['healed'])} of {len(s['faults'])}",
        f"steps: {s['steps']} completed, {s['steps_run']} run, {s['steps_lost']} lost to rollbacks",
        f"final held-out loss: {s['final_loss']:.4f} vs {s['reference_loss']:.4f} without faults "
        f"({100 * s['loss_gap']:.2f}% apart)"
        if s["loss_gap"] is not None
        else "final loss: not finite",
        f"goodput (useful steps/s vs the fault-free run): {s['goodput_ratio']}",
        "the faulted run's wall time by cause (mscale_job_goodput/badput_seconds_total):",
        *(
            f"  {c:<11} {sec:8.2f} s  {100 * sec / max(sum(s['time_by_cause'].values()), 1e-9):5.1f}%"
            for c, sec in s["time_by_cause"].items()
        ),
        f"NaN reached the weights: {'yes' if s['nan_reached_weights'] else 'no'}",
        "agent counters:",
    ] + [f"  {ln}" for ln in s["agent_metrics"]]
    return "\n".join(lines)


def plot(
    path: Path, r: Run, ref: Any, health: list[tuple[int, dict]], faults: list[ScriptedFault], summary: dict
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.2]}
    )
    rs, rl = zip(*ref.losses, strict=True)
    ax1.plot(rs, rl, color="0.6", lw=1, label="fault-free reference")
    xs = list(range(len(r.losses)))
    steps = [s for s, _ in r.losses]
    vals = [loss if math.isfinite(loss) else float("nan") for _, loss in r.losses]
    healed = "healed" if summary["healed_all"] else "not every fault healed"
    ax1.plot(steps, vals, color="tab:blue", lw=1, label=f"faulted run ({healed})")
    for s, loss in r.losses:
        if not math.isfinite(loss):
            ax1.axvline(s, color="red", lw=0.6, ls=":")
    ax1.set_yscale("log")
    ax1.set_ylabel("training loss")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(
        f"MegaScale-Omni demo: final loss {summary['final_loss']:.4f} vs {summary['reference_loss']:.4f} "
        f"fault-free; {summary['steps_lost']} steps lost"
    )
    colors = {"vision": "tab:purple", "aligner": "tab:orange", "text": "tab:green"}
    for name in colors:
        pts = [(s, h[name]) for s, h in health if h.get(name) is not None]
        if pts:
            ax2.plot(*zip(*pts, strict=True), color=colors[name], lw=1, label=f"{name} health")
    ax2.axhline(60, color="red", lw=0.6, ls="--")
    ax2.set_ylabel("MPU health (agent)")
    ax2.set_ylim(-5, 105)
    ax2.legend(loc="lower right", fontsize=8)
    from mscale.healing.fsm import Level

    for name in colors:
        pts = [(s, Level(lv[name]).number if lv.get(name) in Level._value2member_map_ else 0) for s, lv in r.levels]
        if pts:
            ax3.step(*zip(*pts, strict=True), where="post", color=colors[name], lw=1, label=name)
    ax3.set_yticks([0, 1, 2, 3], ["healthy", "L1", "L2", "L3"])
    ax3.set_ylabel("fuse")
    ax3.set_xlabel("training step")
    ax3.legend(loc="upper right", fontsize=8)
    for f in faults:
        if f.sent_step >= 0:
            for ax in (ax1, ax2, ax3):
                ax.axvline(f.sent_step, color="red", lw=0.8, alpha=0.6)
            ax1.annotate(
                f.name,
                (f.sent_step, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=7,
                va="top",
                ha="right",
                color="red",
            )
    del xs
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
