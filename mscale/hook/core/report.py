"""The step report the guard builds at the end of every step: what the agent hears of the step
(mscale.link.StepReport, spelled out there), from the guard's per-MPU figures."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from mscale.findings import Finding
from mscale.hook.core.stepstate import StepFigures
from mscale.link import MpuReport, StepReport

if TYPE_CHECKING:
    from mscale.hook.checks.cmsa import Cmsa
    from mscale.hook.core.mpu import Mpu


def _float(v: float | None) -> float:
    """A figure as the report carries it: a float, NaN when unknown."""
    return math.nan if v is None else float(v)


def step_report(
    *,
    step: int,
    figures: StepFigures | None,
    mpus: Iterable[Mpu],
    checksum: Mapping[str, Mapping[str, float]],
    cmsa: Cmsa | None,
    skipped: bool,
    overhead_ratio: float | None,
    findings: Iterable[Finding],
) -> StepReport:
    """The step's report as the guard sends it to the agent and hands it to the plugins'
    `on_report`: `figures` the guard's step figures (None: none measured), `mpus` its MPUs,
    `checksum` the checksum budget's figures per MPU, `cmsa` the clipper (None when off)."""
    clipped = figures.clipped if figures is not None else {}
    by_id = {
        m.mpu_id: MpuReport(
            forward_s=m.forward_s,
            backward_s=m.backward_s,
            grad_norm=_float(m.grad_norm),
            gvc=_float(m.gvc),
            checksum_ok=m.last_checksum_ok,
            checksum_consecutive_failures=m.consecutive_failures,
            checksum_failures_total=m.checksum_failures_total,
            checksum_coverage_ratio=checksum[m.mpu_id]["coverage_ratio"],
            checksum_max_gap_steps=checksum[m.mpu_id]["max_gap_steps"],
            checksum_replay_gap_steps=checksum[m.mpu_id].get("replay_gap_steps", math.nan),
            clip_ratio=cmsa.clip_ratio(m.mpu_id) if cmsa else 0.0,
            distill_share=_float(m.distill_share),  # the fuse's L3 term (0 when none)
            clipped=bool(clipped.get(m.mpu_id, False)),
            gpu=m.gpu,
            fuse_level=m.fuse_level,
            **m.memory(),
        )
        for m in mpus
    }
    loss = figures.loss if figures is not None else None
    return StepReport(
        step=step,
        time=figures.time if figures is not None else time.time(),
        loss=_float(loss),  # what the model returned: L3 adds its term (the fuse's report hook)
        task_loss=_float(loss),
        grad_norm=_float(figures.grad_norm if figures is not None else None),
        skipped=skipped,
        guard_overhead_ratio=_float(overhead_ratio),
        mpus=by_id,
        findings=list(findings),
    )
