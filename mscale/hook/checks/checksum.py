"""Tensor checksums on MPU outputs, in-process, within a budget: ABFT on a rotating share of
the linear layers, replay of whole MPU forwards, full coverage for an MPU under suspicion.

ABFT (algorithm-based fault tolerance, Huang & Abraham 1984) for y = x W^T + b with x of
shape (N, in): the sum of all outputs is predictable from the input's column sums and the
weight's column sums, without the GEMM:

    sum(y) = sum_n x_n . c(W) + N * sum(b)          c(W)_k = sum_o W_ok
    |sum(y) - prediction| <= rtol[dtype] * S        S = sum_n |x_n| . c(|W|) + N * sum|b|

S bounds every product term of the GEMM, so the tolerance scales with the rounding the GEMM
itself can make. Cost per checked linear and step: one pass over x (a GEMV for its column
sums), one over y, one over W for c(W) (a trained weight changes every step; a frozen one is
cached); c(|W|) only sizes the tolerance and is refreshed every 16 steps. On CPU, S itself
(another pass over x) is computed only when the residual exceeds rtol times its lower bound
|sum_n x_n| . c(|W|): the same decision, paid for only by a fault or cancelling inputs.
The check sums run in float32 (float64 for float64 layers), with autocast off. rtol per output
dtype (`DEFAULT_RTOL`): float32 2e-6, float16 2e-3, float64 1e-12; float32 on CUDA while TF32
matmuls are allowed at least `TF32_RTOL` (2e-3, see there). A bfloat16 output's tolerance comes
from its own rounding instead (mscale.hook.checks.rounding: +-1-weighted sums, `rounding_sigmas` x
2^-7/sqrt(12) x ||y||_2), which finds noise of the output's own size where rtol x S cannot.

Which layers, which steps (mscale.hook.checks.coverage, mscale.hook.checks.budget): the guard measures what
the checks cost against the step they ride on and checks, each step, as many layers of each MPU
as `budget` (default 0.01, the share of step time) allows, never fewer than keep every layer
checked at least once every `max_gap_steps` (default 8), in rotation; replays rotate across the
MPUs, paid from what the budget leaves, at least once in `replay_max_gap_steps` (400) each.
`full=True` checks every layer every step (the old default).

Escalation (`suspect`): a failed check, a loss or gradient anomaly, an agent's GPU finding on
the MPU's GPU, a replica mismatch or a shift of its output's scale (mscale.hook.checks.outstats, every
step) put the MPU in incident mode for `incident_steps` (16):
every layer checked and its forward replayed, every step. Since every failure opens an
incident, the clean steps that follow a failure include a replay: a fault only replay sees (one
outside any linear layer, at a tower's output) is not cleared by clean ABFT passes.

Counting is per optimizer step: the checks of all forwards of a step (gradient accumulation)
make one verdict per MPU at the step's commit point (`commit`, from the optimizer step
pre-hook); healing.checksum_failures_l1 (3) failed checked steps in a row emit CHECKSUM_L1_TRIGGER. The
recomputation of a checkpointed forward (inside backward) is not checked again. A non-finite
MPU output is always a failure. Nothing here raises into training: results are findings
passed to `emit`.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import structlog
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mscale.findings import Finding, Reason, Severity
from mscale.hook.checks import abft, outstats, rounding
from mscale.hook.checks.budget import Budget
from mscale.hook.checks.checksum_config import (  # noqa: F401  (re-exported: the config's public home)
    DEFAULT_RTOL,
    TF32_RTOL,
    VERDICTS,
    ChecksumConfig,
)
from mscale.hook.checks.coverage import Schedule
from mscale.hook.checks.linears import LinearKind, kind_of
from mscale.hook.checks.replay import Saved, compare, fresh_copies, rng_get, run_again, runs_collectives
from mscale.hook.checks.weight_sums import WeightSums
from mscale.hook.core.commit import CommitPoint, on
from mscale.hook.core.mpu import Mpu
from mscale.hook.core.outputs import ModelInputs, output_tensors
from mscale.hook.integrations.compiled import GraphChecks, compiling

SOURCE = "checksum"
log = structlog.get_logger("mscale.hook")
_Row = abft.Row  # one check: (method, layer, dtype, value)


def _distilling(mpu: Mpu) -> bool:
    """At L3 the distillation trains through the MPU's failing output, as in-step verdicts do:
    at the commit point only a non-finite output fails its step (mscale.healing.progress)."""
    return getattr(mpu, "fuse_level", "") == "l3_distilling"


def _fails_step(mpu: Mpu, row: _Row) -> bool:
    """Whether a failed row fails the MPU's step at the commit point (see _distilling)."""
    return row[0] == "nonfinite" or not _distilling(mpu)


class _MpuChecks:
    """One MPU's checks in the step in progress."""

    __slots__ = ("layer_names", "forwards", "pending", "rows", "failures", "ran", "unresolved", "replay")

    def __init__(self, layer_names: dict[int, str]) -> None:
        self.layer_names = layer_names
        self.forwards = 0
        self.pending: list[_Row] = []  # this forward's checks (in_step verdicts)
        self.rows: list[_Row] = []  # the step's checks, read at the commit point (commit verdicts)
        self.failures: list[abft.Failure] = []  # (reason, method, detail, layer) this step
        self.ran: set[str] = set()  # the methods run this step
        self.unresolved = False  # a forward failed and was not re-run clean since
        self.replay: Saved | None = None  # (rng state, fresh cache copies) for this step's replay

    def reset(self) -> None:
        self.forwards, self.pending, self.rows, self.failures = 0, [], [], []
        self.ran, self.unresolved, self.replay = set(), False, None


class ChecksumDetector:
    """Owned by the Guard; `attach(mpu)` registers the ABFT hooks of the MPU's linears. The Guard
    calls `begin_step` at each step's begin, `before_forward`/`after_forward` around each MPU
    forward, `commit` at the optimizer step and `end_step` at the step's end."""

    def __init__(
        self,
        config: ChecksumConfig,
        *,
        emit: Callable[[Finding], None],
        step: Callable[[], int],
        budget: Budget,
        l1: int,
    ) -> None:
        self.config, self.l1 = config, l1  # l1: healing.checksum_failures_l1 (checksum_config.one_l1)
        self.budget = budget
        self._emit = emit
        self._step = step
        share, gap = config.replays()
        self.schedule = Schedule(
            max_gap_steps=1 if config.full else config.max_gap_steps,
            replay_share=share,
            replay_max_gap_steps=gap,
            incident_steps=config.incident_steps,
            unseen_cost=config.unseen_cost,
        )
        # the checks of MPU forwards traced by torch.compile (mscale.hook.integrations.compiled)
        self.graph = GraphChecks(stride=1 if config.full else config.max_gap_steps, rtol=config.tolerance)
        self._graph_mpus: set[str] = set()  # MPUs whose forwards ran in a compiled graph
        self._mpus: dict[int, _MpuChecks] = {}
        self._by_id: dict[str, Mpu] = {}
        self._handles: list[RemovableHandle] = []
        self.wsums = WeightSums()
        # the bf16 check's signs; float32's rtol for its float32 arithmetic (no TF32 in a bf16 GEMM)
        rounding_cfg = abft.RoundingSettings(sigmas=config.rounding_sigmas, rtol32=config.tolerance(torch.float32))
        self._check = abft.LayerCheck(self.wsums, rounding.Signs(), rounding_cfg, config.tolerance)
        self._planned = -1  # the step planned last
        self._committed = -1  # the step packed last for the commit point
        self._judged = -1  # the step judged last
        self._packed: list[Mpu] = []  # the MPUs whose rows went into the step's commit point
        self.replaying = False
        self.readbacks = 0  # host reads of check results (tests count them per step)
        # seconds spent in ABFT (linear hooks + evaluation) and in replays; the Guard resets
        # them each step (benchmarks/hook_overhead.py reads them)
        self.abft_s = 0.0
        self.replay_s = 0.0
        self._idle_s = 0.0  # this step's time in the hooks of layers not checked (charged at its end)
        # each MPU output's scale against its own baseline: faults outside the linears (mscale.hook.checks.outstats)
        self.stats = outstats.OutputStats(
            emit=emit, suspect=self.suspect, labels=self._labels, enabled=config.output_stats
        )

    def attach(self, mpu: Mpu) -> None:
        linears = [(n or "<self>", m, k) for n, m in mpu.module.named_modules() if (k := kind_of(m)) is not None]
        self._mpus[id(mpu)] = _MpuChecks({id(m): n for n, m, _ in linears})
        self._by_id[mpu.mpu_id] = mpu
        # layers join the rotation when first seen running
        self.schedule.add(mpu.mpu_id, [], replayable=not runs_collectives(mpu.module))
        self.stats.attach(mpu)
        self.graph.attach(mpu, linears)
        if not self.config.abft:
            return
        # Every checkable layer keeps its one hook, checked this step or not, eager or traced:
        # hooks registered later (a fault injector's, a user's, with prepend) keep their order
        # around it. A layer not planned costs the hook's dispatch and an early return.
        for _, m, kind in linears:
            self._handles.append(m.register_forward_hook(functools.partial(self._linear, mpu, kind), prepend=True))

    def traced_output(self, mpu: Mpu, outs: list[torch.Tensor]) -> None:
        """An MPU's output in a compiled graph: its non-finite check and its statistics, as tensor ops."""
        self.graph.output(mpu, outs)
        self.stats.traced(mpu, outs)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.graph.detach()
        self.wsums.clear()

    def forget(self, mpu: Mpu) -> None:
        """Drop cached weight sums (the MPU moved device); its outputs' baselines start again."""
        self.wsums.clear()
        self.stats.forget(mpu)

    def commit_mode(self, mpu: Mpu) -> bool:
        v = self.config.verdicts
        if mpu.mpu_id in self._graph_mpus:  # a compiled forward reads nothing back: commit verdicts
            return True
        return v == "commit" or (v == "auto" and mpu.device.type != "cpu")

    # --- suspicion -------------------------------------------------------------------

    def suspect(self, mpu_id: str, why: str) -> None:
        """Incident mode for the MPU (full coverage and replay for `incident_steps` steps), from
        this step when it is not planned yet, else from the next."""
        step = self._step()
        start = step + 1 if self._planned == step else step
        self.schedule.suspect(mpu_id, start, why)

    # --- per step --------------------------------------------------------------------

    def begin_step(self) -> None:
        step = self._step()
        b, budget_s = self.budget, self.budget.share * (self.budget.step_s or 0.0)
        # the replays' spare: the budget less the guard's other work (layers bought beyond the floors give way)
        spare = budget_s - sum(c for w, c in b.cost_s.items() if w != "replay") + self.schedule.bought_s
        self.schedule.plan(step, b.allowance_s(SOURCE), budget_s, spare)
        self._planned = step
        self._committed = self._judged = -1  # a step re-run after a rollback commits again
        for st in self._mpus.values():
            st.reset()
        self.stats.begin_step()
        self.graph.begin_step(step, {mid: r.in_incident(step) for mid, r in self.schedule.mpus.items()})

    def before_forward(self, mpu: Mpu, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        st = self._mpus[id(mpu)]
        if self._planned != self._step():
            self.begin_step()  # a forward outside the guard's steps (no optimizer, eval loops)
        st.forwards += 1
        st.pending = []
        if st.forwards == 1 and mpu.mpu_id in self.schedule.replays:
            st.replay = (rng_get(mpu.device), fresh_copies(args, kwargs))

    def _linear(self, mpu: Mpu, kind: LinearKind, module: nn.Module, args: tuple[object, ...], out: object) -> None:
        if compiling():  # a compiled forward: the in-graph check (mscale.hook.integrations.compiled)
            self.graph.linear(mpu.mpu_id, kind, module, args, out)
            return
        t0 = time.perf_counter()
        rot = self.schedule.mpus[mpu.mpu_id]
        if id(module) not in rot.planned and id(module) in rot.seen:
            # not checked this step: the cheapest way out (most calls); its time is still the
            # checks' (charged at the step's end: a charge per call would cost more than it)
            self._idle_s += time.perf_counter() - t0
            return
        y = kind.output_of(out)
        on_cpu = y is None or y.device.type == "cpu"
        # the whole hook is the check's cost (host); on a device its kernels are timed by CUDA
        # events and the host's launches go to "guard"
        mark = self.budget.enter(SOURCE if on_cpu else "guard")
        try:
            x = args[0] if args else None
            if self.replaying or not isinstance(x, torch.Tensor) or y is None:
                return
            if torch._C._current_graph_task_id() != -1:
                return  # the recomputation of a checkpointed forward, inside backward: checked once already
            if id(module) not in rot.planned:
                rot.see(id(module), self._step())  # a layer first seen running is checked at once
                rot.planned = rot.planned | {id(module)}
            st = self._mpus.get(id(mpu))
            if st is None:
                return
            if on_cpu:
                with rounding.no_autocast(y.device):
                    self._abft_sums(mpu, st, module, kind, x, y)
            else:
                with self.budget.timer(SOURCE, y.device), rounding.no_autocast(y.device):
                    self._abft_sums(mpu, st, module, kind, x, y)
        finally:
            self.budget.leave(mark)
            self.abft_s += time.perf_counter() - t0

    def _abft_sums(
        self, mpu: Mpu, st: _MpuChecks, module: nn.Module, kind: LinearKind, x: torch.Tensor, out: torch.Tensor
    ) -> None:
        rot = self.schedule.mpus[mpu.mpu_id]
        if id(module) not in rot.sizes:  # what a check of it reads: input, output, weight
            rot.sizes[id(module)] = x.numel() + out.numel() + kind.weight_of(module).numel()
        commit = self.commit_mode(mpu)
        on_device = x.device.type != "cpu" or commit
        value = self._check.row(module, kind, x, out, step=self._step(), on_device=on_device)
        (st.rows if commit else st.pending).append(("abft", st.layer_names.get(id(module), "?"), out.dtype, value))

    def after_forward(self, mpu: Mpu, inputs: ModelInputs, output: object, *, rerun: bool = False) -> bool:
        """This forward's checks: read and judged now (in_step verdicts, findings emitted) or
        kept for the commit point. `rerun`: the forward re-ran a failed one (the fuse's).
        Returns whether the checks read so far passed."""
        t0 = time.perf_counter()
        st = self._mpus[id(mpu)]
        outs = output_tensors(output)
        commit = self.commit_mode(mpu)
        self.schedule.forward_took(mpu.mpu_id, mpu.forward_s)  # its replay's cost, until one is measured
        if self.config.abft and self.schedule.mpus[mpu.mpu_id].planned:
            st.ran.add("abft")
        with torch.no_grad(), self.budget.timer(SOURCE, mpu.device):
            # the non-finite check of the MPU's output: every forward, every MPU; a tensor the
            # output holds twice (a tower's last hidden state among its hidden states) read once
            distinct = list({(t.data_ptr(), t.dtype, t.shape, t.stride()): t for t in outs}.values())
            for t in distinct:
                s = t.detach().sum(dtype=abft.acc_dtype(t.dtype)).to(torch.float64)
                row = ("nonfinite", "<output>", t.dtype, torch.stack((s, torch.full_like(s, math.inf))))
                (st.rows if commit else st.pending).append(row)
        with torch.no_grad(), self.budget.timer(outstats.SOURCE, mpu.device):  # its own cost, not ABFT's
            self.stats.observe(mpu, distinct)
        t1 = time.perf_counter()
        self.abft_s += t1 - t0
        if st.replay is not None:
            saved, st.replay = st.replay, None
            st.ran.add("replay")
            with self.budget.timer("replay", mpu.device):
                self._replay(mpu, st, saved, inputs, outs, commit)
            seconds = time.perf_counter() - t1
            self.replay_s += seconds
            self.schedule.replayed(mpu.mpu_id, seconds)
        if commit:
            return not st.unresolved
        t2 = time.perf_counter()
        failures = self._judge(st.pending)
        st.pending = []
        self.abft_s += time.perf_counter() - t2
        if failures:
            st.unresolved = True
            st.failures.extend(failures)
            self._report(mpu, failures)
        elif rerun:
            st.unresolved = False
        mpu.last_checksum_ok = not st.unresolved
        return not failures

    def _replay(
        self, mpu: Mpu, st: _MpuChecks, saved: Saved, inputs: ModelInputs, outs: list[torch.Tensor], commit: bool
    ) -> None:
        rng, copies = saved
        self.replaying = True
        try:
            again = output_tensors(run_again(mpu.module, mpu.device, rng, inputs, copies))
        finally:
            self.replaying = False
        if commit and len(again) == len(outs) and all(a.shape == b.shape for a, b in zip(outs, again, strict=True)):
            rtol = self.config.replay_rtol
            with torch.no_grad():
                for i, (a, b) in enumerate(zip(outs, again, strict=True)):
                    a64 = a.detach().to(torch.float64)
                    diff = (a64 - b.to(torch.float64)).abs().amax() if a.numel() else a64.new_zeros(())
                    ref = a64.abs().amax() if a.numel() else a64.new_zeros(())
                    st.rows.append(("replay", f"output {i}", a.dtype, torch.stack((diff, ref * rtol + 1e-30))))
            return
        self.readbacks += 1
        detail = compare(outs, again, self.config.replay_rtol)
        if detail:
            (st.rows if commit else st.pending).append(
                ("replay", detail, outs[0].dtype if outs else torch.float32, (math.inf, 0.0))
            )

    def _judge(self, rows: list[_Row]) -> list[abft.Failure]:
        """Read the rows (one read-back for all the tensors among them) and judge them."""
        failures, reads = abft.judge(rows)
        self.readbacks += reads
        return failures

    def pack(self, point: CommitPoint, data_fault: torch.Tensor | None = None) -> None:
        """At the commit point (the optimizer step pre-hook): the rows kept for it go into the
        step's one read (mscale.hook.core.commit), and so do, still on the device, per MPU, whether
        its kept rows failed (`checksum/failed`, one flag per MPU, none of them when the batch
        was not finite: `data_fault`), what the step agreement carries to the other ranks."""
        if self._committed == self._step():
            return
        self._committed, self._packed = self._step(), []
        t0 = time.perf_counter()
        for mpu, traced in self.graph.take():  # the compiled forwards' checks, still on the device
            self._graph_mpus.add(mpu.mpu_id)
            self._mpus[id(mpu)].rows.extend(traced)
        try:
            with self.budget.timer(SOURCE):
                tensors: list[torch.Tensor] = []
                flags: list[bool | torch.Tensor] = []  # per MPU: a kept host row failed, then | its tensors'
                for mpu in self._by_id.values():
                    st = self._mpus[id(mpu)]
                    mine = [r[3] for r in st.rows if isinstance(r[3], torch.Tensor)]
                    counts = [_fails_step(mpu, r) for r in st.rows if isinstance(r[3], torch.Tensor)]
                    flags.append(
                        any(
                            not abft.passes(*r[3])
                            for r in st.rows
                            if not isinstance(r[3], torch.Tensor) and _fails_step(mpu, r)
                        )
                    )
                    self._packed.append(mpu)
                    if mine:
                        rows = torch.stack([t.to(mine[0].device, torch.float64) for t in mine])  # residual, tolerance
                        tensors.append(rows)
                        bad = ~(torch.isfinite(rows[:, 0]) & (rows[:, 0].abs() <= rows[:, 1]))
                        if not all(counts):
                            bad = bad & torch.tensor(counts, device=bad.device)
                        flags[-1] = bad.any() | flags[-1]
                dev = tensors[0].device if tensors else torch.device("cpu")
                if tensors:
                    point.put("checksum", torch.cat([t.to(dev) for t in tensors]))
                failed = torch.stack([on(torch.as_tensor(f), dev) for f in flags])
                if data_fault is not None:  # the batch was not finite (mscale.hook.checks.inputs): no MPU to blame
                    failed = failed * (1.0 - on(data_fault, dev))
                point.put("checksum/failed", failed)
            with self.budget.timer(outstats.SOURCE):
                self.stats.pack(point, self._graph_mpus)
        except Exception:  # a detector bug must not stop training
            log.exception("checksum_error", where="commit")
            self._packed = []
        self.abft_s += time.perf_counter() - t0

    def judge(self, point: CommitPoint, *, data_fault: bool = False) -> list[str]:
        """After the read: the kept rows judged from their values, findings emitted, every MPU's
        step counted. Returns the ids of the MPUs judged here (commit verdicts) whose step
        failed: the guard drops its update and, with the fuse, re-runs the step (once per
        step; [] after)."""
        packed, self._packed = self._packed, []
        if not packed and self._judged == self._committed:
            return []
        self._judged = self._committed
        t0 = time.perf_counter()
        try:
            self.stats.judge(point, self._committed, skip=data_fault)
            values = point.get("checksum") or []
            self.readbacks += 1 if values else 0
            off = 0
            for mpu in packed:  # the kept tensors' values, in the order they were packed
                st = self._mpus[id(mpu)]
                rows: list[_Row] = []
                for method, layer, dtype, v in st.rows:
                    if isinstance(v, torch.Tensor):
                        v, off = (values[off], values[off + 1]), off + 2
                    rows.append((method, layer, dtype, v))
                st.rows = [] if data_fault else rows
            bad = []
            for mpu in self._by_id.values():
                st = self._mpus[id(mpu)]
                mine = self._judge(st.rows) if st.rows else []
                if mine:
                    st.unresolved = True
                    st.failures.extend(mine)
                    self._report(mpu, mine)
                st.rows = []
                mpu.last_checksum_ok = not st.unresolved
                self._record(mpu, st)
                nonfinite = any(r is Reason.NONFINITE_OUTPUT for r, *_ in st.failures)
                if st.unresolved and self.commit_mode(mpu) and (nonfinite or not _distilling(mpu)):
                    bad.append(mpu.mpu_id)
            return bad
        except Exception:  # a detector bug must not stop training
            log.exception("checksum_error", where="commit")
            return []
        finally:
            self.abft_s += time.perf_counter() - t0

    def end_step(self, *, guard_s: float = 0.0) -> None:
        """At the step's end: the guard's own seconds (`guard_s`) charged, the budget's step
        closed, the measured cost per element checked taken for the next plans."""
        self.budget.charge("guard", guard_s)
        self.budget.charge(SOURCE, self._idle_s)  # the hooks of the layers not checked
        self.abft_s += self._idle_s
        self._idle_s = 0.0
        self.budget.step_ended()
        self.schedule.measured(self.budget.last_spent_s.get(SOURCE, 0.0))
        for mpu in self._by_id.values():
            self.schedule.mpus[mpu.mpu_id].mark_checked(self._step())

    def figures(self) -> dict[str, dict[str, float]]:
        """Per MPU id: coverage ratio, achieved max gap (steps), incident (0/1), replayed (0/1)."""
        figures = self.schedule.figures(self._step())
        for mid in self._graph_mpus & set(figures):  # compiled: every layer, a sample of its rows
            stride = self.graph.stride_of(mid)
            figures[mid].update(coverage_ratio=1.0 / stride, max_gap_steps=float(stride))
        return figures

    # --- counting --------------------------------------------------------------------

    def _report(self, mpu: Mpu, failures: list[abft.Failure]) -> None:
        for reason, method, detail, layer in failures:
            sev = Severity.CRITICAL if reason is Reason.NONFINITE_OUTPUT else Severity.WARNING
            blame = {**self._labels(mpu), "layer": abft.layer_path(mpu.path, layer), "method": method}  # "": its output
            self._emit(Finding(SOURCE, reason, sev, f"{mpu.name}: {detail}", blame))
        self.suspect(mpu.mpu_id, f"{failures[0][1]} check failed")

    def _labels(self, mpu: Mpu) -> dict[str, str]:
        uuid = {"gpu_uuid": mpu.gpu_uuid} if mpu.gpu_uuid else {}
        layer = abft.layer_path(mpu.path, "")
        return {"mpu_id": mpu.mpu_id, "mpu": mpu.name, "gpu": str(mpu.gpu), "layer": layer, **uuid}

    def _record(self, mpu: Mpu, st: _MpuChecks) -> None:
        """Count one optimizer step of the MPU: checked (it always is: the non-finite check),
        failed or not; the L1 trigger at every `l1` (healing.checksum_failures_l1) failed steps in a row."""
        mpu.checksum_checks_total += 1
        if not st.failures:
            mpu.consecutive_failures = 0
            return
        mpu.consecutive_failures += 1
        mpu.checksum_failures_total += 1
        if mpu.consecutive_failures % self.l1 == 0:
            why = f"{mpu.name}: {mpu.consecutive_failures} consecutive failed checked steps"
            labels = {**self._labels(mpu), "consecutive": str(mpu.consecutive_failures)}
            self._emit(Finding(SOURCE, Reason.CHECKSUM_L1_TRIGGER, Severity.CRITICAL, why, labels))
