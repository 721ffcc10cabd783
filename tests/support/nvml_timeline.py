"""One fault timeline for both stand-ins: the simulated GPUs (mscale.sim.nvml.SimNvml) and the
stand-in libnvidia-ml.so.1 (tests/fixtures/libnvidia_ml_stub.c).

`compile_timeline` reads a `--simulate` timeline (mscale.sim.timeline, the one parser) and
writes the stand-in's directive file: what each GPU's NVML answers, as `at SECONDS` lines at
each step, taken from the simulated GPUs playing that timeline. The stand-in then answers
through NVML's C interface what the simulated GPUs answer through the Python protocol, so the
real adapter (pynvml over the stand-in) and the simulated one can be compared step by step
(`health_series`), and any difference is the adapter's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mscale.daemon.app import new_state
from mscale.daemon.config import from_dict
from mscale.daemon.exporters.gpu import collect
from mscale.probes.gpu import GpuProbe
from mscale.probes.nvml_api import NVMLError, is_gpu_lost
from mscale.sim.nvml import SimNvml
from mscale.sim.timeline import Timeline


class SteppedClock:
    """A clock the test moves: Unix time `t0` plus the elapsed seconds it was set to."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.time() if t0 is None else t0
        self.elapsed = 0.0

    def __call__(self) -> float:
        return self.t0 + self.elapsed


def _readings(sim: SimNvml, i: int) -> dict[str, str]:
    """GPU i's answers as stand-in directives (after `gpu I `), keyed by what they set."""
    out: dict[str, str] = {}

    def attempt(call: str, fn: Callable[[], Any], fmt: Callable[[Any], dict[str, str]]) -> None:
        try:
            out.update(fmt(fn()))
            out[f"error {call}"] = f"error {call} 0"
        except NVMLError as e:
            if is_gpu_lost(e):
                raise
            out[f"error {call}"] = f"error {call} {e.value}"

    def one(name: str) -> Callable[[Any], dict[str, str]]:
        return lambda v: {name: f"{name} {int(v)}"}

    def many(*names: str) -> Callable[[Any], dict[str, str]]:
        return lambda vs: {n: f"{n} {int(v)}" for n, v in zip(names, vs, strict=True)}

    attempt("temperature", lambda: sim.temperature_c(i), one("temperature"))
    attempt("power", lambda: sim.power_mw(i), one("power_mw"))
    attempt("power_limit", lambda: sim.power_limit_mw(i), one("power_limit_mw"))
    attempt("memory", lambda: sim.memory_info(i), many("memory_used", "memory_total"))
    attempt("utilization", lambda: sim.utilization(i), many("util_gpu", "util_memory"))
    attempt("clocks", lambda: sim.clocks_mhz(i), many("sm_clock", "mem_clock"))
    attempt("throttle", lambda: sim.throttle_reasons(i), one("throttle"))
    attempt(
        "ecc",
        lambda: [sim.ecc_errors(i, uncorrected=u, aggregate=a) for u, a in ((0, 0), (1, 0), (0, 1), (1, 1))],
        many("ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate"),
    )
    attempt("retired_pages", lambda: sim.retired_pages(i), many("retired_sbe", "retired_dbe", "retired_pending"))
    attempt(
        "remapped_rows", lambda: sim.remapped_rows(i), many("remap_corr", "remap_unc", "remap_pending", "remap_failed")
    )
    attempt("pcie_replay", lambda: sim.pcie_replay_counter(i), one("pcie_replay"))
    attempt("pcie_throughput", lambda: sim.pcie_throughput_kbs(i), many("pcie_tx", "pcie_rx"))
    attempt("recovery_action", lambda: sim.recovery_action(i), one("recovery_action"))
    links = sim.nvlink_links(i)
    out["nvlinks"] = f"nvlinks {len(links)}"
    if links != tuple(range(len(links))):
        raise ValueError(f"GPU {i}: the stand-in numbers links 0..N-1, the timeline has {links}")
    for link in links:
        out[f"link {link} state"] = f"link {link} {'up' if sim.nvlink_up(i, link) else 'down'}"
        errs = " ".join(str(int(v)) for v in sim.nvlink_errors(i, link))
        out[f"link {link} errors"] = f"link {link} errors {errs}"
    return out


def compile_timeline(timeline: Timeline, steps: Sequence[float], *, clock_file: Path | None = None) -> str:
    """The stand-in's directive file for `timeline`, read at each of `steps` (seconds after
    start, ascending, the first 0). With clock_file, the stand-in's time is the number the
    test writes there (`write_clock`), so it steps exactly with the simulated GPUs."""
    if not steps or steps[0] != 0 or list(steps) != sorted(steps):
        raise ValueError("steps: ascending seconds from 0")
    clock = SteppedClock(0.0)
    sim = SimNvml.from_timeline(timeline, clock=clock)
    lines = [f"# compiled from {timeline.source} by tests/support/nvml_timeline.py", f"gpus {timeline.gpus}"]
    if clock_file is not None:
        lines.append(f"clock_file {clock_file}")
    for i in range(timeline.gpus):
        lines.append(f"gpu {i} uuid {sim.uuids[i]}")
        lines.append(f"gpu {i} name {sim.name(i)}")
    # Xids at their own time, through nvmlEventSetWait, as the simulated event source sends them.
    timed: list[tuple[float, int, str]] = [
        (ev.at_s, n, f"xid {ev.gpu} {ev.code}") for n, ev in enumerate(timeline.events) if ev.fault == "xid"
    ]
    before: dict[int, dict[str, str]] = {i: {} for i in range(timeline.gpus)}
    for k, t in enumerate(steps):
        clock.elapsed = t
        for i in range(timeline.gpus):
            try:
                now = {"lost": "lost 0", **_readings(sim, i)}
            except NVMLError as e:
                if not is_gpu_lost(e):
                    raise
                now = {**before[i], "lost": "lost 1"}  # every call fails; the last answers stay
            changed = [v for key, v in now.items() if before[i].get(key) != v]
            before[i] = now
            for directive in changed:
                if k == 0:
                    lines.append(f"gpu {i} {directive}")
                else:
                    timed.append((t, len(timeline.events) + 1, f"gpu {i} {directive}"))
    timed.sort(key=lambda x: (x[0], x[1]))  # stable: same-time lines keep their order
    lines += [f"at {t!r} {line}" for t, _, line in timed]
    return "\n".join(lines) + "\n"


def write_clock(path: Path, elapsed: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(repr(elapsed))
    tmp.replace(path)  # the stand-in never reads half a number


def metric_values(snapshot: Any) -> dict[str, float]:
    """The GPU exporter's samples for one snapshot, 'name{labels}' -> value; the `backend`
    label of mscale_gpu_info (nvml or sim) is left out, it is the one intended difference."""
    state = new_state(from_dict({}))
    state.snapshots["gpu"] = snapshot
    out = {}
    for family in collect(state):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "backend")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def health_series(
    probe: GpuProbe,
    timeline: Timeline,
    steps: Sequence[float],
    set_elapsed: Callable[[float], None],
    xids_heard: Callable[[], int],
    *,
    timeout_s: float = 20.0,
) -> list[dict[str, float]]:
    """Step the clock through `steps`; at each, wait until every Xid due by then has reached
    the probe (its finding emitted), sample, and keep the exported values."""
    series = []
    for t in steps:
        set_elapsed(t)
        due = sum(1 for ev in timeline.events if ev.fault == "xid" and ev.at_s <= t)
        deadline = time.monotonic() + timeout_s
        while xids_heard() < due:
            if time.monotonic() > deadline:
                raise TimeoutError(f"at {t}s: {xids_heard()} of {due} Xids reached the probe in {timeout_s}s")
            time.sleep(0.01)  # polling a condition with a deadline, not standing in for one
        series.append(metric_values(probe.sample()))
    return series


__all__ = ["SteppedClock", "compile_timeline", "health_series", "metric_values", "write_clock"]
