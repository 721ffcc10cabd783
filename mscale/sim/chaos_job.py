"""The job's half of chaos: a Guard plugin carrying out `{"type": "chaos", ...}` commands.

    corrupt    {mpu | gpu, mode, steps}   the corruption injector (mscale.sim.inject)
    gpu_fault  {gpu, mode}                what a faulty GPU computes: its MPUs' outputs corrupted
    loss_spike {factor, steps}            the loss multiplied (its gradients with it)
    nan_loss   {steps}                    the loss made NaN
    hang       {seconds}                  the training loop stalls at the next step's start

The demo and tests call `inject(...)` directly; the agent's chaos API sends the commands.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch

from mscale.link import Chaos, Command

log = structlog.get_logger("mscale.chaos")
# chaos modes -> injector kinds (a bit flip in the top exponent bit: the classic SDC)
MODES = {
    "bitflip": "exponent_flip",
    "exponent_flip": "exponent_flip",
    "mantissa_flip": "mantissa_flip",
    "noise": "noise",
    "nan": "nan",
}


class ChaosPlugin:
    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed
        self.guard: Any = None
        self.injectors: list[Any] = []
        self.loss_faults: list[dict] = []  # {"kind", "factor", "left", "steps": [...]}
        self.log: list[dict] = []  # every fault carried out: {"kind", "step", ...}
        self._hang_s = 0.0
        self._handle: Any = None

    def on_attach(self, guard: Any) -> None:
        self.guard = guard
        # prepend: the guard's model hook must see the loss as the chaos made it
        self._handle = guard.model.register_forward_hook(self._model_output, prepend=True)

    def on_detach(self, guard: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
        for inj in self.injectors:
            inj.remove()

    def on_step_begin(self, step: int, batch: Any) -> None:
        if self._hang_s > 0:
            s, self._hang_s = self._hang_s, 0.0
            log.warning("chaos_hang", seconds=s, step=step)
            time.sleep(s)  # the hang itself: what the eBPF probe is there to notice
        for inj in [i for i in self.injectors if i.done]:
            inj.remove()
            self.injectors.remove(inj)

    def on_command(self, command: dict) -> dict | None:
        if command.get("type") != Command.CHAOS:
            return None
        try:
            self.inject(**Chaos.from_wire(command).injection())
        except (ValueError, TypeError) as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True}

    def inject(
        self,
        kind: str,
        *,
        mpu: str | None = None,
        gpu: int | None = None,
        mode: str = "noise",
        steps: int = 1,
        factor: float = 25.0,
        seconds: float = 0.0,
        fault: str = "",
        **_: Any,
    ) -> None:
        from mscale.sim.inject import inject as corrupt

        step = self.guard.current_step
        if kind in ("corrupt", "gpu_fault"):
            if mode not in MODES:
                raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
            # a faulty GPU keeps computing garbage until its MPUs leave it
            n = steps if kind == "corrupt" else 1_000_000
            self.injectors.append(
                corrupt(self.guard, kind=MODES[mode], steps=n, mpu=mpu, gpu=gpu, seed=self.seed + len(self.log))
            )
        elif kind in ("loss_spike", "nan_loss"):
            self.loss_faults.append({"kind": kind, "factor": factor, "left": int(steps), "steps": []})
        elif kind == "hang":
            self._hang_s = float(seconds)
        else:
            raise ValueError(f"kind: unknown chaos kind {kind!r}")
        self.log.append({"kind": kind, "step": step, "mpu": mpu, "gpu": gpu, "mode": mode, "fault": fault})
        log.warning("chaos_injected", kind=kind, step=step, mpu=mpu, gpu=gpu, mode=mode)

    def _model_output(self, module: Any, args: tuple, output: Any) -> Any:
        if not module.training or not self.loss_faults or getattr(self.guard.checksum, "replaying", False):
            return None
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            return None
        fault = self.loss_faults[0]
        step = self.guard.current_step
        if step not in fault["steps"]:
            fault["steps"].append(step)
            fault["left"] -= 1
            if fault["left"] <= 0:
                self.loss_faults.pop(0)
        new = loss * fault["factor"] if fault["kind"] == "loss_spike" else loss * float("nan")
        if type(output) is dict:
            return {**output, "loss": new}
        if isinstance(output, dict):  # transformers' ModelOutput: in place, keeping its type
            output["loss"] = new
            return output
        output.loss = new
        return output
