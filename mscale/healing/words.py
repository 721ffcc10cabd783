"""The healing vocabulary, one word each, shared by the engine, the fuse, the agent's healing
service, the demo and the metrics' labels. Each is a `StrEnum`: a member equals its word, so
labels, JSON and the policy file keep the words they always had."""

from __future__ import annotations

from enum import StrEnum


class Result(StrEnum):
    """What came of a decision: the `result` label of a heal_action event and of
    mscale_heal_actions_total."""

    APPLIED = "applied"  # the action took effect
    SENT = "sent"  # the agent sent the command to the job, which books its own result
    NOOP = "noop"  # nothing to do: done already (another path, the same fault)
    FAILED = "failed"  # could not be carried out (the event says why)
    DEFERRED = "deferred"  # never booked: the action books its one result itself, later (a rollback, after the step)
    ENDED = "ended"  # a job closed what the action started (a cooling window)
    DUPLICATE = "duplicate"  # the same condition within the dedup window: not acted on again
    RATE_LIMITED = "rate_limited"  # past a budget (swaps per hour, webhook actions per minute)
    DISABLED = "disabled"  # healing is switched off: recorded, not acted on


# results after which the MPU's state machine moves on (the action took effect, or was sent)
DONE = (Result.APPLIED, Result.SENT)


class TargetKind(StrEnum):
    """What a rule or an action acts on (the policy's `target`, an action's `scope`)."""

    MPU = "mpu"  # one MPU of one job (labels job_id + mpu_id)
    GPU = "gpu"  # a GPU: every MPU bound to it, once per job
    JOB = "job"  # a whole job (absent job_id: every job)


class FuseLevel(StrEnum):
    """An action's fuse level, the `level` label: L1 swap, L2 degradation, L3 distillation,
    or none for the actions outside the fuse."""

    L1 = "L1"
    L2 = "L2"
    L3 = "L3"
    NONE = "none"
