"""The plugin surface of the guard: what the fuse, the snapshot plugin and user code build on.

A plugin is any object with at least one of the methods below (`Guard.add_plugin` refuses one
with none); the guard calls the methods it has and skips the ones it lacks, in the order the
plugins were added (`attach(plugins=[...])` first, then what `attach(snapshots=...)` adds: the
fuse). Calls happen in the training thread, in this order for each step:

    on_step_begin(step, batch)     at the step's first training-mode forward of the model;
                                   batch is a ModelInputs (args, kwargs) as the model got it
    on_mpu_output(mpu, inputs, output) -> replacement | None
                                   after each MPU forward and its checksums (not for the
                                   checksum's own replays); return a value to replace the
                                   MPU's output (the fuse's re-run)
    on_commit(point)               at the optimizer's step pre-hook, first: put this step's
                                   device verdicts in the commit point (mscale.hook.core.commit),
                                   read back with every other verdict in one read, after the
                                   agreement's all-reduce (nothing may be read here)
    on_step_decide(step)           at the optimizer's step pre-hook, before the gradient
                                   statistics and the loss detector: where the ranks agree on
                                   the step (mscale.hook.core.agree; a collective, so every rank's
                                   guard calls it once per optimizer step); the values put
                                   in `on_commit` are in `guard.commit_point` (`get(key)`)
    on_finding(finding)            as each finding is made: checksums inside the forward,
                                   loss and gradient statistics in the optimizer's step
                                   pre-hook (before the update; at scaler.update() for a
                                   step the scaler skipped), snapshot findings
    on_step_end(step, loss)        after optimizer.step(), or at scaler.update() once the loop
                                   uses a watched GradScaler (so a step the scaler skipped
                                   ends too); loss is the step's mean loss, None when unknown,
                                   NaN stays NaN. A plugin that restores a snapshot here calls
                                   guard.set_step(n) and the guard runs step n next
    on_report(report)              after every plugin's on_step_end, with the step report the
                                   guard sends the agent (a mscale.link.StepReport): a plugin
                                   may set its fields (mscale.hook.core.goodput sets `seconds`)
    on_command(command) -> dict | None
                                   commands from the agent, dispatched between steps (never
                                   mid-step); a returned dict is sent back as the reply

plus on_attach(guard) when added and on_detach(guard) when removed or when the guard detaches.
A plugin that raises is logged and counted (`guard.plugin_errors`); training goes on.

Plugins read per-MPU state from `guard.mpus` (see `mscale.hook.core.mpu.Mpu`) and change the job
only through the guard: `request_skip(reason)` drops this step's update (its gradients are
discarded before the optimizer step; asked for after that, it marks the step skipped in the
report but the update has happened), `rebind`, `cmsa.raise_threshold`, `set_step`, `emit`,
`send_to_agent`. The guard itself drops the update of a step whose loss or gradient norm is
not finite, with or without a plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import structlog

if TYPE_CHECKING:
    from mscale.findings import Finding
    from mscale.hook.core.commit import CommitPoint
    from mscale.hook.core.guard import Guard, ModelInputs
    from mscale.hook.core.mpu import Mpu
    from mscale.link import StepReport
    from mscale.link.wire import Wire

HOOKS: tuple[str, ...] = (
    "on_attach",
    "on_step_begin",
    "on_mpu_output",
    "on_commit",
    "on_step_decide",
    "on_finding",
    "on_step_end",
    "on_report",
    "on_command",
    "on_detach",
)


class Plugin(Protocol):
    """Documentation of the optional methods; plugins need not subclass or implement all."""

    def on_attach(self, guard: Guard) -> None: ...

    def on_step_begin(self, step: int, batch: ModelInputs) -> None: ...

    def on_mpu_output(self, mpu: Mpu, inputs: ModelInputs, output: object) -> object: ...

    def on_commit(self, point: CommitPoint) -> None: ...

    def on_step_decide(self, step: int) -> None: ...

    def on_finding(self, finding: Finding) -> None: ...

    def on_step_end(self, step: int, loss: float | None) -> None: ...

    def on_report(self, report: StepReport) -> None: ...

    def on_command(self, command: Wire) -> Wire | None: ...

    def on_detach(self, guard: Guard) -> None: ...


class PluginHooks:
    """The guard's plugin list and its dispatch, a part mscale.hook.core.guard.Guard holds: each
    hook called on every plugin that has it, in the order they were added; one that raises is
    logged and counted (`errors`), never passed on to the training loop. `owner`: what
    `on_attach` and `on_detach` receive (the guard)."""

    def __init__(self, owner: object, log: structlog.typing.FilteringBoundLogger) -> None:
        self.owner, self.log = owner, log
        self.plugins: list[object] = []  # any object with some of the methods above
        self.errors = 0

    def add(self, plugin: object) -> None:
        if not any(hasattr(plugin, h) for h in HOOKS):
            raise TypeError(f"{type(plugin).__name__} has none of the plugin methods {', '.join(HOOKS)}")
        self.plugins.append(plugin)
        self.call(plugin, "on_attach", self.owner)

    def remove(self, plugin: object) -> None:
        self.plugins.remove(plugin)
        self.call(plugin, "on_detach", self.owner)

    def dispatch(self, hook: str, *args: object) -> None:
        for p in list(self.plugins):
            self.call(p, hook, *args)

    def call(self, plugin: object, hook: str, *args: object) -> object:
        fn = getattr(plugin, hook, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # a plugin must never break the training step
            self.errors += 1
            self.log.exception("plugin_error", plugin=type(plugin).__name__, hook=hook, error=str(e))
            return None
