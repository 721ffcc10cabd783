"""What the engine and the policy know of a healing action: its spec (name, fuse level, whom it
acts on, what it escalates to, whether it cools the job, whether it is the recovery). The specs
are listed in this package's __init__.py; what each action does to a model (its executor) runs
in the training job only and lives in mscale.hook.fuse.actions, one module per action.

The engine (in both processes) and the fuse plugin act on these declarations and never on an
action's name."""

from __future__ import annotations

from dataclasses import dataclass

from mscale.healing.fsm import Level
from mscale.healing.words import FuseLevel, TargetKind


@dataclass(frozen=True)
class ActionSpec:
    name: str
    level: FuseLevel  # the metric label
    moves_to: Level | None  # the MPU's fuse state after it succeeds (None: unchanged)
    help: str = ""
    # what it acts on, hence how often per condition: "mpu" once per target MPU; "gpu" once
    # per job and GPU; "job" once per job (a condition on a GPU that two MPUs of one job use
    # writes one emergency snapshot and swaps both MPUs)
    scope: TargetKind = TargetKind.JOB
    # applied inside the step's forward: the MPU's output is discarded and its forward re-run
    # for the same batch on its new placement
    reruns_forward: bool = False
    # moves the MPU to another device: counted in mpu_drift_count_total and limited to
    # healing.max_swaps_per_hour per MPU (past it, the escalation runs instead)
    drift: bool = False
    # the action of the next fuse level, run instead when this one is rate-limited (past any
    # level the MPU already holds) or, with escalate_on_failure, when it fails
    escalates_to: str | None = None
    escalate_on_failure: bool = False
    # a new placement of the MPU: its count of consecutive failing steps starts over
    new_placement: bool = False
    # while applied, the job's policy level is "cooling"; a resolved alert of its rule sends an
    # end command (the executor's `end`), and the job's "ended" result closes it in the books
    cools_job: bool = False
    # run by the fuse when an MPU with a measure in force comes clean
    on_recovery: bool = False
