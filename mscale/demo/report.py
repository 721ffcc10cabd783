"""What the demo's run leaves: the summary (one row per fault: detected, actions, steps lost,
healed and by what), its text table, and the plot of loss, health and fuse over the steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mscale.demo.faults import ScriptedFault
from mscale.demo.scenario import Run, relative_gap
from mscale.demo.verdict import judge
from mscale.healing.words import Result

DETECTED_BY = {  # chaos kind -> the findings that show it was detected
    "corrupt": ("checksum_failure", "nonfinite_output"),
    "loss_spike": ("loss_jump", "loss_spike_action"),
    "nan_loss": ("loss_nonfinite",),
    "xid": ("gpu_xid",),
}


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
    rows = []
    for i, f in enumerate(faults):
        until = faults[i + 1].sent_step if i + 1 < len(faults) else None
        rows.append(_fault_row(f, until, r, agent_events))
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


def _fault_row(f: ScriptedFault, until: int | None, r: Run, agent_events: list[dict]) -> dict:
    """One fault's line of the summary, from the findings between its step and the next fault's:
    what detected it, the actions taken, the steps lost, whether it healed and by what."""
    fs = r.findings
    kind = f.chaos["kind"]
    row: dict[str, Any] = {"fault": f.name, "injected_at": f.sent_step, "expect": f.expect}
    if kind == "xid":
        ev = next((e for e in agent_events if e["reason"] == "gpu_xid" and e["time"] >= f.sent_time - 1), None)
        row["detected"] = f"gpu probe (agent): Xid {ev['labels'].get('xid')}" if ev else "no"
    else:
        d = _first(fs, f.sent_step, DETECTED_BY[kind], until)
        row["detected"] = f"step {d.labels.get('step')} by {d.source} ({d.reason.value})" if d else "no"
    row["actions"] = _actions(fs, f.sent_step, until)
    row["duplicates"] = sum(
        1 for a in _heal_actions(fs, f.sent_step, until) if a.labels.get("result") == Result.DUPLICATE
    )
    from mscale.hook.fuse.actions.rollback import Rollbacks

    rolled = r.fuse.state_of(Rollbacks)
    lost = [
        rb
        for rb in (rolled.rollbacks if rolled is not None else [])
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
    return row


def _heal_actions(findings: list, since_step: int, until_step: int | None) -> list:
    """The healing actions' findings of the steps [since_step, until_step)."""
    return [
        a
        for a in findings
        if a.reason.value == "heal_action"
        and int(a.labels.get("step", -1)) >= since_step
        and (until_step is None or int(a.labels.get("step", -1)) < until_step)
    ]


def _actions(findings: list, since_step: int, until_step: int | None) -> list[str]:
    """The actions applied or ended in the steps [since_step, until_step), in order, each once
    with its count: `l1_swap(001)`, `recover(001):ended`, `lr_cool x2`."""
    names: list[str] = []
    for a in _heal_actions(findings, since_step, until_step):
        if a.labels.get("result") not in (Result.APPLIED, Result.ENDED):
            continue
        names.append(
            f"{a.labels['action']}"
            + (f"({a.labels['mpu_id']})" if a.labels.get("mpu_id") else "")
            + ("" if a.labels["result"] == Result.APPLIED else f":{a.labels['result']}")
        )
    return [n if names.count(n) == 1 else f"{n} x{names.count(n)}" for n in dict.fromkeys(names)]


def _first(findings: list, since_step: int, reasons: tuple[str, ...], until_step: int | None = None):
    for f in findings:
        s = int(f.labels.get("step", -1))
        if f.reason.value in reasons and s >= since_step and (until_step is None or s < until_step):
            return f
    return None


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


MPU_COLOURS = {"vision": "tab:purple", "aligner": "tab:orange", "text": "tab:green"}


def plot(
    path: Path, r: Run, ref: Any, health: list[tuple[int, dict]], faults: list[ScriptedFault], summary: dict
) -> Path:
    """Loss against the reference, the MPUs' health and their fuse levels over the steps, the
    faults marked where they were sent."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.2]}
    )
    _plot_loss(ax1, r, ref, summary)
    _plot_health(ax2, health)
    _plot_fuse(ax3, r)
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_loss(ax: Any, r: Run, ref: Any, summary: dict) -> None:
    """The faulted run's loss over the reference's, each non-finite loss a dotted line."""
    rs, rl = zip(*ref.losses, strict=True)
    ax.plot(rs, rl, color="0.6", lw=1, label="fault-free reference")
    steps = [s for s, _ in r.losses]
    vals = [loss if math.isfinite(loss) else float("nan") for _, loss in r.losses]
    healed = "healed" if summary["healed_all"] else "not every fault healed"
    ax.plot(steps, vals, color="tab:blue", lw=1, label=f"faulted run ({healed})")
    for s, loss in r.losses:
        if not math.isfinite(loss):
            ax.axvline(s, color="red", lw=0.6, ls=":")
    ax.set_yscale("log")
    ax.set_ylabel("training loss")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(
        f"MegaScale-Omni demo: final loss {summary['final_loss']:.4f} vs {summary['reference_loss']:.4f} "
        f"fault-free; {summary['steps_lost']} steps lost"
    )


def _plot_health(ax: Any, health: list[tuple[int, dict]]) -> None:
    """Each MPU's health as the agent scored it, and the line under which to act (60)."""
    for name, colour in MPU_COLOURS.items():
        pts = [(s, h[name]) for s, h in health if h.get(name) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), color=colour, lw=1, label=f"{name} health")
    ax.axhline(60, color="red", lw=0.6, ls="--")
    ax.set_ylabel("MPU health (agent)")
    ax.set_ylim(-5, 105)
    ax.legend(loc="lower right", fontsize=8)


def _plot_fuse(ax: Any, r: Run) -> None:
    """Each MPU's fuse level over the steps."""
    from mscale.healing.fsm import Level

    for name, colour in MPU_COLOURS.items():
        pts = [(s, Level(lv[name]).number if lv.get(name) in Level._value2member_map_ else 0) for s, lv in r.levels]
        if pts:
            ax.step(*zip(*pts, strict=True), where="post", color=colour, lw=1, label=name)
    ax.set_yticks([0, 1, 2, 3], ["healthy", "L1", "L2", "L3"])
    ax.set_ylabel("fuse")
    ax.set_xlabel("training step")
    ax.legend(loc="upper right", fontsize=8)
