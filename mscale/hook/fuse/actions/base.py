"""What a healing action does in the training job: its executor. One action per module in this
folder, registered in __init__.py; what the engine and the policy know of it (its spec) is in
mscale.healing.actions, which the agent loads without torch.

Each module declares `EXECUTOR = Executor(spec, apply, ...)`:

    apply(fuse, state, decision) -> result label

`fuse` is the FusePlugin seen through `FuseContext` (the guard, the healing engine, the snapshot
engine, `dispatch` to the other actions' states), `state` this action's own per-job state, built
once per job by `state(fuse)` when the plugin is made (None when the action keeps none). The
result is "applied", "noop" or another word booked as is, or "deferred": the action books its
one event itself, later (a rollback, after the step, its restore with the dropped update);
ActionFailed says why it could not be done (a "failed" event). Executors import torch inside
their functions: importing the fuse stays cheap.

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
    mpu_failed(fuse, mpu, f) -> bool  before an MPU's failure counts; True: its weights' (repaired)
    report(fuse, report)          the step report is being built: add or change its fields
    in_force(fuse, mpu) -> bool   a measure of this action holds on the MPU
    undo(fuse, mpu)               undo that measure (the MPU came clean)
    avoid_gpus(fuse) -> set[int]  GPUs no MPU of the job may move onto
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from mscale.healing.actions.base import ActionSpec
from mscale.healing.engine import Decision, HealingEngine
from mscale.healing.settings import HealingSection

if TYPE_CHECKING:
    from mscale.healing.progress import Keeper
    from mscale.hook.core.guard import Guard
    from mscale.hook.core.mpu import Mpu
    from mscale.hook.fuse.fuse import Placement
    from mscale.snapshot.engine import SnapshotEngine


S = TypeVar("S")


class ActionFailed(RuntimeError):
    """The action could not be carried out; the message says why (it becomes an event)."""


class FuseContext(Protocol):
    """What an executor may use of the fuse plugin (mscale.hook.fuse.fuse.FusePlugin)."""

    @property
    def guard(self) -> Guard: ...  # the guard the plugin is attached to

    cfg: HealingSection
    engine: HealingEngine | None  # set when the plugin attaches
    snapshot_engine: SnapshotEngine | None
    states: dict[str, object]  # every action's per-job state, by action name
    placement: dict[str, Placement]  # mpu_id -> its placement's failure count
    pending_rerun: set[str]  # MPUs whose forward is re-run on their new placement
    ask_standby: Callable[[Mpu, Iterable[int]], int | None] | None  # the agent's choice of standby
    seq: int  # steps run (never set back by a rollback)
    progress: Keeper  # the forward-progress keeper
    gpu_count: int | None
    l2_resolution: float
    l2_clip_factor: float
    l2_precision_fallback: bool
    clock: Callable[[], float]

    def dispatch(self, hook: str, *args: object) -> list[object]: ...

    def state_of(self, kind: type[S]) -> S | None: ...  # the action state of that type

    def drop_step(self, why: str) -> None: ...

    def run(self, d: Decision) -> str: ...

    def record(self, d: Decision, result: str, *, detail: str = "") -> None: ...

    def reduction_failed(self, m: Mpu, spec: ActionSpec, detail: str) -> None: ...


@dataclass(frozen=True)
class Executor(Generic[S]):
    """One action's executor; `S` its per-job state (None for an action that keeps none), which
    its functions all take: mypy checks they agree. The registry holds every action's, so the
    fuse hands each the state it keeps under the action's name."""

    spec: ActionSpec
    apply: Callable[[FuseContext, S, Decision], str]
    # the per-job state, built by the fuse plugin (see the module docstring)
    state: Callable[[FuseContext], S] | None = None
    # (detail text, extra labels) for the event of an applied result, from the action's state
    event: Callable[[S, Decision], tuple[str, Mapping[str, str]]] | None = None
    # end what the action started (an end command from the agent): end(fuse, state, why)
    end: Callable[[FuseContext, S, str], None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name
