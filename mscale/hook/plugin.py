"""The plugin surface of the guard: what the snapshot engine, the fuse and user code build on.

A plugin is any object; the guard calls the methods it has and skips the ones it lacks.
Calls happen in the training thread, in this order for each optimizer step:

    on_step_begin(step, batch)     before the first training-mode forward of the step
    on_mpu_output(mpu, inputs, output) -> replacement | None
                                   after each MPU forward and its checksums; return a
                                   value to replace the MPU's output (the fuse's re-run)
    on_finding(finding)            as each finding is made (checksums inside the forward,
                                   loss/gradient statistics before the optimizer step)
    on_step_end(step, loss)        after optimizer.step(); loss is the step's mean loss
                                   (None when unknown, NaN stays NaN)
    on_command(command) -> dict | None
                                   commands from the agent, dispatched at step boundaries
                                   (never mid-step); a returned dict is sent back as the reply

plus on_attach(guard) when added and on_detach(guard) when the guard detaches. A plugin
that raises is logged and counted (`guard.plugin_errors`); training goes on. Plugins read
per-MPU state from `guard.mpus` (see `mscale.hook.mpu.Mpu`) and change it only through the
guard: `rebind`, `cmsa.raise_threshold`, `request_skip`, `emit`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mscale.findings import Finding
    from mscale.hook.guard import Guard, ModelInputs
    from mscale.hook.mpu import Mpu

HOOKS: tuple[str, ...] = ("on_attach", "on_step_begin", "on_mpu_output", "on_finding",
                          "on_step_end", "on_command", "on_detach")


class Plugin(Protocol):
    """Documentation of the optional methods; plugins need not subclass or implement all."""

    def on_attach(self, guard: "Guard") -> None: ...

    def on_step_begin(self, step: int, batch: "ModelInputs") -> None: ...

    def on_mpu_output(self, mpu: "Mpu", inputs: "ModelInputs", output: Any) -> Any: ...

    def on_finding(self, finding: "Finding") -> None: ...

    def on_step_end(self, step: int, loss: float | None) -> None: ...

    def on_command(self, command: dict) -> dict | None: ...

    def on_detach(self, guard: "Guard") -> None: ...
