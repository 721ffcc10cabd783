"""The Guard: attaches the detectors, CMSA, the plugins and the agent link to a model and
its optimizer, riding on calls the training loop already makes.

    guard = mscale.attach(model, optimizer, job_id="run-42")
    ...                                  # the loop is unchanged: forward, backward,
    optimizer.step()                     # optimizer.step() (or guard.step(loss))

Hooks: a forward pre-hook on the model begins a step (first training-mode forward after the
previous optimizer step), forward hooks on each MPU time it and run the checksums, tensor
hooks time its backward, and optimizer step pre/post hooks run the gradient statistics,
CMSA and the end of the step. With a `torch.amp.GradScaler` (`scaler=` or `watch_scaler`) the
step ends at `scaler.update()` instead, once the loop has called it (a loop that never does keeps
ending at the optimizer step): the scaler skips `optimizer.step()` when it finds inf/NaN
gradients, and without it a NaN step would never end (no rollback, no report). Nothing here
raises into the training loop: detectors make findings, plugin errors are logged and counted.
A non-finite loss or gradient never reaches the weights: that step's update is dropped.
`attach(..., snapshots=...)` adds the fuse and snapshots with rollback (mscale.hook.core.protect).
`attach(..., enabled=False)` (or the environment variable MSCALE_GUARD=0) returns a `NullGuard`
and leaves model and optimizer untouched.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import structlog
import torch
from torch import nn

import mscale.hook.core.mpu as mpumod
import mscale.hook.fuse.placement as placement
from mscale import link as protocol
from mscale.findings import Finding, Severity
from mscale.hook.checks.budget import Budget, StepTimes
from mscale.hook.checks.checksum import ChecksumConfig, ChecksumDetector
from mscale.hook.checks.checksum_config import one_l1
from mscale.hook.checks.cmsa import Cmsa, CmsaConfig, GradStatistics
from mscale.hook.checks.coverage import suspicions
from mscale.hook.checks.inputs import InputCheck
from mscale.hook.checks.loss import LossConfig, LossDetector
from mscale.hook.checks.stepstats import StepStatistics
from mscale.hook.core.commit import CommitPoint, commit
from mscale.hook.core.mpu import Mpu
from mscale.hook.core.outputs import ModelInputs, loss_of, output_tensors
from mscale.hook.core.plugin import PluginHooks
from mscale.hook.core.ranks import identify
from mscale.hook.core.report import step_report
from mscale.hook.core.scaler import ScalerWatch
from mscale.hook.core.stepstate import StepFigures, StepState
from mscale.hook.integrations.compiled import compiling, unwrap

if TYPE_CHECKING:
    from mscale.healing.settings import HealingSection
    from mscale.hook.core.link import LinkClient
    from mscale.hook.fuse.fuse import FusePlugin
    from mscale.snapshot.engine import SnapshotEngine

log = structlog.get_logger("mscale.hook")


class Guard:
    """Watches one model + optimizer. Public, stable surface for plugins:

    - `job_id`, `rank`, `model` (a torch.compile wrapper's inner model), `outer` (what the loop
      calls), `optimizer`, `mpus` (list of `Mpu`), `mpu(key)` by id or name
    - `current_step` (the step in progress, or the next one), `set_step(n)` after a restore
    - `checksum` (ChecksumDetector), `loss_detector` (LossDetector), `cmsa` (Cmsa or None)
    - `emit(finding)`, `request_skip(reason)`, `request_rerun(reason)`, `rebind(mpu, gpu, ...)`,
      `send_to_agent(msg)`, `commit_point` (the last step's verdicts, mscale.hook.core.commit)
    - `step_state` (StepState: the step in progress), `figures` (StepFigures: the last step's,
      or None), `summary()` (them as a dict)
    - `add_plugin(p)`, `plugins`, `plugin_errors`, `findings` (recent), `link` (or None)
    - `watch_scaler(scaler)`: end steps at the GradScaler's update (see the module docstring)
    - `fuse`, `snapshots`: the fuse plugin and SnapshotEngine `attach(snapshots=...)` added, or None
    """

    enabled = True
    fuse: FusePlugin | None = None
    snapshots: SnapshotEngine | None = None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        job_id: str,
        rank: int | None = None,
        mpus: Mapping[str, nn.Module | str] | None = None,
        gpus: Mapping[str, int] | None = None,
        checksum: ChecksumConfig | None = None,
        loss: LossConfig | None = None,
        cmsa: CmsaConfig | bool | None = True,
        plugins: Iterable[object] = (),
        socket_path: str | None = None,
        connect: bool = True,
        report_queue: int = 256,
        scaler: torch.amp.GradScaler | None = None,
        healing: HealingSection | None = None,
    ) -> None:
        if not isinstance(job_id, str) or not job_id:
            raise ValueError("job_id: expected a non-empty string naming the training job")
        self.job_id, (self.rank, self.local_rank, self.world_size) = job_id, identify(rank)
        # a torch.compile(model) wrapper: the guard holds the model it compiles; OptimizedModule
        # calls that model's own hooks outside the graph (mscale.hook.integrations.compiled)
        self._outer, model = model, unwrap(model)
        self.model, self.optimizer = model, optimizer
        self.mpus: list[Mpu] = mpumod.discover(model, mpus, gpus)
        self.log = log.bind(job_id=job_id, rank=self.rank)
        self.log.info("mpus_found", mpus=[f"{m.mpu_id}={m.name}@{m.path or '<root>'} gpu={m.gpu}" for m in self.mpus])
        self.current_step = 0
        self.hooks = PluginHooks(self, self.log)  # the plugins and their dispatch
        self.plugins: list[object] = self.hooks.plugins  # in the order they were added (one list, never rebound)
        self.findings: collections.deque[Finding] = collections.deque(maxlen=1000)
        self.times = StepTimes()
        self.healing = one_l1(checksum, healing)  # its checksum_failures_l1: the detector's and the fuse's L1
        self._detectors(checksum or ChecksumConfig(), loss or LossConfig(), CmsaConfig() if cmsa is True else cmsa)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._commands: collections.deque[protocol.Wire] = collections.deque(maxlen=1024)
        self.inputs = InputCheck(self.emit, self.step_state.losses)  # the batch checked before the first MPU
        self.commit_point: CommitPoint | None = None  # the last step's (mscale.hook.core.commit)
        self.figures: StepFigures | None = None  # the last step's (summary())
        self._mpu_by_module = {id(m.module): m for m in self.mpus}
        self._gpu_uuids = {m.gpu: m.gpu_uuid for m in self.mpus if m.gpu_uuid}  # index -> uuid seen
        self.scaler_watch = ScalerWatch(self._scaler_update)  # a watched GradScaler: steps end at its update()
        self._install()
        if scaler is not None:
            self.watch_scaler(scaler)
        self.link = self._connect(socket_path, report_queue) if connect else None
        for p in plugins:
            self.add_plugin(p)

    def _detectors(self, checksum: ChecksumConfig, loss: LossConfig, cmsa: CmsaConfig | None | bool) -> None:
        """The detectors, the step state and the step's statistics over them."""
        # the share of step time the detectors may take
        self.budget = Budget(checksum.budget, headroom=checksum.headroom)
        l1, step = self.healing.checksum_failures_l1, lambda: self.current_step
        self.checksum = ChecksumDetector(checksum, emit=self.emit, step=step, budget=self.budget, l1=l1)
        self.loss_detector = LossDetector(loss)
        self.cmsa: Cmsa | None = Cmsa(self.mpus, cmsa) if isinstance(cmsa, CmsaConfig) else None
        self.step_state = StepState()
        self._grad_stats = GradStatistics()
        self.statistics = StepStatistics(
            mpus=self.mpus,
            optimizer=self.optimizer,
            model=self.model,
            cmsa=self.cmsa,
            loss_detector=self.loss_detector,
            grad_stats=self._grad_stats,
            times=self.times,
            state=self.step_state,
            emit=self.emit,
            log=self.log,
        )

    def _connect(self, socket_path: str | None, queue_max: int) -> LinkClient:
        """The link to the node's agent, started (it connects, and reconnects, on its own thread)."""
        from mscale.hook.core.link import LinkClient

        path = protocol.socket_path(socket_path)
        link = LinkClient(path, registration=self.registration, on_command=self._commands.append, queue_max=queue_max)
        link.start()
        return link

    # --- public surface --------------------------------------------------------------

    @property
    def outer(self) -> nn.Module:
        """The module the loop calls: the model, or the torch.compile wrapper given to attach.
        Hooks that must run outside a compiled graph go there (see `_install`)."""
        return self._outer

    @property
    def plugin_errors(self) -> int:  # plugin calls that raised (logged, counted, never passed on)
        return self.hooks.errors

    def add_plugin(self, plugin: object) -> None:
        self.hooks.add(plugin)

    def remove_plugin(self, plugin: object) -> None:
        self.hooks.remove(plugin)

    def watch_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """End each step at `scaler.update()` once the loop calls it (mscale.hook.core.scaler)."""
        self.scaler_watch.watch(scaler)

    def mpu(self, key: str) -> Mpu:
        return mpumod.by_key(self.mpus, key)

    def set_step(self, step: int) -> None:
        """The step to run next (a restored snapshot continues at its step + 1)."""
        self.current_step = int(step)
        self.step_state.step_set = True

    def emit(self, finding: Finding) -> None:
        """Record a finding: log it, tell the plugins, send it to the agent with the step's report."""
        labels = {"job_id": self.job_id, "step": str(self.current_step), **finding.labels}
        if "mpu_id" in labels and "gpu" not in labels:
            try:
                labels["gpu"] = str(self.mpu(labels["mpu_id"]).gpu)
            except KeyError:
                pass
        finding = Finding(finding.source, finding.reason, finding.severity, finding.message, labels, finding.time)
        self.findings.append(finding)
        self.step_state.findings.append(finding)
        for mpu_id, why in suspicions(finding, self.mpus):  # incident mode: full coverage, replay
            self.checksum.suspect(mpu_id, why)
        method = {Severity.CRITICAL: "error", Severity.WARNING: "warning"}.get(finding.severity, "info")
        getattr(self.log, method)(finding.reason.value, source=finding.source, message=finding.message, labels=labels)
        self.hooks.dispatch("on_finding", finding)

    def request_skip(self, reason: str) -> None:
        """Make this step's optimizer update a no-op (its gradients are dropped). For plugins
        reacting to a finding before the optimizer step."""
        self.step_state.skip_reason = reason or "requested"

    def request_rerun(self, reason: str) -> None:
        """Drop this step's update and, with the fuse (`snapshots=`), re-run the step on the same
        batch: the fuse's rollback that keeps the batch (FusePlugin.rerun_step), after the
        agreement, on every rank alike. Without the fuse the update is only dropped."""
        state = self.step_state
        self.request_skip(state.skip_reason or reason)
        state.rerun_reason = state.rerun_reason or reason or "requested"

    def rebind(
        self, mpu: Mpu | str, gpu: int, *, gpu_uuid: str | None = None, device: torch.device | str | None = None
    ) -> Mpu:
        """Bind an MPU to another GPU index and, given `device`, move it there with its optimizer
        state behind a device-boundary adapter (mscale.hook.fuse.placement.place). `gpu_uuid`: the
        given one, else the new GPU's (mpu.uuid_of: CUDA's, or one this job saw for that index).
        On CPU only the simulated binding changes; the agent is told at once."""
        m = mpu if isinstance(mpu, Mpu) else self.mpu(mpu)
        m.forget()
        if device is not None:
            placement.place(m.module, self.optimizer, device)
        old, seen = m.gpu, {o.gpu: o.gpu_uuid for o in self.mpus if o.gpu_uuid}
        on_cuda = m.device.type == "cuda"
        m.gpu, m.gpu_uuid = int(gpu), mpumod.uuid_of(int(gpu), gpu_uuid, seen | self._gpu_uuids, cuda=on_cuda)
        self._gpu_uuids.update({m.gpu: m.gpu_uuid} if m.gpu_uuid else {})
        self.checksum.forget(m)
        self.log.info("mpu_rebound", mpu_id=m.mpu_id, mpu=m.name, gpu_from=old, gpu=m.gpu, device=str(m.device))
        if self.link is not None:
            self.link.update_registration()
        return m

    def send_to_agent(self, message: protocol.Wire) -> bool:
        """Queue a message (a dict with "type") for the agent; False without a link."""
        if self.link is not None:
            self.link.send(message)
        return self.link is not None

    def registration(self) -> protocol.Register:
        return protocol.Register(
            job_id=self.job_id,
            rank=self.rank,
            pid=os.getpid(),
            step=self.current_step,
            mpus=tuple(m.describe() for m in self.mpus),
            local_rank=self.local_rank,
            world_size=self.world_size,
            pod=protocol.Pod.from_env(),
        )

    def observe(self, loss: torch.Tensor | float) -> None:
        """Tell the guard the step's loss (when the model's output carries none)."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        self.step_state.losses.append(loss)

    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """`optimizer.step()` with the loss given: the three-line alternative to auto-capture."""
        if loss is not None:
            self.step_state.losses.clear()
            self.observe(loss)
        if self.optimizer is None:
            self._pre_step()
            self._end_step()
        else:
            self.optimizer.step()

    def poll_commands(self) -> int:
        """Dispatch the agent's queued commands now (the guard does it at step boundaries)."""
        n = 0
        while self.link is not None and self.link.findings:  # the link's own (agent_untrusted)
            self.emit(self.link.findings.popleft())
        while self._commands:
            command = self._commands.popleft()
            n += 1
            if command.get("type") == protocol.Command.PING:
                self.send_to_agent(protocol.Pong(command.get("id")).to_wire())
                continue
            for mpu_id, why in suspicions(command, self.mpus):
                self.checksum.suspect(mpu_id, why)  # the agent's GPU finding on an MPU's GPU
            for p in list(self.plugins):
                reply = self.hooks.call(p, "on_command", command)
                if isinstance(reply, dict) and self.link is not None:
                    self.link.send(protocol.Reply(command.get("id"), reply).to_wire())
        return n

    def detach(self) -> None:
        """Remove every hook and stop the link: the model and optimizer are as before."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.scaler_watch.unwatch()
        self.checksum.detach()
        self.hooks.dispatch("on_detach", self)
        if self.link is not None:
            self.link.stop()
            self.link = None

    def summary(self) -> dict[str, object]:
        """The last step's figures (what the report carries)."""
        return self.figures.summary() if self.figures is not None else {}

    # --- hooks -----------------------------------------------------------------------

    def _install(self) -> None:
        # The step's begin and the loss capture are Python bookkeeping, never traced: on a
        # torch.compile wrapper given to attach they sit on the wrapper, which runs them before
        # entering the graph; on a model compiled after attach dynamo would trace them, so they
        # are disabled for it (a graph break at the model's entry and exit, none inside).
        entry, outer = self.budget.entry, self._outer  # each entry point's host time charged whole
        pre, post = torch._dynamo.disable(entry(self._model_pre)), torch._dynamo.disable(entry(self._model_post))
        self._handles.append(outer.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(outer.register_forward_hook(post))
        for m in self.mpus:
            self._handles.append(m.module.register_forward_pre_hook(entry(self._mpu_pre), with_kwargs=True))
            self._handles.append(m.module.register_forward_hook(entry(self._mpu_post), with_kwargs=True))
            # the MPU's backward ends when its first parameter (in module order: the one its
            # forward uses first, so the last its backward reaches) has its gradient; one hook
            # per MPU, not one per parameter (a Python call from the autograd engine each)
            first = next(iter(m.parameters()), None)
            if first is not None:
                self._handles.append(
                    first.register_post_accumulate_grad_hook(entry(lambda _p, m=m: m._mark_backward_end()))
                )
            self.checksum.attach(m)
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(entry(lambda opt, a, k: self._pre_step())))
            self._handles.append(self.optimizer.register_step_post_hook(entry(lambda opt, a, k: self._post_step())))

    def _model_pre(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if self.model.training and not self.checksum.replaying:  # (the model the wrapper compiles)
            if not self.step_state.in_step:
                self._begin_step(ModelInputs(args, kwargs))
            self.inputs.begin(args, kwargs)

    def _model_post(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if self.checksum.replaying or not self.model.training:
            return
        loss = loss_of(output)
        if loss is not None:
            self.step_state.losses.append(loss.detach())

    def _begin_step(self, batch: ModelInputs) -> None:
        self.budget.step_began()  # the step the budget is a share of starts here
        self.poll_commands()  # between steps: plugins may rebind or restore before this one
        self.step_state.begin()  # (findings made between steps stay queued)
        self.times.reset()
        self.checksum.abft_s = self.checksum.replay_s = 0.0
        for m in self.mpus:
            m._reset_step()
        self.checksum.begin_step()  # this step's checks, within the budget
        self.hooks.dispatch("on_step_begin", self.current_step, batch)

    def _mpu_pre(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if compiling() or self.checksum.replaying:
            return  # traced: no timers, no replay (mscale.hook.integrations.compiled)
        m = self._mpu_by_module[id(module)]
        m._fwd_start = time.perf_counter()
        self.checksum.before_forward(m, args, kwargs)

    def _mpu_post(
        self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], output: object
    ) -> object:
        if compiling():  # traced: the output's non-finite check and statistic, as tensor ops
            self.checksum.traced_output(self._mpu_by_module[id(module)], output_tensors(output))
            return None
        if self.checksum.replaying:
            return None
        m = self._mpu_by_module[id(module)]
        t0 = time.perf_counter()
        m.forward_s += t0 - (m._fwd_start if m._fwd_start is not None else t0)
        a0, r0 = self.checksum.abft_s, self.checksum.replay_s
        inputs = ModelInputs(args, kwargs)
        try:
            # a NaN from the data blames no MPU (commit verdicts: its flag is read at the commit)
            if self.checksum.commit_mode(m) or not self.inputs.bad():
                rerun = getattr(self.fuse, "_rerunning", None) == m.mpu_id  # the fuse re-runs a failed forward
                self.checksum.after_forward(m, inputs, output, rerun=rerun)
        except Exception as e:  # a detector bug must not stop training
            self.log.exception("checksum_error", mpu_id=m.mpu_id, error=str(e))
        t1 = time.perf_counter()
        self.times.hooks_s += (t1 - t0) - (self.checksum.abft_s - a0) - (self.checksum.replay_s - r0)
        replaced = None
        for p in list(self.plugins):
            r = self.hooks.call(p, "on_mpu_output", m, inputs, output)
            if r is not None:
                replaced = output = r
        self.times.plugins_s += time.perf_counter() - t1
        if torch.is_grad_enabled():
            for t in output_tensors(output):
                if t.requires_grad:
                    t.register_hook(self.budget.entry(lambda g, m=m: m._mark_backward_start()))
        return replaced

    def _pre_step(self) -> None:
        self._commit_checks(plugins=True)  # the one read, the agreement's all-reduce in it
        self.hooks.dispatch("on_step_decide", self.current_step)  # before the statistics: see mscale.hook.core.agree
        state = self.step_state
        if state.rerun_reason and self.fuse is not None:
            try:  # a fault found at the commit point: the step re-run on the same batch
                self.fuse.rerun_step(state.rerun_reason)
            except Exception as e:
                self.log.exception("guard_error", where="rerun", error=str(e))
        self._halt()
        self.figures = self.statistics.measure_safe(self.current_step, "pre_step") or self.figures
        if state.skip_reason and self.optimizer is not None:
            self.log.warning("step_skipped", step=self.current_step, reason=state.skip_reason)
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _post_step(self) -> None:
        if not self.scaler_watch.ends_steps:
            self._end_step()
        else:
            self.scaler_watch.opt_stepped = True  # the step ends at scaler.update(), after the scale is updated

    def _scaler_update(self, stepped: bool) -> None:
        """The watched scaler's update() ran: the step ends (skipped by it unless `stepped`)."""
        if not self.step_state.in_step:
            return
        if not stepped:
            self.figures = self.statistics.scaler_skipped(self.current_step)
        self._end_step()

    def _commit_checks(self, *, plugins: bool = False) -> None:
        """The commit point, once a step (mscale.hook.core.commit.commit: the one read; a failure
        judged there drops the update on every rank and asks for a re-run)."""
        if self.step_state.committed != self.current_step:
            self.step_state.committed = self.current_step
            self.commit_point = commit(self, plugins=plugins)

    def _end_step(self) -> None:
        self._commit_checks()
        self.times.abft_s, self.times.replay_s = self.checksum.abft_s, self.checksum.replay_s
        if self.optimizer is None or self.figures is None or self.figures.step != self.current_step:
            self.figures = self.statistics.measure_safe(self.current_step, "end_step") or self.figures
        state, step = self.step_state, self.current_step
        loss = self.figures.loss if self.figures is not None else None
        state.step_set = False
        t0 = time.perf_counter()
        self.hooks.dispatch("on_step_end", step, loss)
        t1 = time.perf_counter()
        self.times.plugins_s += t1 - t0
        if self.link is not None or any(hasattr(p, "on_report") for p in self.plugins):
            try:  # plugins add their fields (mscale.hook.core.goodput: the step's seconds by cause)
                self.hooks.dispatch("on_report", report := self._report())
                if self.link is not None:
                    self.link.report(report)
            except Exception as e:
                self.log.exception("report_error", error=str(e))
        state.findings = []  # reported (or no link): the next report starts afresh
        self.times.report_s += time.perf_counter() - t1
        self.checksum.end_step()  # (the guard's own work is charged by its entry points: _entry)
        if self.figures is not None:
            self.figures.checksum = self.checksum.figures()
            self.figures.guard_overhead_ratio = self.budget.overhead_ratio
        state.losses.clear()
        state.in_step = False
        if not state.step_set:  # a plugin's rollback in on_step_end sets it
            self.current_step = step + 1
        state.step_set = False
        self.poll_commands()
        self._halt()

    def _halt(self) -> None:
        """The fuse's clean stop (mscale.ProgressBoundExceeded, mscale.healing.progress): raised into
        the loop from the optimizer step, the one exception the guard raises on purpose."""
        stop = getattr(self.fuse, "stopping", None)
        if stop is not None:
            raise stop

    def _report(self) -> protocol.StepReport:
        return step_report(
            step=self.current_step,
            figures=self.figures,
            mpus=self.mpus,
            checksum=self.checksum.figures(),
            cmsa=self.cmsa,
            skipped=bool(self.step_state.skip_reason),
            overhead_ratio=self.budget.overhead_ratio,
            findings=self.step_state.findings,
        )
