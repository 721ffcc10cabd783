"""A guarded training run of the tiny multimodal model on CPU, with faults on a schedule.

Shared by the demo, the scenario tests and the heal-latency benchmark, so all three run the
same loop: TinyMultimodal + AdamW, the hook library's Guard, the snapshot engine (in memory,
optionally on disk), the fuse and the chaos plugin. `run(RunConfig(...))` returns what
happened; the same config without faults is the reference run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mscale.findings import Finding
from mscale.healing.settings import HealingSection
from mscale.healing.words import Result
from mscale.hook.checks.checksum import ChecksumConfig

if TYPE_CHECKING:
    from mscale.sim.tinymm import TinyConfig
    from mscale.snapshot.data import ResumableLoader


@dataclass(frozen=True)
class Fault:
    step: int  # injected at the start of this training step (first time it is reached)
    kind: str  # a ChaosPlugin kind: corrupt, gpu_fault, loss_spike, nan_loss, hang
    args: dict = field(default_factory=dict)
    label: str = ""  # what the demo calls it


@dataclass
class RunConfig:
    steps: int = 120
    seed: int = 0
    batch_size: int = 16
    lr: float = 3e-3
    faults: tuple[Fault, ...] = ()
    healing: HealingSection = field(default_factory=lambda: HealingSection(recovery_clean_steps=20, lr_cool_steps=10))
    job_id: str = "tinymm"
    snapshot_dir: str | None = None
    memory_every: int = 5
    disk_every: int = 0
    socket_path: str | None = None  # connect the guard to an agent here
    gpu_count: int = 8
    eval_batches: int = 4
    on_step: Callable[[dict], None] | None = None  # called after every step with its figures
    before_step: Callable[[Any], None] | None = None  # called with the Run before every step
    model_config: Any = None
    # every layer every step: the scripted timeline catches each fault in the step it starts,
    # whatever the machine's timing (the budget's rotation depends on measured costs)
    checksum: ChecksumConfig = field(default_factory=lambda: ChecksumConfig(full=True))
    threads: int = 1  # torch intra-op threads: the tiny model gains nothing from more, and
    # on a shared 2-core machine a second spinning thread makes it 10x slower


@dataclass
class RunResult:
    losses: list[tuple[int, float]]  # (training step, loss) in the order run
    eval_loss: float  # held-out loss of the final weights
    steps: int  # training steps completed
    steps_run: int  # steps executed, counting those redone after a rollback and dropped ones
    wall_s: float
    findings: list[Finding]
    fuse: Any
    chaos: Any
    guard: Any
    snapshots: Any
    health: list[tuple[int, dict]] = field(default_factory=list)  # (step, {mpu name: health})
    levels: list[tuple[int, dict]] = field(default_factory=list)  # (step, {mpu name: fuse state})
    nonfinite_weights: bool = False  # a NaN/Inf ever reached the weights
    lrs: list[tuple[int, float]] = field(default_factory=list)  # (step, LR of its update)
    batches: list[tuple[int, list[int]]] = field(default_factory=list)  # (step, sample indices)
    cpu_s: float = 0.0  # CPU time of the process over the run (steadier than wall on a shared box)

    @property
    def steps_lost(self) -> int:
        return self.steps_run - self.steps

    def events(self, reason: str) -> list[Finding]:
        return [f for f in self.findings if f.reason.value == reason]

    def actions(self, action: str, result: str = Result.APPLIED) -> list[Finding]:
        return [
            f
            for f in self.findings
            if f.reason.value == "heal_action" and f.labels.get("action") == action and f.labels.get("result") == result
        ]


class _Recorder:
    """Keeps every finding of the run (the guard keeps only the recent ones)."""

    def __init__(self, out: list, lrs: list) -> None:
        self.out, self.lrs = out, lrs
        self.guard: Any = None

    def on_attach(self, guard: Any) -> None:
        self.guard = guard

    def on_finding(self, f: Finding) -> None:
        self.out.append(f)

    def on_step_end(self, step: int, loss: Any) -> None:
        # runs before the fuse's step end: the LR the step's update was made with
        self.lrs.append((step, self.guard.optimizer.param_groups[0]["lr"]))


def _data(cfg: RunConfig, mcfg: TinyConfig) -> tuple[ResumableLoader, list[dict]]:
    """The training data (a resumable loader, its position in every snapshot) and the held-out
    batches the final loss is measured on."""
    from mscale.sim.tinymm import SyntheticCaptions
    from mscale.snapshot.data import ResumableLoader

    data = ResumableLoader(SyntheticCaptions(mcfg, size=4096, seed=cfg.seed), batch_size=cfg.batch_size, seed=cfg.seed)
    held = SyntheticCaptions(mcfg, size=cfg.eval_batches * cfg.batch_size, seed=cfg.seed + 7919)
    eval_data = [
        torch.utils.data.default_collate([held[i] for i in range(b * cfg.batch_size, (b + 1) * cfg.batch_size)])
        for b in range(cfg.eval_batches)
    ]
    return data, eval_data


class Run:
    """The objects of one run, built by `setup` (the demo and the benchmark poke at them)."""

    def __init__(self, cfg: RunConfig) -> None:
        from mscale.hook.core.goodput import account
        from mscale.hook.core.guard import Guard
        from mscale.hook.fuse.fuse import FusePlugin
        from mscale.sim.chaos_job import ChaosPlugin
        from mscale.sim.tinymm import TinyConfig, TinyMultimodal
        from mscale.snapshot.config import SnapshotConfig
        from mscale.snapshot.engine import SnapshotEngine

        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        mcfg = cfg.model_config or TinyConfig()
        self.model = TinyMultimodal(mcfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.data, self.eval_data = _data(cfg, mcfg)
        self.guard = Guard(
            self.model,
            self.optimizer,
            job_id=cfg.job_id,
            connect=cfg.socket_path is not None,
            socket_path=cfg.socket_path,
            checksum=cfg.checksum,
            healing=cfg.healing,  # its checksum_failures_l1: the detector's trigger and the fuse's
        )
        g = self.guard
        self.fuse = FusePlugin(config=g.healing, gpu_count=cfg.gpu_count)
        self.snapshots = SnapshotEngine(
            self.model,
            self.optimizer,
            mpus={m.name: (m.mpu_id, m.module) for m in g.mpus},
            data=self.data,
            config=SnapshotConfig(directory=cfg.snapshot_dir, memory_every=cfg.memory_every, disk_every=cfg.disk_every),
            binding=lambda: {m.mpu_id: {"gpu": m.gpu, "gpu_uuid": m.gpu_uuid} for m in g.mpus},
            emit=self.fuse.snapshot_emit,
            job_id=cfg.job_id,
        )
        self.fuse.snapshot_engine = self.snapshots
        self.chaos = ChaosPlugin(seed=cfg.seed)
        self.findings: list[Finding] = []
        self.lrs: list[tuple[int, float]] = []
        self.batches: list[tuple[int, list[int]]] = []  # (step, sample indices) in the order run
        g.add_plugin(_Recorder(self.findings, self.lrs))
        g.add_plugin(self.fuse)
        g.add_plugin(self.chaos)
        self.snapshots.snapshot(step=-1)  # the initial state: a rollback target from the start
        self.goodput = account(g)  # the wall time by cause from here (mscale.hook.core.goodput)
        self.fired: set[int] = set()
        self.losses: list[tuple[int, float]] = []
        self.health: list[tuple[int, dict]] = []
        self.levels: list[tuple[int, dict]] = []
        self.checks: list[tuple[int, dict[str, tuple[int, bool]]]] = []  # (step, {mpu_id: (gpu, checksum ok)})
        self.steps_run = 0
        self.nonfinite_weights = False

    def fire_due(self) -> None:
        step = self.guard.current_step
        for i, f in enumerate(self.cfg.faults):
            if f.step == step and i not in self.fired:
                self.fired.add(i)
                self.chaos.inject(f.kind, **f.args)

    def one_step(self) -> dict:
        g = self.guard
        self.fire_due()
        step = g.current_step
        batch = self.data.next_batch()
        self.batches.append((step, batch["index"].tolist()))
        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(batch["images"], batch["tokens"])
        out["loss"].backward()
        self.optimizer.step()  # the guard's hooks: statistics, CMSA, the plugins' step end
        self.steps_run += 1
        loss = float(out["loss"].detach())
        self.losses.append((step, loss))
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            self.nonfinite_weights = True
        levels = {m.name: m.fuse_level for m in g.mpus}
        self.levels.append((step, levels))
        self.checks.append((step, {m.mpu_id: (m.gpu, m.last_checksum_ok) for m in g.mpus}))
        info = {
            "step": step,
            "next": g.current_step,
            "loss": loss,
            "levels": levels,
            "gpus": {m.name: m.gpu for m in g.mpus},
            "cooling": self.fuse.cooling,
        }
        return info

    def evaluate(self) -> float:
        self.model.eval()
        with torch.no_grad():
            vals = [float(self.model(b["images"], b["tokens"])["loss"]) for b in self.eval_data]
        self.model.train()
        return sum(vals) / len(vals)

    def close(self) -> None:
        try:
            self.snapshots.close(timeout=30)
        finally:
            self.guard.detach()


def run(cfg: RunConfig) -> RunResult:
    r = Run(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        while r.guard.current_step < cfg.steps:
            if cfg.before_step is not None:
                cfg.before_step(r)
            info = r.one_step()
            if cfg.on_step is not None:
                cfg.on_step(info)
            if r.steps_run > cfg.steps * 3:  # a fault loop that never heals: stop, the result says so
                break
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        ev = r.evaluate()
    finally:
        r.close()
    return RunResult(
        r.losses,
        ev,
        r.guard.current_step,
        r.steps_run,
        wall,
        r.findings,
        r.fuse,
        r.chaos,
        r.guard,
        r.snapshots,
        r.health,
        r.levels,
        r.nonfinite_weights,
        r.lrs,
        r.batches,
        cpu,
    )


def relative_gap(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b and math.isfinite(a) and math.isfinite(b) else float("inf")
