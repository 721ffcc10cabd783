"""What a healing action is. One action per module in this folder, listed in __init__.py.

Each module declares `ACTION = ActionSpec(...)`. The engine (in both processes) and the fuse
plugin (mscale.hook.fuse.FusePlugin, in the training process) act on these declarations and
never on an action's name: whom it acts on (`scope`), whether the MPU's forward is re-run
in the current step, whether it counts as a drift and is swap-rate-limited, what it escalates
to, whether it starts a new placement, the labels of its event, what its reported result
means for a job's books.

Carrying it out, in the training process only:

    apply(fuse, state, decision) -> result label

`fuse` is the FusePlugin (the guard, the healing engine, the snapshot engine, `dispatch` to
the other actions' states), `state` this action's own per-job state, built once per job by
`state(fuse)` when the plugin is made (None when the action keeps none). The result is
"applied", "noop" or another word booked as is (rollback's "step_dropped"); ActionFailed
says why it could not be done (a "failed" event). The agent only needs the metadata, so
action modules import torch inside their functions.

A state object may implement any of these; the fuse calls the ones it has, in registry order,
with itself first (`fuse.dispatch(hook, *args)`):

    attach(fuse)                  the plugin was added to a guard
    detach(fuse)                  the guard detaches: undo what is in force
    step_begin(fuse)              a step begins (fuse.seq already counts it)
    mpu_output(fuse, mpu, out)    an MPU's forward returned `out` (inside the step)
    step_end(fuse, step)          the optimizer stepped (before the clean-step count)
    settle(fuse, step) -> bool    after the clean-step count; True: the step's state was
                                  dropped or replaced (a rollback), so it is not snapshotted
    weights_settled(fuse)         the weights are final for this step (or restored)
    in_force(fuse, mpu) -> bool   a measure of this action holds on the MPU
    undo(fuse, mpu)               undo that measure (the MPU came clean)
    avoid_gpus(fuse) -> set[int]  GPUs no MPU of the job may move onto
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mscale.healing.fsm import Level

if TYPE_CHECKING:
    from mscale.healing.engine import Decision

Scope = Literal["mpu", "gpu", "job"]


class ActionFailed(RuntimeError):
    """The action could not be carried out; the message says why (it becomes an event)."""


@dataclass(frozen=True)
class ActionSpec:
    name: str
    level: str  # metric label: L1, L2, L3, or none for the non-fuse actions
    moves_to: Level | None  # the MPU's fuse state after it succeeds (None: unchanged)
    apply: Callable[[Any, Any, Decision], str]
    help: str = ""
    # what it acts on, hence how often per condition: "mpu" once per target MPU; "gpu" once
    # per job and GPU; "job" once per job (a condition on a GPU that two MPUs of one job use
    # writes one emergency snapshot and swaps both MPUs)
    scope: Scope = "job"
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
    # end command (`end`), and the job's "ended" result closes it in the agent's books
    cools_job: bool = False
    # run by the fuse when an MPU with a measure in force (`in_force`) comes clean
    on_recovery: bool = False
    # the per-job state, built by the fuse plugin (see the module docstring)
    state: Callable[[Any], Any] | None = None
    # (detail text, extra labels) for the event of an applied result, from the action's state
    event: Callable[[Any, Decision], tuple[str, Mapping[str, str]]] | None = None
    # end what the action started (an end command from the agent): end(fuse, state, why)
    end: Callable[[Any, Any, str], None] | None = None
