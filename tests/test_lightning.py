"""`mscale.lightning.MscaleCallback` under a real `lightning.Trainer` on CPU: a LightningModule
wrapping a tiny Hugging Face LLaVA (built from its config), 2 batches per optimizer step
(`accumulate_grad_batches=2`), `precision="bf16-mixed"`, a step-wise LR scheduler. Faults are the
test's own forward hooks."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402

import mscale  # noqa: E402
from mscale.findings import Reason  # noqa: E402
from mscale.hook.checks.cmsa import CmsaConfig  # noqa: E402
from support.tiny_hf import tiny_llava  # noqa: E402

STEPS, ACCUM = 6, 2
QUIET = {Reason.SNAPSHOT_WRITTEN}


@pytest.fixture(autouse=True)
def quiet_logs():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


class Samples(torch.utils.data.Dataset):
    def __init__(self, make_batch, size: int = 64) -> None:
        self.items = []
        for i in range(size // 4):
            b = make_batch(i, torch.Generator().manual_seed(i))
            self.items += [{k: v[j] for k, v in b.items()} for j in range(4)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class Captioner(L.LightningModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        return self(**batch).loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Watch:
    """A guard plugin: findings, step ends."""

    def __init__(self) -> None:
        self.findings, self.ends = [], []

    def on_finding(self, f) -> None:
        self.findings.append(f)

    def on_step_end(self, step, loss) -> None:
        self.ends.append(step)

    def reasons(self) -> set:
        return {f.reason for f in self.findings}


class Killed(Exception):
    pass


class KillAt(L.Callback):
    """The run dies at the start of a step (the process state is gone: the restart builds all anew)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Killed(f"killed at step {self.step}")


def train(
    tmp_path,
    *,
    fault: bool = False,
    nan_forward: int | None = None,
    snapshots=True,
    steps: int = STEPS,
    samples: int = 64,
    extra: tuple = (),
    ckpt_path: str | None = None,
    **attach_kwargs,
):
    model, make_batch = tiny_llava(seed=0)
    forwards = []

    def nan_loss(module, args, output):
        if module.training:
            forwards.append(1)
            if len(forwards) == nan_forward:
                output.loss = output.loss * float("nan")
        return output

    model.register_forward_hook(nan_loss)
    module = Captioner(model)
    watch = Watch()
    callback = mscale.lightning.MscaleCallback(
        job_id="pl", snapshots=snapshots, connect=False, plugins=[watch], **attach_kwargs
    )

    class FaultyGpu(L.Callback):
        """From step 2 the vision tower's first GEMM goes wrong while the MPU is on the GPU it
        started on (registered after the guard, ahead of its checks)."""

        def on_train_start(self, trainer, pl_module) -> None:
            guard = callback.guard
            self.start = guard.mpu("vision").gpu
            linear = next(m for m in model.model.vision_tower.modules() if isinstance(m, torch.nn.Linear))

            def hit(mod, args, out):
                if fault and guard.current_step >= 2 and guard.mpu("vision").gpu == self.start:
                    out = out.clone()
                    out.view(-1)[0] = out.view(-1)[0] * 2.0**20 + 1e3  # a high exponent bit flipped
                    return out
                return None

            linear.register_forward_hook(hit, prepend=True)

    faulty = FaultyGpu()
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_steps=steps,
        accumulate_grad_batches=ACCUM,
        precision="bf16-mixed",
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in extra),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.callbacks += [callback, faulty, *extra]
    loader = torch.utils.data.DataLoader(Samples(make_batch, samples), batch_size=2, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module, callback, watch, faulty, len(forwards)


def finite(module) -> bool:
    return all(torch.isfinite(p).all() for p in module.parameters())


def test_clean_run_is_quiet_and_steps_are_the_optimizers_real_steps(tmp_path) -> None:
    trainer, module, callback, watch, _, forwards = train(tmp_path)
    assert watch.reasons() <= QUIET, watch.findings
    assert watch.ends == list(range(STEPS)) and forwards == STEPS * ACCUM  # one guard step per optimizer step
    assert trainer.global_step == STEPS and finite(module)
    assert [(m.name, m.path) for m in callback.guard.mpus] == [
        ("vision", "model.model.vision_tower"),
        ("aligner", "model.model.multi_modal_projector"),
        ("text", "model.model.language_model"),
    ]
    opt = trainer.optimizers[0]
    assert "_closure_first" not in opt.step.__qualname__  # the closure-first step went at the end
    assert not any(
        getattr(fn, "__module__", "").startswith("mscale") for m in module.modules() for fn in m._forward_hooks.values()
    )


def test_fault_from_the_tests_own_hook_is_caught_and_healed(tmp_path) -> None:
    # every layer every step: this test is about the callback's way from a caught fault to its heal;
    # the budget's rotation and its detection bound are tests/test_checksum_budget.py's
    trainer, module, callback, watch, faulty, _ = train(tmp_path, fault=True, checksum=mscale.ChecksumConfig(full=True))
    caught = [f for f in watch.findings if f.reason is Reason.CHECKSUM_FAILURE and f.labels.get("mpu_id") == "001"]
    assert caught and caught[0].labels["step"] == "2", watch.findings
    swaps = [
        f
        for f in watch.findings
        if f.reason is Reason.HEAL_ACTION and f.labels.get("action") == "l1_swap" and f.labels["result"] == "applied"
    ]
    assert len(swaps) == 1
    assert callback.guard.mpu("vision").gpu != faulty.start  # moved off the faulty GPU
    assert all(int(f.labels["step"]) <= int(swaps[0].labels["step"]) for f in caught)  # clean there
    assert trainer.global_step == STEPS and finite(module)


def test_nan_step_rolls_back_model_optimizer_schedulers_and_the_loop(tmp_path) -> None:
    """NaN in the second batch of step 4; in-memory snapshots every 2 steps: the model, AdamW and
    the scheduler go back to step 2, Lightning's step counter to 3, and steps 3..5 run (again) on
    the batches that follow, to max_steps."""
    trainer, module, callback, watch, _, forwards = train(
        tmp_path, nan_forward=4 * ACCUM + 2, snapshots=mscale.SnapshotConfig(memory_every=2)
    )
    rollbacks = [f for f in watch.findings if f.reason is Reason.ROLLBACK]
    assert [f.labels["step"] for f in rollbacks] == ["2"], watch.findings
    assert watch.ends == [0, 1, 2, 3, 4, 3, 4, 5]
    assert trainer.global_step == STEPS and forwards == 8 * ACCUM and finite(module)
    opt = trainer.optimizers[0]
    # updates in the weights' optimizer state: 0, 1, 2 kept, 3 undone, 4 dropped, 3, 4, 5 again
    assert {int(s["step"]) for s in opt.state.values()} == {STEPS}
    # the scheduler was restored too: it counts the same 6 steps (Lightning stepped it 8 times)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == STEPS


def test_callback_takes_the_hugging_face_callbacks_arguments() -> None:
    with pytest.raises(TypeError, match="data= is not taken under Lightning"):
        mscale.lightning.MscaleCallback(job_id="x", data=[1, 2])
    with pytest.raises(TypeError, match="snapshots: expected"):
        mscale.lightning.MscaleCallback(job_id="x", snapshots=3.5)


def test_killed_run_restarts_from_lightnings_checkpoint_bitwise(tmp_path) -> None:
    """Lightning's own checkpoint every 2 optimizer steps (an epoch: 4 batches), the run killed
    in step 5, restarted with ckpt_path: the guard takes Lightning's step, and the run ends with
    the weights of the uninterrupted one. CMSA on, with a cold start of 4 steps and a threshold
    its gradients exceed: alpha fitted at step 4 rides in Lightning's checkpoint as the callback's
    state (without it the restart would begin a new, unclipped cold start)."""

    def ckpt(d):
        return L.pytorch.callbacks.ModelCheckpoint(dirpath=d, save_last=True, save_top_k=-1, every_n_train_steps=2)

    kw = {"samples": 8, "snapshots": True, "cmsa": CmsaConfig(base=0.05, warmup_steps=4)}
    _, ref, *_ = train(tmp_path / "ref", extra=(ckpt(tmp_path / "ref-ckpt"),), **kw)
    with pytest.raises(Killed):
        train(tmp_path / "run", extra=(ckpt(tmp_path / "ckpt"), KillAt(5)), **kw)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.exists()
    trainer, restarted, callback, watch, _, forwards = train(
        tmp_path / "run", extra=(ckpt(tmp_path / "ckpt"),), ckpt_path=str(last), **kw
    )
    assert watch.ends == [4, 5] and forwards == 2 * ACCUM  # resumed at the epoch's end, step 4
    assert watch.reasons() <= QUIET and trainer.global_step == STEPS
    cmsa = callback.guard.cmsa
    assert cmsa.rho is not None and cmsa.steps == 4 and any(cmsa.clipped.values())  # restored, then clipping
    ref_sd, sd = ref.state_dict(), restarted.state_dict()
    assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
